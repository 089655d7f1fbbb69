"""The suffix proposer (sglang/suffix.py) over SGLang's own NGRAM corpus, and the hybrid's draft hook."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_tts.core.hybrid import HybridRule
from sglang_tts.sglang.hybrid import HybridDrafting, _tail
from sglang_tts.sglang.suffix import SuffixProposer, first_chain


def _mask(parents: list[int]) -> np.ndarray:
    """An NGRAM result mask from each node's parent (-1: the root)."""
    n = len(parents)
    m = np.zeros((n, n), dtype=np.uint8)
    for i, p in enumerate(parents):
        if p >= 0:
            m[i] = m[p]
        m[i, i] = 1
    return m.reshape(-1)


def test_tail_reads_the_prompt_only_when_the_output_is_short():
    assert _tail(_Req("a", [1, 2, 3, 4], [5, 6]), 3) == ([4, 5, 6], 6)
    assert _tail(_Req("a", [1, 2], [5]), 5) == ([1, 2, 5], 3)
    assert _tail(_Req("a", [1, 2], [5, 6, 7, 8]), 3) == ([6, 7, 8], 6)


def test_first_chain_stops_where_the_chain_branches_or_pads():
    tokens = np.array([9, 1, 2, 3])
    assert first_chain(tokens, _mask([-1, 0, 1, 2]), 4) == [1, 2, 3]
    assert first_chain(tokens, _mask([-1, 0, 1, 0]), 4) == [1, 2]  # node 3 hangs from the root
    assert first_chain(tokens, _mask([-1, 0, 0, 0]), 4) == [1]


def test_the_proposer_drafts_from_prompts_outputs_and_other_requests():
    proposer = SuffixProposer(steps=3)
    proposer.add_prompts([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    chains = proposer.propose(["a", "b"], [[40, 5, 6], [41, 9]], [3, 2])
    assert chains[0] == [7, 8, 9]  # copies the prompt
    assert chains[1] == [10]  # the prompt ends there
    proposer.observe([[50, 51, 52, 53, 54, 55]])  # another request's output so far
    assert proposer.propose(["c"], [[99, 52, 53]], [3]) == [[54, 55]]
    proposer.forget(["a", "b", "c"])
    assert proposer._live == set()


class _Mode:
    def __init__(self, idle=False):
        self.idle = idle

    def is_idle(self):
        return self.idle


class _Batch:
    def __init__(self, idle=False):
        self.forward_mode = _Mode(idle)


class _Req:
    def __init__(self, rid, prompt, output):
        self.rid, self.origin_input_ids_unpadded, self.output_ids = rid, prompt, output


class _DraftWorker:
    """SGLang's EagleDraftWorker as the hook sees it: draft_forward and the topk-1 chain layout."""

    def __init__(self, steps=3, max_bs=4):
        self.calls = 0
        self.cuda_graph_runner = None
        self._topk1_parents_prealloc = torch.arange(-1, steps - 1).repeat(max_bs, 1)
        self._topk1_score_indices_prealloc = torch.arange(steps).repeat(max_bs, 1)

    def draft_forward(self, forward_batch):
        self.calls += 1
        bs = 2
        return self._topk1_parents_prealloc[:bs], self._topk1_score_indices_prealloc[:bs], torch.full((bs, 3), 77), None


def test_the_draft_hook_merges_rows_and_skips_the_drafter_when_every_request_takes_its_suffix():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    hybrid = HybridDrafting(3, HybridRule(3, margin=10.0), "cpu")  # margin: any full chain is taken
    worker = _DraftWorker()
    hybrid.install(worker)
    hybrid.install(worker)  # idempotent
    hybrid.on_prefill([_Req("a", prompt, []), _Req("b", [20, 21, 22, 23], [])])
    reqs = [_Req("a", prompt, [4, 5]), _Req("b", [20, 21, 22, 23], [30])]
    plan = hybrid.plan_round(reqs, steps=3)
    assert plan.use_suffix == [True, False]  # "b" has no match
    _, _, tokens, _ = worker.draft_forward(_Batch())
    assert tokens.tolist() == [[6, 7, 8], [77, 77, 77]] and worker.calls == 1
    assert hybrid.proposer_of(0) == "suffix" and hybrid.proposer_of(1) == "drafter"
    hybrid.round_done()
    hybrid.accepted("a", 3)
    hybrid.accepted("b", 0)
    plan = hybrid.plan_round([_Req("a", prompt, [4, 5, 6, 7, 8, 9])], steps=3)
    assert plan.all_suffix
    parents, scores, tokens, probs = worker.draft_forward(_Batch())
    assert worker.calls == 1 and hybrid.skipped_drafts == 1  # the drafter did not run
    assert tokens.tolist() == [[10, 4, 5]] and probs is None  # the prompt, then its own output
    assert parents.shape[0] == 1 and scores.tolist() == [[0, 1, 2]]
    hybrid.round_done()
    assert worker.draft_forward(_Batch())[2].shape == (2, 3)  # no plan: SGLang's draft as it is
    hybrid.plan_round(reqs, steps=5)  # longer than the proposer's chains: the drafter drafts
    assert hybrid.plan.use_suffix == [False, False] and hybrid.last_offer is None
    hybrid.forget(["a", "b"])
    assert hybrid.chooser.requests == {} and hybrid._prompted == set()


def test_a_shorter_round_takes_the_chains_head_and_the_modes_decide_who_drafts():
    """A controller moves the chain length (2 of the hybrid's 3) and sets the mode per window."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    hybrid = HybridDrafting(3, HybridRule(3, margin=10.0), "cpu")
    hybrid.on_prefill([_Req("a", prompt, []), _Req("b", [20, 21, 22, 23], [])])
    reqs = [_Req("a", prompt, [4, 5]), _Req("b", [20, 21, 22, 23], [30])]
    plan = hybrid.plan_round(reqs, steps=2)
    assert plan.use_suffix == [True, False] and plan.tokens.tolist() == [[6, 7], [0, 0]]
    assert hybrid.last_offer.offered == 0.5
    hybrid.round_done()
    hybrid.set_mode("drafter")
    assert hybrid.plan_round(reqs, steps=3).use_suffix == [False, False]
    hybrid.round_done()
    hybrid.set_mode("suffix")
    plan = hybrid.plan_round(reqs, steps=3)
    assert plan.all_suffix and plan.tokens.tolist() == [[6, 7, 8], [0, 0, 0]]  # "b": an empty chain
    hybrid.reset()
    assert hybrid.mode == "suffix"  # a cache flush keeps the controller's choice
    with pytest.raises(ValueError, match="hybrid mode"):
        hybrid.set_mode("ngram")


def test_rounds_are_timed_by_kind_and_the_cost_rule_skips_a_weak_drafter():
    hybrid = HybridDrafting(3, HybridRule(3, cost=True), "cpu")
    hybrid.chooser.prior = {"suffix": 0.0, "drafter": 0.1}  # a drafter that rarely lands a token
    worker = _DraftWorker()
    hybrid.install(worker)
    hybrid.on_prefill([_Req("b", [20, 21, 22, 23], [])])
    reqs = [_Req("b", [20, 21, 22, 23], [30])]
    assert hybrid.plan_round(reqs, steps=3).use_suffix == [False]  # costs not measured yet: the plain rule
    worker.draft_forward(_Batch())
    hybrid.round_done()
    hybrid.plan_round(reqs, steps=3)  # the first round's time is recorded as a drafter round
    assert len(hybrid.costs._seconds[(1, 3)]["drafter"]) == 1
    for _ in range(4):  # measured: a round without the drafter's steps costs 3/4 of one with them
        hybrid.costs.record("suffix", 1, 3, 0.06)
        hybrid.costs.record("drafter", 1, 3, 0.08)
    hybrid.round_done()
    plan = hybrid.plan_round(reqs, steps=3)
    assert plan.all_suffix and plan.tokens.tolist() == [[0, 0, 0]]  # no chain: the bonus token alone
    worker.draft_forward(_Batch())
    assert worker.calls == 1 and hybrid.skipped_drafts == 1
    hybrid.round_done()
    hybrid.plan_round(reqs, steps=3)
    assert len(hybrid.costs._seconds[(1, 3)]["suffix"]) == 5  # that round: a suffix round
    hybrid.on_prefill([_Req("c", [40, 41], [])])  # a prefill: the open round is not a round's
    hybrid.plan_round(reqs, steps=3)
    assert len(hybrid.costs._seconds[(1, 3)]["suffix"]) == 5
