"""scripts/drift_rehearsal_offline.py on a tiny target and a tiny EAGLE-3 drafter: its sampled-rule score is
the greedy agreement at temperature 0, the chain's kept probability by hand at T > 0, and never above the
oracle's; a rehearsal through the serving code path moves the score."""

from __future__ import annotations

import copy

import pytest
import torch
from scripts_testing import load_script, tiny_target_and_eagle3

from sglang_tts.config import TTSConfig
from sglang_tts.core.distiller import Distiller
from sglang_tts.core.prompt import PromptWindow, collate_windows


@pytest.fixture(scope="module")
def script():
    return load_script("drift_rehearsal_offline")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, _, drafter = tiny_target_and_eagle3(tmp_path_factory.mktemp("drift_rehearsal"))
    return model, drafter


def _text(n: int = 48, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def test_greedy_is_the_agreement_with_the_targets_tokens(script, tiny):
    model, drafter = tiny
    ids, prompt_len, chain = _text(), 20, 3
    r = script.read(model, ids, prompt_len, drafter.cfg.aux_layer_ids, 0.0)
    drafts = script.chain_drafts(drafter, prompt_len, ids, r.feats, chain)
    top1 = r.probs.argmax(-1)
    # by hand: leading drafts equal to the target's greedy token at their position
    rows = range(prompt_len - 1, len(ids) - 1 - chain)
    runs = []
    for k, row in enumerate(rows):
        n = 0
        while n < chain and int(drafts[k, n]) == int(top1[row + n + 1]):
            n += 1
        runs.append(n)
    assert script.drafter_score(drafter, r, chain, 1000) == pytest.approx(sum(runs) / len(runs))
    assert script.oracle_score(r, chain, 1000) == pytest.approx(chain)  # the greedy oracle is always kept


def test_sampled_rule_keeps_the_chains_probability_and_the_oracle_bounds_every_drafter(script, tiny):
    model, drafter = tiny
    ids, prompt_len, chain = _text(seed=1), 16, 3
    r = script.read(model, ids, prompt_len, drafter.cfg.aux_layer_ids, 1.0)
    assert torch.allclose(r.probs.sum(-1), torch.ones(len(ids)))
    drafts = script.chain_drafts(drafter, prompt_len, ids, r.feats, chain)
    k, row = 3, prompt_len - 1 + 3
    p = [float(r.probs[row + j + 1, drafts[k, j]]) for j in range(chain)]
    by_hand = p[0] + p[0] * p[1] + p[0] * p[1] * p[2]
    only_row_k = script.expected_accepted(
        script.Read(r.ids, r.prompt_len + k, r.feats, r.probs), drafts[k:], 1
    )  # the first scored row is row k
    assert only_row_k == pytest.approx(by_hand, rel=1e-5)
    oracle = script.oracle_score(r, chain, 1000)
    assert 0.0 < script.drafter_score(drafter, r, chain, 1000) <= oracle <= chain
    random_drafts = torch.randint(0, 512, drafts.shape, generator=torch.Generator().manual_seed(2))
    assert script.expected_accepted(r, random_drafts, 1000) <= oracle


def test_a_rehearsal_through_the_serving_path_moves_the_drafters_score(script, tiny):
    model, base = tiny
    layers = base.cfg.aux_layer_ids
    text = _text(64, seed=4)
    r = script.read(model, text, 16, layers, 1.0)
    window = PromptWindow("t", text.clone(), r.feats[:-1].clone(), 0)
    drafter = copy.deepcopy(base)
    config = TTSConfig(prompt_adapt="only", prompt_positions=64, prompt_steps=4, prompt_lr=1e-2, log_interval=0)
    distiller = Distiller(drafter, config)
    distiller.submit_prompt(collate_windows([window], "cpu"))
    distiller.barrier(force=True)
    assert distiller.stats.num_prompt_updates == 1
    assert distiller.stats.last_prompt_loss_after < distiller.stats.last_prompt_loss
    assert script.drafter_score(drafter, r, 3, 1000) != script.drafter_score(base, r, 3, 1000)
