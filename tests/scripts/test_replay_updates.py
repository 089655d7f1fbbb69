"""scripts/replay_updates.py on a tiny target and a tiny EAGLE-3 drafter: the replay drafts what the
drafter's own training-time unroll predicts, each schedule trains on the rounds it names (one row,
the whole stride window or its last W rounds, each row reading the cache as it was at its round),
the guard's scores are the base drafter's, and a rerun skips what is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from scripts_testing import load_script

from sglang_tts.bench.tiny_models import TinyTargetSpec, write_tiny_target
from sglang_tts.drafters.checkpoints import write_tiny_eagle3


@pytest.fixture(scope="module")
def script():
    return load_script("replay_updates")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("replay_updates")
    target = write_tiny_target(root / "tiny-target", TinyTargetSpec(vocab_size=512, num_hidden_layers=4))
    config = json.loads((target / "config.json").read_text())
    return target, write_tiny_eagle3(root / "tiny-eagle3", config)


@pytest.fixture(scope="module")
def setup(script, tiny):
    from sglang_tts.drafters.loading import load_drafter
    from sglang_tts.training.target import load_target

    target_path, drafter_path = tiny
    model, _, target = load_target(target_path)
    base = load_drafter(drafter_path, target_embedding=target.embedding.float(), target_config=target.config)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (72,), generator=gen).tolist()
    trace = script.target_trace(model, "p", ids[:24], ids[24:], base.cfg.aux_layer_ids)
    return trace, base, target.lm_head.float()


def _config(script, **kw):
    return script.TTSConfig(update_stride=1, sync=True, log_interval=0, **kw)


@torch.no_grad()
def test_frozen_drafts_what_the_drafters_own_unroll_predicts(script, setup):
    trace, base, lm_head = setup
    replay = script.Replay(trace, base, lm_head, "frozen", _config(script), chain=3)
    done, update_s = replay.run(48)
    assert update_s == 0.0 and done[0][0] == 0
    # Independently: one causal training-time-test unroll over the whole sequence.
    ids, feats, p = trace.ids, trace.feats, trace.prompt_len
    hidden = base.ttt_hidden(ids[None, 1:], feats[None, :-1], torch.arange(1, len(ids))[None], steps=3)
    d2t = base.draft_to_target_ids()
    for position, accepted in done:
        row = p + position - 1  # the anchor's row: it embeds the anchor token
        preds = [int(d2t[(hidden[j][0, row] @ base.lm_head_weight().T).argmax()]) for j in range(3)]
        truth = ids[p + position + 1 : p + position + 4].tolist()
        expected = 0
        while expected < len(truth) and preds[expected] == truth[expected]:
            expected += 1
        assert accepted == expected
    # Rounds tile the answer: each commits its accepted drafts and the bonus token.
    assert all(b[0] - a[0] == a[1] + 1 for a, b in zip(done, done[1:]))


@pytest.mark.parametrize("schedule, rows_per_update", [("latest:3", 1), ("window:3", 3), ("window:3:2", 2)])
def test_each_schedule_trains_on_the_rounds_it_names(script, setup, schedule, rows_per_update):
    trace, base, lm_head = setup
    replay = script.Replay(trace, base, lm_head, schedule, _config(script, lr=1e-2), chain=3)
    seen = []
    observe = replay.distiller.observe

    def spy(canvas, owned=False):
        seen.append((canvas.batch_size, canvas.past_mask.sum(1).tolist(), canvas.features.clone()))
        return observe(canvas, owned)

    replay.distiller.observe = spy
    before = [t.clone() for t in replay.drafter.parameters()]
    done, update_s = replay.run(48)
    assert len(seen) == len(done) // 3 and update_s > 0
    assert {b for b, _, _ in seen} == {rows_per_update}
    anchors = [trace.prompt_len + position for position, _ in done]
    for i, (_, masks, features) in enumerate(seen):
        rounds = anchors[3 * i + 3 - rows_per_update : 3 * i + 3]
        assert masks == [a - 1 for a in rounds]  # each row reads the cache as it was at its round
        assert torch.equal(features, trace.feats[[a - 1 for a in rounds]])
    stats = replay.distiller.stats  # empty: no canvas position's target token is in the tiny draft vocabulary
    assert stats.num_updates + stats.num_empty_updates == len(seen) and stats.num_updates > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, replay.drafter.parameters()))  # published


def test_the_guard_scores_are_the_base_drafters(script, setup):
    trace, base, lm_head = setup
    frozen = script.Replay(trace, base, lm_head, "frozen", _config(script), chain=3)
    frozen.run(48)
    replay = script.Replay(trace, base, lm_head, "latest:1", _config(script, lr=1e-2), chain=3)
    done, _ = replay.run(48)
    assert replay.guard_rows == len(done)
    # Base with its own cache is the frozen drafter: at every anchor, the frozen replay's first draft.
    for position, _ in done:
        anchor = trace.prompt_len + position
        assert replay.first_match(base, anchor, replay.base_pool) == frozen.first_match(base, anchor, frozen.pool)
    # The served cache holds the adapted drafters' entries: not the frozen drafter's.
    assert not torch.equal(replay.pool[0][0], replay.base_pool[0][0])


def test_writes_the_report_and_a_rerun_skips_what_is_done(script, tiny, tmp_path):
    target, drafter = tiny
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "q", "prompt": "Write a long story about a robot."}) + "\n")
    out = tmp_path / "out"
    argv = [
        "--model", str(target), "--drafter", str(drafter), "--datasets", str(prompts), "--num-prompts", "1",
        "--answer-tokens", "24", "--schedules", "frozen", "latest:2", "window:2", "--threads", "1",
        "--out", str(out), "--cache-dir", str(tmp_path / "cache"),
    ]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        rows = script.main(argv)
        saved = json.loads((out / "replay_updates.json").read_text())
        assert [r["schedule"] for r in saved["rows"]] == ["frozen", "latest:2", "window:2"]
        frozen = saved["rows"][0]
        assert frozen["updates"] == 0 and frozen["modelled_speed"] == 1.0
        for r in saved["rows"][1:]:
            assert r["updates"] == r["rounds"] // 2 and r["update_s"] > 0
        assert (out / "replay_updates.md").read_text().count("| latest:2 |") == 2
        assert (out / "replay_updates.png").stat().st_size > 0
        again = script.main(argv)
    finally:
        torch.set_num_threads(threads)
    assert [(r.prompt, r.schedule, r.update_s) for r in again] == [(r.prompt, r.schedule, r.update_s) for r in rows]


def test_a_trainable_subset_moves_only_its_parameters(script, setup):
    """--trainable fc (as --tts-trainable): the replayed updates change fc and nothing else."""
    trace, base, lm_head = setup
    replay = script.Replay(trace, base, lm_head, "latest:1", _config(script, lr=1e-2, trainable=("fc",)), chain=3)
    before = {n: t.clone() for n, t in replay.drafter.named_parameters()}
    replay.run(48)
    assert replay.distiller.stats.num_updates > 0
    moved = {n for n, t in replay.drafter.named_parameters() if not torch.equal(t, before[n])}
    assert moved == {"fc.weight"}
