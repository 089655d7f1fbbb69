"""Hybrid drafting in SGLang's EAGLE-3 worker: the suffix proposer's chain in the drafter's slots.

Per decode round (`plan`, before the draft): each request's context goes to the suffix proposer
(sglang/suffix.py), and the rule (core/hybrid.py) picks the chain to verify. The draft itself is
SGLang's: `draft_forward` (eager) and the draft CUDA graph's `execute` are wrapped so that
- when every request of the batch takes its suffix chain, the drafter's steps do not run at all
  (the draft-extend after verify still runs: it keeps the drafter's KV cache whole for the next
  round the drafter drafts);
- when every request of the batch is retired (core/hybrid.py: its drafter never drafts for it
  again), the draft-extend after verify does not run either: SGLang's own stub for a skipped
  extend (`_stub_skipped_draft_extend`, its zero-step path) fills the next draft input's shapes.
  A retired request's drafter K/V is then left with gaps, which nothing uses: its chain is the
  suffix proposer's (where the drafter drafts for others in its batch, its row is replaced), and
  TTS's canvases leave retired requests out. In a batch that mixes retired and drafting requests
  the extend runs for all;
- otherwise the drafter drafts and the chosen requests' rows are replaced, one device `where`.
Either way the verify input is SGLang's chain of the same shape (topk 1, `steps` drafted tokens):
the verify, its CUDA graph and the acceptance rule are untouched. Greedy output is the target's
whatever was proposed; sampled verification with the default target-only rule stays exact for a
deterministic proposal (the suffix chain depends on the context only).

The chain length may move between rounds (the RL controller switches SGLang's adaptive states):
the proposer looks up chains of the longest length (`steps`, the rule's) and each round takes the
first `round steps` tokens; the rule's shortest chain is capped at the round's length. The
controller's proposer action sets `mode` (core/hybrid.py MODES); otherwise it stays HYBRID.

Round costs (`--tts-hybrid-cost`): the time from one decode round's plan to the next is that round's
cost, recorded by kind (the drafter's steps skipped or run), batch size and chain length
(core/hybrid.py RoundCosts); an interval with a prefill in it is not a round's. On CPU the inline
update lands in some intervals; the medians leave them out.

The committed tokens are read from `req.output_ids` on the host, which requires the scheduler
without overlap (SGLang's own NGRAM reads them the same way); the worker refuses otherwise.
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from sglang_tts.core.hybrid import DRAFTER, HYBRID, MODES, SUFFIX, HybridChooser, HybridRule, RoundCosts
from sglang_tts.sglang.suffix import SuffixProposer

logger = logging.getLogger(__name__)

# Test hook: SGLANG_TTS_HYBRID_SPLIT=1 gives every other request (by a hash of its id) the suffix
# proposer's chain, however short (0-padded), and the others the drafter's: a batch that mixes
# proposers from its first round, for the distribution tests. Never a serving setting.
SPLIT_ENV = "SGLANG_TTS_HYBRID_SPLIT"


@dataclass
class RoundPlan:
    request_ids: list[str]
    use_suffix: list[bool]  # per request of the batch
    tokens: torch.Tensor | None  # [bs, steps] suffix chains (0-padded), on the device; None: none taken
    mask: torch.Tensor | None  # [bs, 1] bool, on the device
    retired: list[bool] = field(default_factory=list)  # per request: its drafter is retired (suffix only)

    @property
    def all_retired(self) -> bool:
        return bool(self.retired) and all(self.retired)

    @property
    def all_suffix(self) -> bool:
        return bool(self.use_suffix) and all(self.use_suffix)

    @property
    def any_suffix(self) -> bool:
        return any(self.use_suffix)


def _tail(req, n: int) -> tuple[list[int], int]:
    """The last `n` tokens of the request's context (prompt, then output) and the context's length."""
    prompt, output = req.origin_input_ids_unpadded, req.output_ids
    tail = list(output[-n:])
    need = n - len(tail)  # the prompt's last tokens fill a short output's tail
    if need > 0:
        tail = [*prompt[max(0, len(prompt) - need) :], *tail]
    return tail, len(prompt) + len(output)


@dataclass
class RoundOffer:
    """What the suffix proposer offered a decode round, for the controller's state (host floats)."""

    offered: float  # share of the batch's requests with a chain of at least the rule's min match
    expected: float  # mean over the batch of the suffix proposer's expected accepted tokens / round steps


class HybridDrafting:
    def __init__(self, steps: int, rule: HybridRule, device, proposer: SuffixProposer | None = None) -> None:
        self.steps = steps  # the longest chain (the rule's); a round may draft fewer
        self.device = torch.device(device)
        self.proposer = proposer if proposer is not None else SuffixProposer(steps)
        self.chooser = HybridChooser(rule)
        self.plan: RoundPlan | None = None
        self._prompted: set[str] = set()  # requests whose prompt is in the trie (live ones only)
        self.split = os.environ.get(SPLIT_ENV, "0") == "1"
        self.skipped_drafts = 0  # rounds whose drafter steps did not run (every request took its suffix)
        self.skipped_extends = 0  # rounds whose draft-extend did not run (every request retired)
        self.retirements = 0  # requests whose drafter was retired (core/hybrid.py), since start
        self.mode = HYBRID  # MODES; the controller's proposer action sets it
        self.last_offer: RoundOffer | None = None  # the latest decode round's
        self.costs = RoundCosts()
        self._open_round: tuple[int, int, float] | None = None  # (batch size, steps, start) of the round in flight
        self._round_kind = DRAFTER  # SUFFIX once the round in flight skipped the drafter's steps
        self.last_costs: dict[str, float | None] = {}  # median seconds per round kind at the latest round's shape

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"hybrid mode must be one of {MODES}, got {mode!r}")
        self.mode = mode

    def reset(self) -> None:
        """Forget everything: the trie, the per-request state and what other requests taught (a cache flush)."""
        self.proposer.reset()
        self.chooser = HybridChooser(self.chooser.rule)
        self._prompted.clear()
        self.plan = None

    # --- per round ---------------------------------------------------------------------------

    def on_prefill(self, reqs) -> None:
        """A prefill batch: its prompts enter the trie (a prompt prefilled in chunks: once)."""
        new = [req for req in reqs if req.rid not in self._prompted]
        self._prompted.update(req.rid for req in new)
        self._open_round = None  # the round before this prefill did not end at the next plan
        self.proposer.add_prompts([req.origin_input_ids_unpadded for req in new])

    def plan_round(self, reqs, steps: int) -> RoundPlan:
        """Before the draft of a decode round of `steps` drafted tokens: who verifies the suffix chain."""
        rids = [req.rid for req in reqs]
        self.last_offer = None
        now = time.perf_counter()
        if self._open_round is not None:
            size, round_steps, start = self._open_round
            self.costs.record(self._round_kind, size, round_steps, now - start)
        self._open_round, self._round_kind = (len(reqs), steps, now), DRAFTER
        if not 1 <= steps <= self.steps:  # longer than the proposer's chains (never with a checked launch)
            for rid, req in zip(rids, reqs):
                self.chooser.drafter_only(rid, req.output_ids)
            self.plan = RoundPlan(rids, [False] * len(reqs), None, None)
            return self.plan
        tails, lengths = zip(*(_tail(req, self.proposer.depth) for req in reqs))
        self.proposer.observe(tails)  # the last round's commits: the newest n-grams of the batch
        chains = [chain[:steps] for chain in self.proposer.propose(rids, tails, lengths)]
        need = min(self.chooser.rule.min_match, steps)
        self.last_costs = {kind: self.costs.seconds(kind, len(reqs), steps) for kind in (SUFFIX, DRAFTER)}
        ratio = self.costs.ratio(len(reqs), steps) if self.chooser.rule.cost else 1.0
        scores = None
        if self.chooser.rule.score == "chain":  # each offered chain's score from its request's own context
            scores = [
                self.chooser.score(rid, req.origin_input_ids_unpadded, req.output_ids, chain)
                if len(chain) >= need and not self.chooser.retired(rid)
                else None
                for rid, req, chain in zip(rids, reqs, chains)
            ]
        outputs = [req.output_ids for req in reqs]
        use = self.chooser.choose_batch(rids, chains, outputs, self.mode, need, ratio, scores)
        if self.split:
            use = [zlib.crc32(rid.encode()) % 2 == 0 for rid in rids]
            for rid, u in zip(rids, use):
                self.chooser.requests[rid].choice = SUFFIX if u else DRAFTER
        self.last_offer = RoundOffer(
            offered=sum(len(chain) >= need for chain in chains) / len(chains),
            expected=sum(min(self.chooser.expected(rid), steps) for rid in rids) / (len(rids) * steps),
        )
        tokens = mask = None
        if any(use):
            pad = [0] * steps
            rows = [(chain + pad)[:steps] if u else pad for chain, u in zip(chains, use)]
            tokens = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
            mask = torch.tensor(use, dtype=torch.bool).view(-1, 1).to(self.device, non_blocking=True)
        retired = [self.chooser.retired(rid) for rid in rids]
        self.plan = RoundPlan(rids, use, tokens, mask, retired)
        return self.plan

    def round_done(self) -> None:
        self.plan = None

    def accepted(self, rid: str, num_accepted: int) -> str | None:
        was = self.chooser.retired(rid)
        proposer = self.chooser.accepted(rid, num_accepted)
        if not was and self.chooser.retired(rid):
            self.retirements += 1
            logger.info("sglang-tts: hybrid retired the drafter for request %s (suffix chains only)", rid)
        return proposer

    def retired(self, index: int) -> bool:
        """Is the drafter retired for request `index` of the round in flight?"""
        plan = self.plan
        return plan is not None and bool(plan.retired) and plan.retired[index]

    def forget(self, rids: Sequence[str]) -> None:
        for rid in rids:
            self.chooser.forget(rid)
            self._prompted.discard(rid)
        self.proposer.forget(rids)

    # --- the draft -----------------------------------------------------------------------------

    def install(self, draft_worker, stub_extend: Callable | None = None) -> None:
        """Wrap SGLang's draft step(s): `draft_forward` (eager) and, once it exists, the draft CUDA
        graph runner's `execute` (created after the worker, at CUDA graph capture); and, given
        `stub_extend(batch, batch_output)` (SGLang's `_stub_skipped_draft_extend`), the draft-extend
        after verify, skipped for a batch whose requests are all retired. Idempotent."""
        if not getattr(draft_worker.draft_forward, "_tts_hybrid", False):
            draft_worker.draft_forward = self._wrap(draft_worker.draft_forward, draft_worker)
        if stub_extend is not None:
            extend = draft_worker._draft_extend_for_decode
            if not getattr(extend, "_tts_hybrid", False):
                draft_worker._draft_extend_for_decode = self._wrap_extend(extend, stub_extend)
        runner = getattr(draft_worker, "cuda_graph_runner", None)
        if runner is not None and not getattr(runner.execute, "_tts_hybrid", False):
            runner.execute = self._wrap(runner.execute, draft_worker)

    def _wrap(self, run: Callable, draft_worker) -> Callable:
        """`run(forward_batch) -> (parent_list, top_scores_index, draft_tokens [bs, steps], draft_probs)`
        with the round's plan applied. The skipped draft returns SGLang's preallocated topk-1 chain
        layout (`_topk1_parents_prealloc`, `_topk1_score_indices_prealloc`: [max_bs, ...])."""

        def hybrid_run(forward_batch, *args, **kwargs):
            plan = self.plan
            if plan is None or not plan.any_suffix or forward_batch.forward_mode.is_idle():
                return run(forward_batch, *args, **kwargs)
            bs = len(plan.use_suffix)
            parents = draft_worker._topk1_parents_prealloc
            if plan.all_suffix and bs <= parents.shape[0]:
                self.skipped_drafts += 1
                self._round_kind = SUFFIX
                return parents[:bs], draft_worker._topk1_score_indices_prealloc[:bs], plan.tokens, None
            parent_list, top_scores_index, draft_tokens, draft_probs = run(forward_batch, *args, **kwargs)
            if draft_tokens.shape != plan.tokens.shape:  # padded graph batch or another layout: as drafted
                for rid in plan.request_ids:
                    self.chooser.set_drafter(rid)
                self.plan = RoundPlan(plan.request_ids, [False] * bs, None, None)
                return parent_list, top_scores_index, draft_tokens, draft_probs
            merged = torch.where(plan.mask, plan.tokens.to(draft_tokens.dtype), draft_tokens)
            return parent_list, top_scores_index, merged, draft_probs

        hybrid_run._tts_hybrid = True
        return hybrid_run

    def _wrap_extend(self, extend: Callable, stub_extend: Callable) -> Callable:
        """SGLang's `_draft_extend_for_decode(batch, batch_result, ...)`, or its stub when every
        request of the round is retired (the same batch the plan was made for)."""

        def hybrid_extend(batch, batch_result, *args, **kwargs):
            plan = self.plan
            if plan is None or not plan.all_retired or len(plan.retired) != len(batch.reqs):
                return extend(batch, batch_result, *args, **kwargs)
            self.skipped_extends += 1
            return stub_extend(batch, batch_result)

        hybrid_extend._tts_hybrid = True
        return hybrid_extend

    def proposer_of(self, index: int) -> str:
        plan = self.plan
        return SUFFIX if plan is not None and plan.use_suffix[index] else DRAFTER
