"""scripts/verify_rule_offline.py on a tiny target and a tiny EAGLE-3 drafter: its two acceptance
probabilities are what the two verify rules, run as sampling, keep; its drafter rows line up with the
positions drafter_by_position.py scores; the report is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from scripts_testing import load_script, tiny_target_and_eagle3


@pytest.fixture(scope="module")
def script():
    return load_script("verify_rule_offline")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, _, drafter = tiny_target_and_eagle3(tmp_path_factory.mktemp("verify_rule"))
    return model, drafter


@torch.no_grad()
def test_both_probabilities_are_what_the_rules_keep_when_run(script, tiny):
    """Per position, simulate each rule many times from the two models' own distributions (computed here
    from the logits, not through the script) and compare with the script's closed forms."""
    model, drafter = tiny
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (40,), generator=gen)
    temperature, start = 0.8, 30
    target_only, rejection = script.first_step_acceptance(model, drafter, ids, start, temperature)
    assert target_only.shape == rejection.shape == (len(ids) - start,)

    out = model(input_ids=ids[None], output_hidden_states=True)
    feats = torch.stack([out.hidden_states[i + 1][0] for i in drafter.cfg.aux_layer_ids], dim=1).flatten(1)
    hidden = drafter.ttt_hidden(ids[None, 1:], feats[None, :-1], torch.arange(1, len(ids))[None], steps=1)[0][0]
    d2t = drafter.draft_to_target_ids()
    trials = 20000
    for k, t in enumerate(range(start, len(ids))):
        q = torch.softmax((hidden[t - 2] @ drafter.lm_head_weight().T) / temperature, -1)  # draft vocab
        p = torch.softmax(out.logits[0, t - 1] / temperature, -1)  # target vocab, the distribution of token t
        # target only: the drafter's argmax, kept when the target's sample equals it
        y = torch.multinomial(p, trials, replacement=True, generator=gen)
        kept = (y == d2t[q.argmax()]).float().mean()
        assert abs(float(kept) - float(target_only[k])) < 0.02, (t, float(kept), float(target_only[k]))
        # rejection sampling: x ~ q, kept when u * q(x) < p(x)
        x = torch.multinomial(q, trials, replacement=True, generator=gen)
        u = torch.rand(trials, generator=gen)
        kept = (u * q[x] < p[d2t[x]]).float().mean()
        assert abs(float(kept) - float(rejection[k])) < 0.02, (t, float(kept), float(rejection[k]))


@torch.no_grad()
def test_rows_line_up_with_drafter_by_position(script, tiny):
    """At a temperature near 0 the target-only probability is 1 exactly where the drafter's step-0 pick is the
    target's greedy pick, which drafter_by_position.py scores for the same tokens."""
    model, drafter = tiny
    ids = torch.randint(0, 512, (48,), generator=torch.Generator().manual_seed(2))
    target_only, rejection = script.first_step_acceptance(model, drafter, ids, 2, 1e-4)
    hits = load_script("drafter_by_position").chain_hits(model, drafter, ids, steps=1)[:, 0]  # row t: token t + 2
    assert torch.equal(target_only > 0.5, hits[: len(ids) - 2])
    assert bool(((rejection > 0.5) == hits[: len(ids) - 2]).all())  # q and p both near one-hot there
    with pytest.raises(ValueError, match="start"):
        script.first_step_acceptance(model, drafter, ids, 1, 1.0)


def test_the_report_is_written(script, tmp_path: Path):
    result = {
        "model": "tiny", "drafter": "d", "command": "x", "temperatures": [1.0, 0.7], "max_new_tokens": 8,
        "prompts": [
            {"id": "a", "by_temperature": {"1.0": {"positions": 10, "target_only": 0.5, "rejection": 0.4},
                                           "0.7": {"positions": 10, "target_only": 0.6, "rejection": 0.6}}},
            {"id": "b", "by_temperature": {"1.0": {"positions": 30, "target_only": 0.3, "rejection": 0.2},
                                           "0.7": {"positions": 30, "target_only": 0.6, "rejection": 0.7}}},
        ],
    }  # fmt: skip
    script.write_report(result, tmp_path)
    md = (tmp_path / "verify_rule.md").read_text()
    assert "| a | 0.500 | 0.400 | 0.600 | 0.600 |" in md
    assert "| **pooled** | **0.350** | **0.250** | **0.600** | **0.675** |" in md  # weighted by positions
    assert json.loads((tmp_path / "verify_rule.json").read_text())["prompts"][1]["id"] == "b"
    assert (tmp_path / "verify_rule.png").read_bytes()[:4] == b"\x89PNG"
