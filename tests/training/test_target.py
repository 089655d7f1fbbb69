"""Target features: layer-id convention, final hidden state, caching, batching."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from sglang_tts.drafters.checkpoints import write_tiny_eagle3
from sglang_tts.drafters.dflash import DFlashDrafter
from sglang_tts.drafters.eagle3 import Eagle3Drafter
from sglang_tts.training.target import batch_indices, collate, compute_features, load_target_and_drafter


def test_features_follow_the_output_of_layer_convention(tiny_target, sequences, features):
    model = tiny_target.model
    ids = sequences.ids[0]
    with torch.no_grad():
        out = model(input_ids=ids[None], output_hidden_states=True)
    # id -1 is the embedding output, id i the output of decoder layer i.
    assert torch.equal(features.hidden[0][:, features.layers([-1])[0]], model.get_input_embeddings()(ids))
    for layer in (0, 1, 2):
        assert torch.allclose(features.hidden[0][:, features.layers([layer])[0]], out.hidden_states[layer + 1][0])
    # The final hidden state is the LM head's input: the teacher logits can be recomputed from it.
    logits = features.final[0] @ tiny_target.weights.lm_head.T
    assert torch.allclose(logits, out.logits[0], atol=1e-4)
    assert torch.equal(features.top1[0], out.logits[0].argmax(-1))


def test_feature_cache_is_reused(tiny_target, sequences, features, data_cache, monkeypatch):
    from sglang_tts.training import target as target_module

    monkeypatch.setattr(target_module, "sequence_features", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    again = compute_features(tiny_target.model, tiny_target.path, sequences, [2, 1, 0, -1], data_cache, False)
    assert again.layer_ids == features.layer_ids
    assert all(torch.equal(a, b) for a, b in zip(again.hidden, features.hidden))
    # A training window longer than every prompt cuts nothing and keeps the cache key.
    wide = compute_features(
        tiny_target.model, tiny_target.path, sequences, [-1, 0, 1, 2], data_cache, False, context=10_000
    )
    assert all(torch.equal(a, b) for a, b in zip(wide.final, features.final))


def test_collate_pads_and_marks_answers(sequences, features):
    batch = collate(sequences, features, [0, 1, 2])
    lengths = [len(sequences.ids[i]) for i in range(3)]
    assert batch.ids.shape == (3, max(lengths))
    assert batch.real.sum(1).tolist() == lengths
    for row in range(3):
        start = sequences.prompt_lens[row]
        assert batch.answer[row].nonzero().flatten().tolist() == list(range(start, lengths[row]))
        assert torch.equal(batch.hidden[row, : lengths[row]], features.hidden[row])


def test_batch_indices_cover_each_epoch_once():
    n, size = 7, 3
    seen = [i for step in range(7) for i in batch_indices(n, size, step, seed=1)]  # 3 epochs
    for epoch in range(3):
        assert sorted(seen[epoch * n : (epoch + 1) * n]) == list(range(n))
    assert batch_indices(n, size, 5, seed=1) == batch_indices(n, size, 5, seed=1)


def test_training_window_keeps_the_tail_of_each_sequence(tiny_target, sequences, features, tmp_path):
    context = 3  # tokens of prompt kept before each answer; the tiny prompts are all longer
    starts = sequences.window_starts(context)
    assert all(s > 0 for s in starts)
    windows = sequences.windowed(context)
    windowed = compute_features(
        tiny_target.model, tiny_target.path, sequences, [-1, 0, 1, 2], tmp_path, False, context=context
    )
    for i, start in enumerate(starts):
        assert windows.prompt_lens[i] == context
        assert torch.equal(windows.ids[i], sequences.ids[i][start:])
        assert torch.equal(next(iter(windows.subset([i]).answer_ids())), next(iter(sequences.subset([i]).answer_ids())))
        # The target still read the whole prompt: the stored tail equals the full-sequence features.
        assert torch.allclose(windowed.hidden[i], features.hidden[i][start:], atol=1e-5)
        assert torch.allclose(windowed.final[i], features.final[i][start:], atol=1e-5)
        assert torch.equal(windowed.top1[i], features.top1[i][start:])
    assert sequences.windowed(10_000).prompt_lens == sequences.prompt_lens
    assert sequences.window_starts(None) == [0] * len(sequences)


def test_features_of_an_extended_set_are_computed_only_for_its_new_sequences(
    tiny_target, sequences, features, data_cache, data_config, prompts_file, tmp_path, call_sizes
):
    from dataclasses import replace

    from sglang_tts.training import target as target_module
    from sglang_tts.training.data import build_sequence_set

    cache = tmp_path / "cache"
    shutil.copytree(data_cache, cache)
    extended_cfg = replace(data_config, extra_source=str(prompts_file), extra_prompts=12)
    extended = build_sequence_set(
        tiny_target.model, tiny_target.tokenizer, tiny_target.path, extended_cfg, cache, False
    )
    real = target_module.sequence_features
    computed = call_sizes(target_module, "sequence_features")
    got = compute_features(tiny_target.model, tiny_target.path, extended, [-1, 0, 1, 2], cache, False)
    assert len(computed) == len(extended) - len(sequences) == 4
    for name in ("hidden", "final", "top1"):
        assert all(torch.equal(a, b) for a, b in zip(getattr(got, name), getattr(features, name)))
    # The reused ones are what a fresh computation gives.
    fresh = real(tiny_target.model, extended.ids[0], [-1, 0, 1, 2])
    assert torch.equal(fresh["hidden"], got.hidden[0])
    # Other captured layers: another key, nothing reused.
    computed.clear()
    compute_features(tiny_target.model, tiny_target.path, extended, [0, 1], cache, False)
    assert len(computed) == len(extended)


def test_the_offline_scripts_load_a_target_and_its_drafter(tiny_llama, tmp_path):
    config = json.loads((tiny_llama / "config.json").read_text())
    drafter_path = write_tiny_eagle3(tmp_path / "tiny-eagle3", config)
    loaded = load_target_and_drafter(str(tiny_llama), str(drafter_path))
    assert loaded.target_path == tiny_llama and loaded.drafter_path == drafter_path
    assert isinstance(loaded.drafter, Eagle3Drafter) and not loaded.drafter.training
    assert not loaded.model.training and loaded.target.num_layers == config["num_hidden_layers"]
    with pytest.raises(ValueError, match="is not a DFlashDrafter"):
        load_target_and_drafter(str(tiny_llama), str(drafter_path), kind=DFlashDrafter)
    with pytest.raises(ValueError, match="no drafter ships for"):
        load_target_and_drafter(str(tiny_llama))  # a folder of our own: nothing ships for it


def test_cached_answers_are_greedy_or_seeded_samples_generated_once(tiny_target, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from sglang_tts.training import target as target_module

    prompts = [SimpleNamespace(id=f"p{i}", input_ids=[5 + i, 17, 42, 9]) for i in range(2)]
    greedy = target_module.cached_answers(tiny_target.model, prompts, 12, tmp_path / "greedy.pt")
    assert greedy == target_module.cached_greedy_answers(tiny_target.model, prompts, 12, tmp_path / "greedy2.pt")
    sampled = target_module.cached_answers(tiny_target.model, prompts, 12, tmp_path / "t1.pt", temperature=1.0, seed=3)
    again = target_module.cached_answers(tiny_target.model, prompts, 12, tmp_path / "t1b.pt", temperature=1.0, seed=3)
    other = target_module.cached_answers(tiny_target.model, prompts, 12, tmp_path / "t1c.pt", temperature=1.0, seed=4)
    assert sampled == again  # seeded per prompt: the same answers on another run
    assert sampled != greedy and sampled != other
    assert all(sampled[p.id][0] == p.input_ids and len(sampled[p.id][1]) <= 12 for p in prompts)
    # a second call reads the cache and generates nothing
    monkeypatch.setattr(tiny_target.model, "generate", lambda *a, **k: pytest.fail("generated again"))
    assert target_module.cached_answers(tiny_target.model, prompts, 12, tmp_path / "t1.pt", temperature=1.0) == sampled
