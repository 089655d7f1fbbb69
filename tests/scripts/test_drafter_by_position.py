"""scripts/drafter_by_position.py on a tiny target and a tiny EAGLE-3 drafter: the teacher-forced chains
it scores are the chains a served (replayed) frozen drafter drafts, the short-context comparison lines up
the same positions, and the report is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from scripts_testing import load_script, tiny_target_and_eagle3

from sglang_tts.training.target import sequence_features


@pytest.fixture(scope="module")
def script():
    return load_script("drafter_by_position")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, target, drafter = tiny_target_and_eagle3(tmp_path_factory.mktemp("drafter_by_position"))
    return model, target, drafter


@torch.enable_grad()
def _fit(drafter, model, ids: torch.Tensor, steps: int = 3, iters: int = 40):
    """A copy of `drafter` trained a little on `ids` (teacher forced, every chain step), so it drafts some
    tokens right."""
    import copy

    drafter = copy.deepcopy(drafter)
    layer_ids = sorted(set(drafter.cfg.aux_layer_ids))
    feats = sequence_features(model, ids, layer_ids)
    x = feats["hidden"][:, [layer_ids.index(i) for i in drafter.cfg.aux_layer_ids]].flatten(1)
    to_draft = torch.full((drafter.cfg.vocab_size,), -100)  # target id -> draft id (-100: not drafted)
    to_draft[drafter.draft_to_target_ids()] = torch.arange(drafter.cfg.draft_vocab_size)
    params = [p.requires_grad_(True) for _, p in drafter.trainable_named_parameters()]
    opt = torch.optim.Adam(params, lr=3e-3)
    n = len(ids)
    for _ in range(iters):
        hidden = drafter.ttt_hidden(ids[None, 1:], x[None, :-1], torch.arange(1, n)[None], steps=steps)
        loss = 0.0
        for j in range(steps):
            rows = n - 2 - j
            logits = hidden[j][0, :rows] @ drafter.lm_head_weight().T
            labels = to_draft[feats["top1"][j + 1 : j + 1 + rows]]
            loss = loss + torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter


@torch.no_grad()
def test_scored_chains_are_the_chains_a_frozen_drafter_drafts_along_a_greedy_answer(script, tiny):
    model, target, drafter = tiny
    replay_script = load_script("replay_updates")
    prompt = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(1))
    ids = model.generate(prompt[None], max_new_tokens=64, do_sample=False, min_new_tokens=64)[0]
    answer = ids[24:].tolist()
    drafter = _fit(drafter, model, ids)  # a random drafter accepts nothing: the comparison would be vacuous
    hits = script.chain_hits(model, drafter, ids, steps=3)
    assert hits.shape == (len(ids) - 1, 3) and not hits[-2:, 2].any()  # chains past the end score nothing

    trace = replay_script.target_trace(model, "p", prompt.tolist(), answer, drafter.cfg.aux_layer_ids)
    config = replay_script.TTSConfig(update_stride=1, sync=True, log_interval=0)
    replay = replay_script.Replay(trace, drafter, target.lm_head.float(), "frozen", config, chain=3)
    done, _ = replay.run(len(answer) - 4)
    assert sum(a for _, a in done) > 0  # the comparison is not vacuous
    for position, accepted in done:
        row = 24 + position - 1  # the anchor's row
        assert int(hits[row].int().cumprod(0).sum()) == accepted, (position, hits[row], accepted)

    buckets = script.summarize(hits, bucket=32)
    assert [b["from"] for b in buckets] == [2, 34, 66] and sum(b["rows"] for b in buckets) == len(ids) - 1
    assert all(0 <= b["accept_len"] <= 3 and len(b["acc"]) == 3 for b in buckets)


def test_the_short_context_comparison_lines_up_the_same_positions(script):
    length, n, skip, steps = 100, 40, 5, 3

    # A hit pattern that depends on the predicted position alone (a threshold inside the compared window):
    # both contexts then agree exactly, and a window one position off does not.
    def pattern(first_position: int, rows: int) -> torch.Tensor:
        pos = torch.arange(first_position, first_position + rows)[:, None] + torch.arange(steps)[None]
        return pos >= 80

    hits = pattern(2, length - 1)  # full-sequence row t predicts position t + 2 (+ j)
    short = pattern(length - n + 2, n - 1)  # short row s predicts position (length - n) + s + 2
    out = script.compare_short(hits, short, skip, steps)
    assert out["from"] == length - n + skip + 2 and out["tokens"] == n
    assert out["short_acc0"] == out["long_acc0"] and out["short_accept_len"] == out["long_accept_len"]
    shifted = script.compare_short(hits, pattern(length - n + 3, n - 1), skip, steps)  # one position off
    assert shifted["short_acc0"] != shifted["long_acc0"]


def test_the_report_is_written(script, tmp_path: Path):
    result = {
        "model": "tiny", "drafter": "d", "steps": 2, "bucket": 4, "command": "x",
        "prompts": [{"id": "p", "tokens": 9, "buckets": script.summarize(torch.ones(8, 2, dtype=torch.bool), 4),
                     "short_context": {"tokens": 4, "skip": 1, "from": 7, "short_acc0": 1.0, "long_acc0": 1.0,
                                       "short_accept_len": 2.0, "long_accept_len": 2.0}}],
    }  # fmt: skip
    script.write_report(result, tmp_path)
    md = (tmp_path / "drafter_by_position.md").read_text()
    assert "| 2-5 | 4 | 1.000 | 1.000 | 2.000 |" in md and "step-0 accuracy 1.000" in md
    assert json.loads((tmp_path / "drafter_by_position.json").read_text())["prompts"][0]["id"] == "p"
    assert (tmp_path / "drafter_by_position.png").read_bytes()[:4] == b"\x89PNG"
