"""The generated training set: greedy answers, lengths, caching and resume."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import torch
from safetensors.torch import save_file

from sglang_tts.data.prompts import load_prompts
from sglang_tts.testing.reference import hf_greedy
from sglang_tts.training import data as data_module
from sglang_tts.training.data import (
    DataConfig,
    build_sequence_set,
    export_answers,
    generation_batches,
    prompt_pool,
    prompt_token_ids,
    read_answer_set,
    write_prompt_split,
)


def test_sequences_are_prompt_plus_greedy_answer(sequences, tiny_target, data_config):
    from sglang_tts.data.prompts import load_prompts

    assert len(sequences) == data_config.num_prompts
    prompts = {p.id: p for p in load_prompts(data_config.source)}
    eos = tiny_target.tokenizer.eos_token_id
    for ids, start, key in zip(sequences.ids, sequences.prompt_lens, sequences.keys):
        prompt = prompt_token_ids(tiny_target.tokenizer, prompts[key], data_config.instruction)
        assert ids[:start].tolist() == prompt
        answer = ids[start:].tolist()
        assert 1 <= len(answer) <= data_config.max_new_tokens
        assert eos not in answer[:-1]  # cut right after the first EOS
        if len(answer) < data_config.max_new_tokens:
            assert answer[-1] == eos
    # Batched, left-padded greedy decoding gives the target's own unbatched greedy answers.
    for ids, start in zip(sequences.ids, sequences.prompt_lens):
        assert ids[start:].tolist() == hf_greedy(str(tiny_target.path), ids[:start].tolist(), len(ids) - start)


def test_cached_set_is_reused_and_partial_sets_resume(sequences, tiny_target, data_config, data_cache, call_sizes):
    cache_file = next(data_cache.glob("*-seqs-*.pt"))
    calls = call_sizes(data_module, "greedy_answers")
    again = build_sequence_set(
        tiny_target.model, tiny_target.tokenizer, tiny_target.path, data_config, data_cache, False
    )
    assert calls == []  # everything came from the cache
    assert [t.tolist() for t in again.ids] == [t.tolist() for t in sequences.ids]

    # An interrupted build: only 3 sequences made it to disk; the rerun generates the other 5.
    saved = torch.load(cache_file, weights_only=True)
    try:
        torch.save(
            {**saved, "keys": saved["keys"][:3], "ids": saved["ids"][:3], "prompt_lens": saved["prompt_lens"][:3]},
            cache_file,
        )
        resumed = build_sequence_set(
            tiny_target.model, tiny_target.tokenizer, tiny_target.path, data_config, data_cache, False
        )
    finally:
        torch.save(saved, cache_file)
    assert sum(calls) == len(sequences) - 3
    assert [t.tolist() for t in resumed.ids] == [t.tolist() for t in sequences.ids]


def test_other_settings_get_their_own_cache(tiny_target, data_config, tmp_path):
    short = replace(data_config, num_prompts=2, max_new_tokens=5)
    got = build_sequence_set(tiny_target.model, tiny_target.tokenizer, tiny_target.path, short, tmp_path, False)
    assert len(got) == 2 and all(len(i) - s <= 5 for i, s in zip(got.ids, got.prompt_lens))
    assert len(list(tmp_path.glob("*-seqs-*.pt"))) == 1


def test_generation_batches_keep_padded_prompt_tokens_within_the_budget():
    lengths = [100, 120, 300, 900, 1000, 5000, 6600, 6600]
    todo = [(f"p{i}", [0] * n) for i, n in enumerate(lengths)]
    batches = [[key for key, _ in chunk] for chunk in generation_batches(todo, batch_size=3, batch_prompt_tokens=2000)]
    # in order, every prompt once; at most 3 a batch; batch x longest <= 2000 unless a prompt is alone
    assert batches == [["p0", "p1", "p2"], ["p3", "p4"], ["p5"], ["p6"], ["p7"]]
    assert [key for b in batches for key in b] == [key for key, _ in todo]


def test_the_generation_batch_does_not_name_the_cache(tiny_target, data_config, data_cache):
    """Batch size and token budget do not change what the greedy answers mean: same cache file."""
    small = replace(data_config, batch_size=1, batch_prompt_tokens=1)
    again = build_sequence_set(tiny_target.model, tiny_target.tokenizer, tiny_target.path, small, data_cache, False)
    assert again.meta["cache"] == str(next(data_cache.glob("*-seqs-*.pt")))


def test_split_is_seeded_and_disjoint(sequences):
    train, held = sequences.split_indices(3, seed=0)
    assert sorted(train + held) == list(range(len(sequences))) and len(held) == 3
    assert sequences.split_indices(3, seed=0) == (train, held)
    assert sequences.split_indices(100, seed=0)[0]  # at least one sequence stays for training


def test_prompt_splits_are_written_as_benchmark_prompt_files(sequences, data_config, tmp_path):
    train, held = sequences.split_indices(3, seed=0)
    written = {}
    for name, indices in (("held_in", train), ("held_out", held)):
        path = write_prompt_split(tmp_path / f"{name}.jsonl", prompt_pool(data_config), sequences.subset(indices).keys)
        written[name] = load_prompts(str(path))  # what scripts/bench_long.py --datasets PATH reads
    pool = {p.id: p for p in load_prompts(data_config.source)}
    held_in, held_out = ([p.id for p in written[n]] for n in ("held_in", "held_out"))
    assert held_in == sequences.subset(train).keys and held_out == sequences.subset(held).keys
    assert not set(held_in) & set(held_out) and len(held_in) + len(held_out) == len(sequences)
    assert all(p.question == pool[p.id].question for p in written["held_in"] + written["held_out"])


def test_the_workloads_mix_is_sampled_evenly_and_keeps_self_contained_prompts(tmp_path):
    cfg = replace(DataConfig(), source="workloads:held-in", num_prompts=60, seed=0)
    pool = prompt_pool(cfg)
    counts = {name: sum(p.dataset == name for p in pool) for name in ("reasoning", "long-gen", "long-context")}
    assert counts == {"reasoning": 20, "long-gen": 20, "long-context": 20}
    held_out = {p.id for p in load_prompts("workloads:held-out")}
    assert not held_out & {p.id for p in pool}  # never a benchmark prompt
    assert pool == prompt_pool(cfg)
    # The benchmark's prompt file of the split keeps what format_chat needs.
    path = write_prompt_split(tmp_path / "held_in.jsonl", pool, [p.id for p in pool])
    again = {p.id: p for p in load_prompts(str(path))}
    assert all(again[p.id].self_contained == p.self_contained for p in pool)
    assert sum(p.self_contained for p in pool) == 40
    # One dataset: the plain seeded sample, as before.
    single = replace(cfg, source="math500", num_prompts=5)
    assert prompt_pool(single) == load_prompts("math500", 5, seed=0)


def test_extra_prompts_are_added_and_only_they_are_generated(
    sequences, tiny_target, data_config, data_cache, prompts_file, tmp_path, call_sizes
):
    # Another config that adds every other prompt of the file: the first source's sample is unchanged, and the
    # answers it already has are taken from the cached set of the first config, not generated again.
    cache = tmp_path / "cache"
    shutil.copytree(data_cache, cache)
    extended = replace(data_config, extra_source=str(prompts_file), extra_prompts=12)
    pool = prompt_pool(extended)
    assert pool[: data_config.num_prompts] == prompt_pool(data_config)
    assert len(pool) == 12 and len({p.id for p in pool}) == 12  # the 4 prompts the first sample left out
    calls = call_sizes(data_module, "greedy_answers")
    got = build_sequence_set(tiny_target.model, tiny_target.tokenizer, tiny_target.path, extended, cache, False)
    assert sum(calls) == 4
    assert got.keys[: len(sequences)] == sequences.keys
    assert all(torch.equal(a, b) for a, b in zip(got.ids, sequences.ids))
    assert len(list(cache.glob("*-seqs-*.pt"))) == 2  # its own cache file; the first config's is untouched
    # Held-out sequences come from the first source's part only, and are the same as without the extra prompts.
    train, held = got.split_indices(3, seed=0, among=len(sequences))
    assert held == sequences.split_indices(3, seed=0)[1]
    assert sorted(train + held) == list(range(len(got)))
    # Another answer length shapes the answers: nothing is reused.
    calls.clear()
    build_sequence_set(
        tiny_target.model, tiny_target.tokenizer, tiny_target.path, replace(extended, max_new_tokens=5), cache, False
    )
    assert sum(calls) == 12


def test_exported_answers_spare_a_fresh_cache_the_generation(
    sequences, tiny_target, data_config, data_cache, tmp_path, call_sizes
):
    exported = tmp_path / "answers.safetensors"
    stats = export_answers(next(data_cache.glob("*-seqs-*.pt")), exported)
    assert stats == {"sequences": len(sequences), "answer_tokens": sequences.num_answer_tokens()}
    calls = call_sizes(data_module, "greedy_answers")
    # A fresh machine: an empty cache, the exported file (the answers only: the prompts are rendered again).
    fresh = build_sequence_set(
        tiny_target.model, tiny_target.tokenizer, tiny_target.path, data_config, tmp_path / "fresh", False, [exported]
    )
    assert calls == []
    assert fresh.keys == sequences.keys and fresh.prompt_lens == sequences.prompt_lens
    assert [t.tolist() for t in fresh.ids] == [t.tolist() for t in sequences.ids]
    assert len(list((tmp_path / "fresh").glob("*-seqs-*.pt"))) == 1  # and cached like generated answers

    # Answers made with other settings, or to a prompt that renders differently now, are generated again.
    other = replace(data_config, max_new_tokens=5)
    build_sequence_set(
        tiny_target.model, tiny_target.tokenizer, tiny_target.path, other, tmp_path / "a", False, [exported]
    )
    assert sum(calls) == len(sequences)
    calls.clear()
    saved = read_answer_set(exported)
    digests = ["0" * 16, *saved.prompt_digests[1:]]
    tensors = {"answers": torch.cat(saved.answers).int(), "answer_lens": torch.tensor([len(a) for a in saved.answers])}
    tensors["prompt_lens"] = torch.tensor(saved.prompt_lens)
    header = {"shaping": saved.shaping, "keys": json.dumps(saved.keys), "prompt_digests": json.dumps(digests)}
    save_file(tensors, str(exported), metadata=header)
    build_sequence_set(
        tiny_target.model, tiny_target.tokenizer, tiny_target.path, data_config, tmp_path / "b", False, [exported]
    )
    assert sum(calls) == 1
