"""TTSRuntime: the per-worker glue between SGLang's rounds and the TTS core.

It owns the Distiller (update schedule, executor, rollback, publishing), the adaptation scope,
the per-request anchor features the next canvas needs, and the per-request counters reported
in meta_info. The worker calls exactly two methods: `before_draft(request_ids)` and
`after_verify(...)` (through the capture helpers).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass

import torch

from sglang_tts.config import TTSConfig
from sglang_tts.core.adapters import SlotTable
from sglang_tts.core.budget import StrideGovernor
from sglang_tts.core.canvas import Canvas, TeacherVocab
from sglang_tts.core.distiller import Distiller
from sglang_tts.core.executor import UpdateResult, make_executor
from sglang_tts.core.guard import SCOPE_UNIT
from sglang_tts.core.prompt import PromptWindow, collate_windows, cut_window
from sglang_tts.core.publish import WeightPublisher
from sglang_tts.core.scope import make_scope
from sglang_tts.sglang import metrics as tts_metrics
from sglang_tts.sglang.failures import FailureLog, fault_sites_from_env
from sglang_tts.sglang.requests import group_key, request_options

logger = logging.getLogger(__name__)

# Test hook: SGLANG_TTS_FAULT="nan@2,raise@4" makes update 2 produce a NaN loss and update 4 raise.
FAULT_ENV = "SGLANG_TTS_FAULT"
# Numerical self-check of the differentiable fallback against SGLang's drafted tokens (topk == 1).
CHECK_ENV = "SGLANG_TTS_CHECK_FALLBACK"


def fault_injector_from_env():
    spec = os.environ.get(FAULT_ENV, "").strip()
    if not spec:
        return None
    faults = {}
    for item in spec.split(","):
        kind, _, index = item.partition("@")
        faults[int(index)] = kind.strip()
    return lambda update_index: faults.get(update_index)


@dataclass
class RequestCounters:
    rounds: int = 0
    num_updates: int = 0
    num_skipped_updates: int = 0
    update_ms: float = 0.0
    fallback_checked: int = 0
    fallback_mismatches: int = 0
    fallback_skipped: int = 0  # drafted tokens the check could not re-predict (see TTSRuntime.observe)
    digest_start: str | None = None
    adapter_capped: int = 0  # 1: no adapter slot was free, the request drafted with the frozen drafter
    prompt_positions: int = 0  # prompt positions a kept prompt update trained on for this request
    prompt_steps: int = 0
    prompt_ms: float = 0.0  # run time of the prompt update(s) that included this request
    failures: int = 0  # TTS work that failed in rounds of this request (skipped; output unaffected)
    guard_resets: int = 0  # do-no-harm resets of the drafter this request drafted with (core/guard.py)
    trained_rounds: int = 0  # this request's verify rounds that kept updates trained on (--tts-update-window)
    update_stride: int = 0  # the update stride in force at the request's last round
    update_share: float = 0.0  # the measured share of serving time updates took, at its last round
    # --tts-hybrid: per proposer ("suffix", "drafter"), the rounds it drafted and its accepted drafted tokens
    proposer_rounds: dict[str, int] | None = None
    proposer_accepted: dict[str, int] | None = None
    drafter_retired: int = 0  # --tts-hybrid-retire-below: 1 once the request's drafter was retired
    idle_updates: int = 0  # --tts-hybrid: updates skipped in rounds of this request, the drafter having drafted none


REBOUND = -1  # a drafted version no weight version equals (context_rebound)


class TTSRuntime:
    def __init__(
        self,
        drafter: torch.nn.Module,
        config: TTSConfig,
        publisher: WeightPublisher | None,
        device,
        serving_adapters=None,
    ):
        self.config = config
        self.device = torch.device(device)
        self.executor = make_executor(self.device, config.sync, config.cpu_thread)
        self.distiller = Distiller(drafter, config, self.executor, publisher, fault_injector_from_env())
        self.drafter = drafter
        # The drafter's ids capture keeps of the target's logits (None: all of them; core/canvas.py).
        reduce = getattr(drafter, "teacher_vocab", None) if config.canvas_vocab == "draft" else None
        self.teacher_vocab: TeacherVocab | None = None if reduce is None else reduce(self.device)
        self.scope = make_scope(config.scope)
        # What the next canvas of a request conditions on: EAGLE-3 the anchor feature [F];
        # DFlash the features [B, F] of last round's block, starting at position context_starts[rid],
        # of which the first context_lengths[rid] were committed (both 0-d device tensors).
        self.anchor_features: dict[str, torch.Tensor] = {}
        self.context_starts: dict[str, torch.Tensor] = {}
        self.context_lengths: dict[str, torch.Tensor] = {}
        self.requests: dict[str, RequestCounters] = {}
        # Requests prefilled since the last decode round (weakly: the Req is SGLang's): one that
        # finishes without a decode round (max_new_tokens=1, a stop at its first token, an abort)
        # is forgotten at the next prefill instead of waiting for a decode round that may not come.
        self._prefilled: dict[str, weakref.ref] = {}
        self.check_fallback = os.environ.get(CHECK_ENV, "0") == "1"
        # The submitted update's requests (insertion order), each with its rounds the update trains on.
        self._pending_rounds: Counter[str] = Counter()
        # Prompt-time adaptation: each request's captured prompt window (with a weak reference to
        # its Req) from its prefill until its first decode round submits it; requests prefilled in
        # chunks keep theirs across the decode rounds between chunks.
        self.prompt_windows: dict[str, tuple[PromptWindow, weakref.ref]] = {}
        self._pending_prompt: dict[str, int] = {}  # request -> positions of the prompt update in flight
        self._unreported: deque[tuple[list, dict[str, str]]] = deque(maxlen=4)  # see verified()
        # Check mode: per request, the weight version that drafted the first token of its next round
        # (its prefill's draft, or the draft-extend after its last verify; REBOUND: its context K/V
        # moved since, see context_rebound); only rows drafted with the weights in place now are
        # checked. And the pool locations of a prefill's context, until its first decode round.
        # Entries leave with their requests (_forget).
        self._drafted_version: dict[str, int] = {}
        self._prefill_locs: dict[str, torch.Tensor] = {}
        self.metrics = None
        # --tts-scope request: `drafter` is an AdaptedDrafter, `serving_adapters` its published bank
        # inside SGLang's draft model (sglang/adapters.py); each request holds a slot while it runs.
        # --tts-scope group: the requests of one group (requests.group_key) hold the same slot.
        self.serving_adapters = serving_adapters
        self.slots = SlotTable(config.max_adapted_requests) if serving_adapters is not None else None
        self._digest: tuple[int, str] | None = None  # (weight version, digest) of the shared weights
        # Every piece of TTS work on the scheduler thread runs under failures.absorb(site).
        self.failures = FailureLog(inject=fault_sites_from_env())
        self.failures.on_failure = self._count_failure
        if serving_adapters is not None:
            serving_adapters.failures = self.failures
        # The update budget (core/budget.py): measures what updates cost serving, and moves the stride
        # unless it is pinned (--tts-update-stride) or the controller owns it.
        self.governor = StrideGovernor(
            config.update_stride,
            config.update_budget,
            min_stride=config.min_stride,
            max_stride=config.max_stride,
            scale=config.update_budget_scale,
            window=config.window,
            window_rows=config.window_rows,
        )
        self._round_start: tuple[float, int, bool] | None = None  # (time, batch size, touched) of the open round
        self._stride_due = False  # a finished update asks the governor for the next stride
        self.distiller.on_update_done = self._update_done
        self.hybrid = None  # --tts-hybrid: the worker's HybridDrafting (sglang/hybrid.py)
        # --tts-hybrid: request-rounds the learned drafter drafted since the last stride ended, and the
        # updates skipped because it drafted none (--tts-hybrid-idle-updates skip).
        self._drafted_since_update = 0
        self._idle_round: list[str] | None = None  # the requests of this round, when its stride's update is skipped
        self.idle_updates = 0

    def describe(self) -> str:
        """One line for the worker's start-up log."""
        cfg = self.config
        mode = "frozen" if cfg.freeze else ("sync" if cfg.sync else ("async" if not self.executor.inline else "inline"))
        if cfg.governed_stride:
            budget = f"auto x{cfg.update_budget_scale:g}" if cfg.update_budget is None else f"{cfg.update_budget:g}"
            stride = f"stride {cfg.update_stride} (update budget {budget}: {cfg.min_stride}..{cfg.max_stride})"
        else:
            stride = f"stride {cfg.update_stride}"
        guard = f", guard {cfg.guard_window} updates / {cfg.guard_margin:g}" if cfg.guard else ", no guard"
        adapters = ""
        if self.slots is not None:
            slot_mb = self.drafter.bank.slot_nbytes() / 2**20
            adapters = f", r {cfg.adapter_rank}, {cfg.max_adapted_requests} slots of {slot_mb:.1f} MB (+2x Adam state)"
        prompt = ""
        if cfg.prompt_updates:
            prompt = (
                f", prompt adaptation {cfg.prompt_adapt} ({cfg.prompt_positions} positions, "
                f"{cfg.prompt_steps} steps at lr {cfg.prompt_step_lr:g}, depth {cfg.prompt_depth})"
            )
        return (
            f"{stride}, lr {cfg.lr:g}, scope {cfg.scope}{adapters}, {mode}{prompt}{guard}, "
            f"{len(self.distiller.train_params)} trainable tensors"
        )

    # --- per round --------------------------------------------------------------------------

    def before_draft(self, live_request_ids: list[str]) -> None:
        """Scope end -> reset to base; then the CPU-side barrier: a due update is finished and
        published before this round's draft reads the weights."""
        self._time_round(len(live_request_ids))
        live = set(live_request_ids)
        live.update(req.rid for reqs, _ in self._unreported for req in reqs)  # their report is still due
        for rid in (self.anchor_features.keys() | self.requests.keys() | self._drafted_version.keys()) - live:
            self._forget(rid)
        for rid, (_, ref) in list(self.prompt_windows.items()):
            req = ref()
            if req is None or req.finished():  # never reached a decode round: its prompt is not learned
                self.prompt_windows.pop(rid, None)
        self._prefilled.clear()
        if self.slots is not None:
            for slot in self.slots.retain(live):  # finished, aborted or retracted: the adapter goes
                self.distiller.reset_parameters(self.drafter.bank.slot_parameter_names(slot), unit=slot)
        if self.scope.before_round(live_request_ids):
            self._absorbing(self.distiller.reset)
        self._absorbing(self.distiller.barrier)
        if self._stride_due and not self.distiller.executor.pending:
            self._stride_due = False
            if self.config.governed_stride:
                stride = self.governor.decide()
                if stride != self.config.update_stride:
                    self.distiller.set_update_stride(stride)
            else:  # pinned or the controller's: the budget only reports
                self.governor.stride = self.config.update_stride
        if self.metrics is not None:
            self.metrics.tracked_requests.set(self.num_tracked())

    # --- the update budget ----------------------------------------------------------------------

    def _time_round(self, batch_size: int) -> None:
        """A decode round starts: the one before it (if nothing else ran in between) took from its
        start to now. Touched: an update was still running when it started, or it submitted one."""
        now = time.perf_counter()
        if self._round_start is not None:
            start, size, touched = self._round_start
            self.governor.round_done(now - start, size, touched)
        self._round_start = (now, batch_size, self.distiller.executor.running)

    def _round_interrupted(self) -> None:
        """A prefill (or anything that is not a decode round) ran: the open round's time is not a round's."""
        self._round_start = None

    def _update_done(self, result: UpdateResult) -> None:
        """The Distiller absorbed an update (serving thread): its cost and the guard's gain go to the budget."""
        timing = result.timing
        self.governor.update_done(timing.run_s, timing.wait_blocked_s)
        stats = self.distiller.stats
        settled = stats.scope_updates >= self.config.guard_window
        self.governor.observe_gain(
            None if math.isnan(stats.guard_gain) else stats.guard_gain,
            settled,
            None if math.isnan(stats.guard_gain_bound) else stats.guard_gain_bound,
        )
        self._stride_due = True
        if self.config.log_interval and self.governor.num_updates % 10 == 0:
            logger.info("TTS update budget: %s", self.governor.state())
        if self.metrics is not None:
            self.metrics.observe_budget(self.governor.state(), self.governor.measured_share)

    def remember_prompt(self, req, token_ids: torch.Tensor, features: torch.Tensor, start: int) -> None:
        """A prefill computed the drafter's inputs at positions start .. start + T - 1 of `req`:
        token_ids [T + 1] (the tokens at start .. start + T), features [T, F] (their target features,
        the caller's own copy). Kept, cut to the last --tts-prompt-positions positions, until the
        request's first decode round (start_prompt_updates); chunks of one prompt concatenate."""
        keep = self.config.prompt_positions
        held = self._held_window(req)
        if held is not None:
            window = held.extended(token_ids, features, start, keep)
        else:
            window = cut_window(PromptWindow(req.rid, token_ids, features, start), keep)
        self.prompt_windows[req.rid] = (window, weakref.ref(req))

    def prompt_tail(self, req, start: int) -> torch.Tensor | None:
        """[1] the token at position `start` if `req` holds a window whose features end right before
        it (the previous chunk of its prompt), else None."""
        window = self._held_window(req)
        if window is None or window.start + window.num_positions != start:
            return None
        return window.token_ids[-1:]

    def _held_window(self, req) -> PromptWindow | None:
        """The window kept for this very request (not an earlier one with the same rid), if any."""
        held = self.prompt_windows.get(req.rid)
        return held[0] if held is not None and held[1]() is req else None

    def start_prompt_updates(self, reqs) -> None:
        """After this round's barrier and adapter binding: one prompt update over the windows of the
        batch's requests that have one (their first decode round) of at least --tts-prompt-min-positions
        positions; the others are dropped. With per-request adapters, only requests holding a slot
        train (each its own adapter). Absorbs its own failures."""
        if not self.prompt_windows:
            return
        ready = [req.rid for req in reqs if req.rid in self.prompt_windows]
        if not ready:
            return
        windows = [self.prompt_windows.pop(rid)[0] for rid in ready]
        windows = [w for w in windows if w.num_positions >= self.config.prompt_min_positions]
        with self.failures.absorb("prompt", ready):
            slots = None
            if self.slots is not None:
                slot_of = self.slots.slot_of
                windows = [w for w in windows if w.request_id in slot_of]
                slots = [slot_of[w.request_id] for w in windows]
            if not windows:
                return
            batch = collate_windows(windows, self.distiller.device, slots)
            self.scope.contributed(batch.request_ids)
            if self._absorbing(lambda: self.distiller.submit_prompt(batch)):
                self._pending_prompt = {w.request_id: w.num_positions for w in windows}

    def begin_prefill(self, reqs) -> None:
        """Before a prefill batch's anchors are remembered: forget the requests of earlier prefills
        that have finished (or are gone) without reaching a decode round."""
        self._round_interrupted()
        for rid, ref in list(self._prefilled.items()):
            req = ref()
            if req is None or req.finished():
                self._forget(rid)
        for req in reqs:
            self._prefilled[req.rid] = weakref.ref(req)

    def num_tracked(self) -> int:
        """Per-request entries held (anchors, counters, adapter slots and capped requests, check-mode
        draft versions): bounded by the running requests plus one prefill batch."""
        slots = len(self.slots.slot_of) + len(self.slots._capped) if self.slots is not None else 0
        held = len(self.anchor_features) + len(self.requests) + len(self._prefilled) + len(self.prompt_windows)
        return held + slots + len(self._drafted_version) + len(self._prefill_locs)

    def _forget(self, rid: str) -> None:
        if self.hybrid is not None:
            self.hybrid.forget([rid])
        self.anchor_features.pop(rid, None)
        self.context_starts.pop(rid, None)
        self.context_lengths.pop(rid, None)
        self.requests.pop(rid, None)
        self._prefilled.pop(rid, None)
        self.prompt_windows.pop(rid, None)
        self._drafted_version.pop(rid, None)
        self._prefill_locs.pop(rid, None)

    def bind_extend_batch(self, reqs) -> None:
        """Per-request adapters, before a prefill (extend) batch's draft forward: map its requests'
        tokens afresh. They hold no slot yet (row 0: the base drafter), except under group scope a
        request whose group holds one: it joins it now, so the draft made at its prefill (its first
        round's drafted tokens) already reads the group's adapter, as the update will assume. Without
        this the table still maps the last decode batch, and a new request that reuses a finished
        one's req_pool_idx would draft its prompt with that request's adapter."""
        self._round_interrupted()
        if self.check_fallback:
            for req in reqs:
                self._drafted_version[req.rid] = self.distiller.weight_version
        if self.slots is None:
            return
        with self.failures.absorb("adapter_map", [req.rid for req in reqs]):
            if self.config.scope == "group":
                for req in reqs:
                    if not self.slots.known(req.rid):
                        self.slots.join(req.rid, group_key(req, self.config.allow_weight_digest))
            self.serving_adapters.set_batch(reqs, self.slots)

    def bind_batch(self, reqs) -> None:
        """Per-request adapters: give this batch's new requests a slot (while the cap allows) and
        tell SGLang's draft model which bank row each request's tokens use."""
        if self.slots is None:
            return
        capped_before = self.slots.num_capped
        grouped = self.config.scope == "group"
        for req in reqs:
            if self.slots.known(req.rid):
                continue
            group = group_key(req, self.config.allow_weight_digest) if grouped else None
            if self.slots.acquire(req.rid, group) is None:
                self.counters(req.rid).adapter_capped = 1
        if self.metrics is not None and self.slots.num_capped > capped_before:
            self.metrics.adapter_capped.inc(self.slots.num_capped - capped_before)
        self.serving_adapters.set_batch(reqs, self.slots)
        if self.metrics is not None:
            self.metrics.adapted_requests.set(len(self.slots.slot_of))
            if grouped:
                self.metrics.adapter_groups.set(self.slots.num_groups())

    def remember_prefill_locs(self, rid: str, locs: torch.Tensor) -> None:
        """Check mode: locs [L], the pool locations of the context K/V that a prefill's draft read
        (the request's copy of its req_to_token row), kept until its first decode round."""
        self._prefill_locs[rid] = locs

    def prefill_locs(self, rid: str) -> torch.Tensor | None:
        """The locations remembered at the request's prefill, handed over once (None after that)."""
        return self._prefill_locs.pop(rid, None)

    def context_rebound(self, rid: str) -> None:
        """Check mode: after the request's prefill drafted, SGLang's radix cache pointed part of its
        context at another request's copy of the same tokens (inserting the prompt frees the
        duplicate locations). That copy's K/V came from other adapter weights (--tts-adapter-kv on)
        or another batch, so this round's first draft token, which read the request's own K/V,
        cannot be re-predicted from the pool: the round is skipped, later rounds are checked."""
        self._drafted_version[rid] = REBOUND

    def observe(self, canvas: Canvas | None, check_canvas: Canvas | None = None, *, owned: bool = False) -> None:
        """After verify: hand the canvas to the update schedule (and, in check mode, re-predict
        `check_canvas`'s drafted tokens with the differentiable drafter). owned: the canvas was
        built for the update (capture.build_canvas): the update trains on it without a copy."""
        if self.slots is not None:
            for c in (canvas, check_canvas):
                if c is not None:
                    c.slots = self.slots.slots(c.request_ids).to(c.input_ids.device)
        if check_canvas is not None:
            # A row is exact only if no new weights were published since SGLang drafted its first
            # token (at its prefill, or in the draft-extend after its previous verify: a request
            # prefilled before another request's round saw a publish has older weights there), if
            # the context K/V it read are still where the check reads them (context_rebound), and if
            # no update is writing the trained copy now. The others are counted as skipped.
            version = self.distiller.weight_version
            matches = self.distiller.trained_matches_serving
            exact = [matches and self._drafted_version.get(rid) == version for rid in check_canvas.request_ids]
            self._check_fallback(check_canvas, exact)
            for rid in check_canvas.request_ids:  # their next first tokens: drafted after this verify
                self._drafted_version[rid] = version
        idle, self._idle_round = self._idle_round, None
        if idle is not None:
            canvas = None  # the stride's update is skipped: this round counts, nothing is trained
            self._skip_idle_update(idle)
        if canvas is not None:
            self.scope.contributed(canvas.request_ids)
        submitted = self._absorbing(lambda: self.distiller.observe(canvas, owned=owned))
        if submitted or idle is not None:
            self._drafted_since_update = 0
        if submitted and self._round_start is not None:
            self._round_start = (*self._round_start[:2], True)
        if submitted:  # the update's rows: this round's canvas and, with --tts-update-window, earlier rounds'
            rows, slots = self.distiller.last_submitted_rows, self.distiller.last_submitted_slots
            if slots is not None:  # requests without an adapter were not trained
                rows = [rid for rid, slot in zip(rows, slots.tolist()) if slot >= 0]
            self._pending_rounds = Counter(rows)

    # --- hybrid: strides the drafter sat out ------------------------------------------------------

    def note_drafted(self, request_ids: list[str], drafter_rounds: int) -> None:
        """--tts-hybrid, before this round's verify: of its requests (`request_ids`), how many the learned
        drafter drafts (the round's plan; host values, no sync). Decides here, once for the round, whether
        the stride ends idle: with --tts-hybrid-idle-updates skip a stride in which the drafter drafted no
        request-round trains nothing, as its gain would pay only on rounds the drafter drafts and the
        suffix proposer drafted them all (a request copying its prompt)."""
        self._drafted_since_update += drafter_rounds
        idle = (
            self.hybrid is not None
            and self.config.hybrid_idle_updates == "skip"
            and self._drafted_since_update == 0
            and self.distiller.next_round_submits()
        )
        self._idle_round = list(request_ids) if idle else None

    def update_due(self) -> bool:
        """Will this round's observe() submit an update? The distiller's stride says when, except in a
        round whose stride ended idle (note_drafted): it builds no canvas."""
        return self._idle_round is None and self.distiller.next_round_submits()

    def _skip_idle_update(self, request_ids: list[str]) -> None:
        if self.idle_updates == 0:
            logger.info(
                "sglang-tts: hybrid: an update was skipped, the drafter having drafted none of its stride's rounds "
                "(--tts-hybrid-idle-updates skip; counted in tts_idle_updates and sglang_tts:hybrid_idle_updates_total)"
            )
        self.idle_updates += 1
        for rid in request_ids:
            self.counters(rid).idle_updates += 1
        if self.metrics is not None:
            self.metrics.hybrid_idle_updates.inc()

    def capture_buffers(self):
        """The Distiller's canvas buffers; collecting a running update there is credited like anywhere."""
        return self._absorbing(self.distiller.capture_buffers)

    def count_round(self, accept_lengths: dict[str, int]) -> None:
        """A verify round's acceptance, on the host: per-request round counts and Prometheus; its
        tokens per round go to the update budget (with the hybrid, _count_proposers gives it the
        drafter's rounds instead)."""
        stride, share = self.config.update_stride, self.governor.measured_share
        for rid in accept_lengths:
            c = self.counters(rid)
            c.rounds += 1
            c.update_stride, c.update_share = stride, share
        if accept_lengths and self.hybrid is None:
            self.governor.observe_tokens(sum(accept_lengths.values()) / len(accept_lengths))
        if self.metrics is not None:
            self.metrics.observe_round(accept_lengths)

    # --- reports that wait for SGLang's host copy of the accepted lengths -----------------------

    def verified(self, reqs) -> None:
        """A verify round was launched for `reqs`; its report comes with `reported()`, when
        SGLang's result processing has the accepted lengths on the host (on_verify_complete_cpu),
        so the worker never waits for them. Their counters stay until then. The weight digests
        that requests asked for are taken now: by the time of the report the next round's barrier
        may have published other weights."""
        if len(self._unreported) == self._unreported.maxlen:
            self._unreported.popleft()  # never reported (should not happen): forget, do not grow
            self._count_failure("report", [])
        self._unreported.append((list(reqs), self._digests(reqs)))

    def reported(self, num_correct_drafts_per_req: list[int]) -> None:
        """SGLang's on_verify_complete_cpu, forwarded by the worker: the oldest unreported round's
        accepted drafts per request, in its batch order. Runs in SGLang's result processing, so it
        never raises: a failure is counted as a `report` failure."""
        with self.failures.absorb("report"):
            if not num_correct_drafts_per_req:
                return  # an idle batch: it had no verify of ours
            reqs, digests = self._unreported.popleft() if self._unreported else (None, None)
            if reqs is None or len(reqs) != len(num_correct_drafts_per_req):
                self._unreported.clear()  # out of step: drop what is queued rather than misattribute
                self._count_failure("report", [] if reqs is None else [req.rid for req in reqs])
                return
            self.report_round(reqs, [n + 1 for n in num_correct_drafts_per_req], digests)  # + the bonus token

    def report_round(self, reqs, accept_lengths: list[int], digests: dict[str, str] | None = None) -> None:
        """This round's acceptance on the host: counted (count_round), and the per-request values
        written into SGLang's customized_info (-> meta_info); runs even when the capture failed, so
        every round a request was served in is reported.
        accept_lengths: [bs] tokens each request committed this round (bonus included).
        digests: the serving weights' digest per request that asked, taken when the round ran
        (default: now)."""
        with self.failures.absorb("report", [req.rid for req in reqs]):
            self.count_round({req.rid: n for req, n in zip(reqs, accept_lengths)})
            if self.hybrid is not None:
                self._count_proposers(reqs, accept_lengths)
            if digests is None:
                digests = self._digests(reqs)
            allow_digest = self.config.allow_weight_digest
            for req, accept_len in zip(reqs, accept_lengths):
                options = request_options(req, allow_digest)
                tts_metrics.write_request_info(req, self.counters(req.rid), accept_len, options, digests.get(req.rid))

    def _count_proposers(self, reqs, accept_lengths: list[int]) -> None:
        """--tts-hybrid: which proposer drafted each request's round, and how many of its tokens were accepted."""
        rounds = {"suffix": 0, "drafter": 0}
        accepted = {"suffix": 0, "drafter": 0}
        for req, n in zip(reqs, accept_lengths):
            proposer = self.hybrid.accepted(req.rid, n - 1)
            counts = self.hybrid.chooser.counts(req.rid)
            if proposer is None or counts is None:
                continue
            rounds[proposer] += 1
            accepted[proposer] += n - 1
            c = self.counters(req.rid)
            c.proposer_rounds, c.proposer_accepted = counts
            c.drafter_retired = int(self.hybrid.chooser.retired(req.rid))
        # The budget values the drafter's gain on the rounds it drafts (core/budget.py).
        self.governor.observe_drafted(rounds["drafter"], rounds["drafter"] + rounds["suffix"])
        if rounds["drafter"]:
            self.governor.observe_tokens(1.0 + accepted["drafter"] / rounds["drafter"])
        if self.metrics is not None:
            self.metrics.observe_proposers(rounds, accepted)
            self.metrics.observe_round_costs(self.hybrid.last_costs)
            self.metrics.observe_retirements(self.hybrid.retirements, self.hybrid.skipped_extends)

    def _digests(self, reqs) -> dict[str, str]:
        """serving_digest() for the requests that asked for it (a debug option: it reads weights)."""
        if not self.config.allow_weight_digest:
            return {}
        with self.failures.absorb("report", [req.rid for req in reqs]):
            return {req.rid: self.serving_digest(req.rid) for req in reqs if request_options(req, True).weight_digest}
        return {}

    def remember_anchor(self, rid: str, feature: torch.Tensor) -> None:
        """Keep `feature` (on its device, as it is) for the request's next canvas. It must be the
        caller's own copy, never a view of a buffer SGLang reuses (e.g. a CUDA graph's output)."""
        self.anchor_features[rid] = feature.detach()

    def remember_context(
        self, rid: str, block_features: torch.Tensor, start: torch.Tensor, length: torch.Tensor
    ) -> None:
        """DFlash: the target features [B, F] of the block verified at position `start`, of which
        the first `length` rows were committed. start, length: 0-d integer tensors on the device,
        not read here. Like an anchor, the caller's own copies."""
        self.remember_anchor(rid, block_features)
        self.context_starts[rid] = start
        self.context_lengths[rid] = length

    def recent_contexts(
        self, request_ids: list[str], next_positions: list[int]
    ) -> list[tuple[torch.Tensor, int] | None]:
        """Per request, the remembered committed features and their start if they end right before
        its next position, else None (e.g. a retracted and resumed request: the pool alone has the
        context). Reads the remembered lengths on the host, once for the batch: canvas rounds only."""
        known = [
            rid
            for rid in request_ids
            if rid in self.anchor_features and rid in self.context_starts and rid in self.context_lengths
        ]
        pairs = [torch.stack([self.context_starts[rid], self.context_lengths[rid]]) for rid in known]
        host = dict(zip(known, torch.stack(pairs).tolist() if pairs else []))
        contexts: list[tuple[torch.Tensor, int] | None] = []
        for rid, position in zip(request_ids, next_positions):
            start, n = host.get(rid, (None, None))
            if start is None or start + n != position:
                contexts.append(None)
            else:
                contexts.append((self.anchor_features[rid][:n], start))
        return contexts

    def serving_digest(self, rid: str | None = None) -> str:
        """sha256 over the serving drafter's weights that TTS publishes (the trained ones, `--tts-trainable`:
        what an update can change in the next draft); with per-request adapters, over request `rid`'s
        published adapter."""
        h = hashlib.sha256()
        if self.serving_adapters is not None:
            slot = self.slots.slot_of.get(rid, -1) if self.slots is not None else -1
            bank = self.serving_adapters.bank
            for t in (*bank.a, *bank.b):
                h.update(t[slot + 1].detach().float().cpu().contiguous().numpy().tobytes())
            return h.hexdigest()
        publisher = self.distiller.publisher
        version = self.distiller.weight_version
        if self._digest is not None and self._digest[0] == version:
            return self._digest[1]
        tensors = [b.dst for b in publisher.bindings] if publisher is not None else self.distiller._serving_params
        for t in tensors:
            h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
        self._digest = (version, h.hexdigest())
        return self._digest[1]

    def counters(self, rid: str) -> RequestCounters:
        return self.requests.setdefault(rid, RequestCounters())

    def _count_failure(self, site: str, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.counters(rid).failures += 1
        if self.metrics is not None:
            self.metrics.failures.labels(site=site).inc()

    def close(self) -> None:
        self._absorbing(self.distiller.close)

    # --- helpers ----------------------------------------------------------------------------

    def _absorbing(self, fn):
        """Call a distiller method that may collect a finished update; attribute it to the
        requests whose canvas it trained on."""
        stats = self.distiller.stats
        guard_before = stats.num_guard_resets
        before = (stats.num_updates, stats.num_skipped_updates, stats.update_ms_total)
        prompt_before = (stats.num_prompt_updates, stats.num_skipped_prompt_updates, stats.prompt_ms_total)
        resets, failed_publishes = stats.num_resets, stats.num_failed_publishes
        try:
            out = fn()
        finally:  # a reset or a failed publish counts even when the call fails after it
            if self.metrics is not None:
                self.metrics.observe_publishing(
                    stats.num_resets - resets, stats.num_failed_publishes - failed_publishes
                )
            if stats.num_guard_resets != guard_before:
                self._credit_guard_resets(self.distiller.last_guard_resets, stats.num_guard_resets - guard_before)
        prompt_after = (stats.num_prompt_updates, stats.num_skipped_prompt_updates, stats.prompt_ms_total)
        if prompt_after != prompt_before:
            self._prompt_done(
                prompt_after[0] - prompt_before[0],
                prompt_after[1] - prompt_before[1],
                prompt_after[2] - prompt_before[2],
            )
            before = (before[0], before[1] + prompt_after[1] - prompt_before[1], before[2])  # skips counted there
        after = (stats.num_updates, stats.num_skipped_updates, stats.update_ms_total)
        if after != before and self._pending_rounds:
            for rid in self._pending_rounds:
                c = self.counters(rid)
                if after[0] > before[0]:
                    c.trained_rounds += self._pending_rounds[rid]
                c.num_updates += after[0] - before[0]
                c.num_skipped_updates += after[1] - before[1]
                c.update_ms += after[2] - before[2]
            if self.metrics is not None:
                trained = sum(self._pending_rounds.values()) if after[0] > before[0] else 0
                self.metrics.observe_update(
                    after[0] - before[0], after[1] - before[1], after[2] - before[2], stats, trained
                )
            self._pending_rounds = Counter()
        return out

    def _credit_guard_resets(self, units: list[int], count: int) -> None:
        """The guard reset `units`: count it for the requests that drafted with them."""
        for unit in units:
            if unit == SCOPE_UNIT:
                rids = list(self.requests)
            else:  # an adapter slot: its request, or every request of its group
                rids = self.slots.holders(unit) if self.slots is not None else []
            for rid in rids:
                self.counters(rid).guard_resets += 1
        if self.metrics is not None:
            self.metrics.guard_resets.inc(count)

    def _prompt_done(self, kept: int, skipped: int, ms: float) -> None:
        """A prompt update finished: credit its requests (positions and steps only if it was kept)."""
        steps = self.config.prompt_steps if kept else 0
        for rid, positions in self._pending_prompt.items():
            c = self.counters(rid)
            c.prompt_ms += ms
            if kept:
                c.prompt_positions += positions
                c.prompt_steps += steps
            c.num_skipped_updates += skipped
        if self.metrics is not None:
            self.metrics.observe_prompt_update(
                kept, skipped, ms, sum(self._pending_prompt.values()) if kept else 0, self.distiller.stats
            )
        self._pending_prompt = {}

    @torch.no_grad()
    def _check_fallback(self, canvas: Canvas, exact: list[bool]) -> None:
        """Greedy agreement of the differentiable drafter with what SGLang's fast path drafted, on
        the rows where `exact` (drafted with the weights in place now).

        With topk == 1, SGLang's draft token d_{k+1} is the argmax of its draft logits at canvas
        position k; the differentiable drafter, fed the same inputs and weights, must agree. The
        drafted tokens of the other rows count as skipped."""
        predicted = None
        if any(exact):
            with torch.inference_mode(False):
                logits = self.drafter.canvas_logits(canvas)
            if hasattr(self.drafter, "draft_to_target_ids"):
                predicted = self.drafter.draft_to_target_ids()[logits.argmax(-1)]
            else:
                predicted = logits.argmax(-1)
        for i, (rid, n) in enumerate(zip(canvas.request_ids, canvas.valid.sum(-1).tolist())):
            if n < 2:
                continue
            c = self.counters(rid)
            if not exact[i]:
                c.fallback_skipped += n - 1
                continue
            agree = predicted[i, : n - 1] == canvas.input_ids[i, 1:n].to(predicted.device)
            c.fallback_checked += n - 1
            c.fallback_mismatches += int((~agree).sum())
