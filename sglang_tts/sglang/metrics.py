"""Observability: per-request TTS counters in meta_info, and server-wide Prometheus metrics.

Per request, the worker writes into `req.customized_info` (SGLang's channel from scheduler to
meta_info) after every round; a tokenizer-side hook turns it into the documented meta_info keys.
Nothing written for the counters grows with the output:
- the counters (`tts_num_updates`, `tts_num_skipped_updates`, `tts_update_ms`,
  `tts_fallback_checked/_mismatches/_skipped`, `tts_adapter_capped`, `tts_failures`) and the opt-in weight
  digests are one snapshot per round, of which only the last few rounds are kept (ROUNDS_KEPT),
  each with the output tokens it covers, so the value at the response's last token can be picked;
- a non-streamed request keeps them under a request-level key (ROUNDS_KEY): SGLang sends it once,
  when the request finishes, as it is (`is_request_level_customized_info_key`, hooked below);
- a streamed request cannot use that key: SGLang sends a request-level key of a stream only with
  its first chunk (the values at prefill), and every later chunk, the final one included, would lack
  the counters. Its rounds go under a token-level key (STREAM_KEY) instead, as a `StreamedRounds`
  whose slice (SGLang takes `[sent : len(output_ids)]` for each chunk) is one element: the snapshot
  at the chunk's last token. Every chunk thus reports the counters at its last token, as before.
`tts_accept_lengths` (only when the request sets `custom_params.tts_return_accept_lengths`) stays
token-aligned: the accepted length of each verify round, bonus token included (SGLang's
convention), at the round's first token and None elsewhere; the hook drops the Nones, leaving one
entry per round. It is what a client asked for, and grows with the output as the answer does.
Server-wide (with --enable-metrics): counters and histograms named `sglang_tts:*`.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

    from sglang_tts.sglang.requests import RequestOptions
    from sglang_tts.sglang.runtime import RequestCounters

logger = logging.getLogger(__name__)

SCALAR_KEYS = (
    "tts_num_updates",
    "tts_num_skipped_updates",
    "tts_update_ms",
    "tts_fallback_checked",
    "tts_fallback_mismatches",
    "tts_fallback_skipped",
    "tts_adapter_capped",
    "tts_failures",
    "tts_prompt_positions",
    "tts_prompt_steps",
    "tts_prompt_ms",
    "tts_guard_resets",
    "tts_trained_rounds",
    "tts_update_stride",
    "tts_update_share",
)
# Hybrid drafting only (--tts-hybrid): per proposer, the rounds it drafted and the drafted tokens accepted.
# tts_drafter_retired: 1 once the request's drafter was retired (--tts-hybrid-retire-below).
# tts_idle_updates: updates skipped in the request's rounds, the drafter having drafted none of their
# stride (--tts-hybrid-idle-updates skip).
HYBRID_KEYS = (
    "tts_suffix_rounds",
    "tts_suffix_accepted",
    "tts_drafter_rounds",
    "tts_drafter_accepted",
    "tts_drafter_retired",
    "tts_idle_updates",
)
ACCEPT_KEY = "tts_accept_lengths"
# sha256 of the serving drafter weights at the request's first and last round (opt-in, for tests and
# audits: proves that weights changed during a request and were reset to base bitwise after it).
DIGEST_START, DIGEST_END = "tts_weight_digest_start", "tts_weight_digest_end"
# customized_info keys that never reach a response: the hook turns them into the keys above.
ROUNDS_KEY = "tts_rounds"  # non-streamed requests: request-level, sent once at the finish
STREAM_KEY = "tts_stream_rounds"  # streamed requests: token-level, one snapshot per chunk
INTERNAL_KEYS = (ROUNDS_KEY, STREAM_KEY)
# Rounds kept per request. The value reported is that of the round covering the response's last
# token: the latest round, or the one before it when the overlap scheduler already ran one more
# round for a request that had finished (SGLang drops that round's tokens). Four is a margin.
ROUNDS_KEPT = 4

# (start, end, snapshot): a round's values, which apply to output tokens start..end-1
Round = tuple[int, int, dict[str, Any]]


def _add_round(rounds: list[Round], accept_len: int, already: int, snapshot: dict[str, Any]) -> None:
    """Rounds cover the output back to back from token 0 (the prefill token, which no round of ours
    produced, takes the first round's values). Under the overlap scheduler output_ids can lag a round
    behind the worker, so the prefill token may not be visible yet at the first round: `already`
    (tokens in output_ids, at least the prefill one) only ever extends a round's start backwards."""
    start = rounds[-1][1] if rounds else 0
    rounds.append((start, max(start, already) + accept_len, snapshot))
    del rounds[:-ROUNDS_KEPT]


def snapshot_at(rounds: list[Round], token: int) -> dict[str, Any] | None:
    """The values at output token `token` (0-based): those of the last round starting at or before it."""
    if token < 0 or not rounds:
        return None
    for start, _end, snapshot in reversed(rounds):
        if start <= token:
            return snapshot
    return rounds[0][2]


class StreamedRounds:
    """A streamed request's rounds under a token-level customized_info key. SGLang slices a
    token-level value by token offset for each chunk (`value[sent : len(output_ids)]`); this one
    answers the slice with one element, the snapshot at the slice's last token, and keeps only the
    last ROUNDS_KEPT rounds, so nothing here grows with the output."""

    __slots__ = ("rounds",)

    def __init__(self) -> None:
        self.rounds: list[Round] = []

    def __len__(self) -> int:
        return self.rounds[-1][1] if self.rounds else 0

    def __getitem__(self, index: slice) -> list[dict[str, Any]]:
        if not isinstance(index, slice):
            raise TypeError("StreamedRounds is read by slices of output tokens")
        stop = len(self) if index.stop is None else index.stop
        snapshot = snapshot_at(self.rounds, stop - 1)
        return [] if snapshot is None else [snapshot]


def write_request_info(
    req: Req, counters: RequestCounters, accept_len: int, options: RequestOptions, digest: str | None = None
) -> None:
    """Record this round's values for the `accept_len` tokens it produced."""
    if req.customized_info is None:
        req.customized_info = {}
    info = req.customized_info
    snapshot: dict[str, Any] = {
        "tts_num_updates": counters.num_updates,
        "tts_num_skipped_updates": counters.num_skipped_updates,
        "tts_update_ms": round(counters.update_ms, 3),
        "tts_fallback_checked": counters.fallback_checked,
        "tts_fallback_mismatches": counters.fallback_mismatches,
        "tts_fallback_skipped": counters.fallback_skipped,
        "tts_adapter_capped": counters.adapter_capped,
        "tts_failures": counters.failures,
        "tts_prompt_positions": counters.prompt_positions,
        "tts_prompt_steps": counters.prompt_steps,
        "tts_prompt_ms": round(counters.prompt_ms, 3),
        "tts_guard_resets": counters.guard_resets,
        "tts_trained_rounds": counters.trained_rounds,
        "tts_update_stride": counters.update_stride,
        "tts_update_share": round(counters.update_share, 4),
    }
    if counters.proposer_rounds is not None:
        for proposer in ("suffix", "drafter"):
            snapshot[f"tts_{proposer}_rounds"] = counters.proposer_rounds[proposer]
            snapshot[f"tts_{proposer}_accepted"] = counters.proposer_accepted[proposer]
        snapshot["tts_drafter_retired"] = counters.drafter_retired
        snapshot["tts_idle_updates"] = counters.idle_updates
    if digest is not None:
        if counters.digest_start is None:
            counters.digest_start = digest
        snapshot[DIGEST_START] = counters.digest_start
        snapshot[DIGEST_END] = digest
    already = max(len(req.output_ids) if req.output_ids is not None else 0, 1)
    if getattr(req, "stream", False):
        column = info.get(STREAM_KEY)
        if column is None:
            column = info[STREAM_KEY] = StreamedRounds()
        rounds = column.rounds
    else:
        rounds = info.setdefault(ROUNDS_KEY, [])
    _add_round(rounds, accept_len, already, snapshot)
    if options.accept_lengths:
        # Token-aligned, as SGLang slices it: the same token positions as the rounds'.
        column = info.setdefault(ACCEPT_KEY, [])
        if len(column) < already:
            column.extend([None] * (already - len(column)))
        column.extend([accept_len] + [None] * (accept_len - 1))


def finalize_meta_info(meta_info: dict, internal: dict[str, Any] | None = None) -> None:
    """What the tokenizer received for a request -> the values a response reports.

    `internal`: this output's values of INTERNAL_KEYS (ROUNDS_KEY: the request's last rounds;
    STREAM_KEY: one snapshot per chunk, or SGLang's padding for a request without one).
    `meta_info[ACCEPT_KEY]`: the token-aligned accepted lengths as the tokenizer accumulates them."""
    tokens = meta_info.get("completion_tokens")
    internal = internal or {}
    snapshot = None
    rounds = internal.get(ROUNDS_KEY)
    if rounds:
        # Under the overlap scheduler (DFLASH keeps it on CPU) the worker already ran the next round
        # when a request finished; SGLang drops that round's tokens, and its values go too.
        snapshot = snapshot_at(rounds, tokens - 1) if isinstance(tokens, int) else rounds[-1][2]
    streamed = internal.get(STREAM_KEY)
    if snapshot is None and streamed:
        snapshot = next((s for s in reversed(streamed) if isinstance(s, dict)), None)
    if snapshot is not None or internal:
        # A request without a round in a batch whose others had some reports zeros, as before.
        for key in SCALAR_KEYS:
            meta_info[key] = snapshot.get(key, 0) if snapshot is not None else 0
        for key in HYBRID_KEYS:
            if snapshot is not None and key in snapshot:
                meta_info[key] = snapshot[key]
        if snapshot is not None and DIGEST_START in snapshot:
            meta_info[DIGEST_START] = snapshot[DIGEST_START]
            meta_info[DIGEST_END] = snapshot[DIGEST_END]
    values = meta_info.get(ACCEPT_KEY)
    if isinstance(values, list):
        if isinstance(tokens, int) and len(values) > tokens:
            values = values[:tokens]  # the rounds after the finish (above) go here too
        meta_info[ACCEPT_KEY] = [v for v in values if v is not None]


def update_request_meta_info_hook(
    original, manager, meta_info: dict, state, customized_info: dict, index: int, *args, **kwargs
):
    """AROUND hook on TokenizerManager.update_request_meta_info: SGLang accumulates every
    customized_info key per request (a list per key, for the request's lifetime); TTS's internal
    keys are taken out first, so the tokenizer keeps none of them, and turned into the documented
    keys of this output's meta_info."""
    internal = {key: customized_info[key][index] for key in INTERNAL_KEYS if key in customized_info}
    if internal:
        customized_info = {key: values for key, values in customized_info.items() if key not in INTERNAL_KEYS}
    out = original(manager, meta_info, state, customized_info, index, *args, **kwargs)
    finalize_meta_info(meta_info, internal)
    return out


def request_level_key_hook(original, streamer, key: str) -> bool:
    """AROUND hook on SchedulerOutputStreamer.is_request_level_customized_info_key: ROUNDS_KEY is
    sent once per non-streamed request (at its finish), not sliced by output token."""
    return key == ROUNDS_KEY or original(streamer, key)


class SchedulerMetrics:
    """Prometheus metrics of one scheduler process (SGLang runs prometheus_client in multiprocess mode)."""

    def __init__(self, registry=None) -> None:
        from functools import partial

        from prometheus_client import REGISTRY
        from prometheus_client import Counter as _Counter
        from prometheus_client import Gauge as _Gauge
        from prometheus_client import Histogram as _Histogram

        # `registry`: a private CollectorRegistry in unit tests; SGLang's process-wide one otherwise.
        registry = REGISTRY if registry is None else registry
        Counter, Gauge, Histogram = (partial(c, registry=registry) for c in (_Counter, _Gauge, _Histogram))

        self.rounds = Counter("sglang_tts:rounds_total", "Verify rounds seen by TTS")
        self.accepted_tokens = Counter("sglang_tts:accepted_tokens_total", "Tokens emitted by TTS rounds (bonus incl.)")
        self.updates = Counter("sglang_tts:updates_total", "Drafter updates applied")
        self.trained_rounds = Counter(
            "sglang_tts:trained_rounds_total", "Request rounds (canvas rows) the applied updates trained on"
        )
        self.skipped = Counter("sglang_tts:skipped_updates_total", "Updates skipped and rolled back (NaN/Inf/error)")
        self.resets = Counter("sglang_tts:resets_total", "Drafter resets to base weights (scope ends)")
        self.update_seconds = Histogram(
            "sglang_tts:update_seconds",
            "Time of one drafter update",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
        )
        self.kl = Gauge(
            "sglang_tts:last_kl", "KL(target || drafter) of the last update", multiprocess_mode="mostrecent"
        )
        self.wait_seconds = Counter("sglang_tts:barrier_wait_seconds_total", "Time serving waited at the barrier")
        self.adapter_capped = Counter(
            "sglang_tts:adapter_capped_total", "Requests served by the frozen drafter: no adapter slot was free"
        )
        self.failures = Counter(
            "sglang_tts:failures_total",
            "TTS work on the scheduler thread that failed and was skipped (the round served on)",
            ["site"],
        )
        self.adapted_requests = Gauge(
            "sglang_tts:adapted_requests", "Requests holding a per-request adapter", multiprocess_mode="mostrecent"
        )
        self.adapter_groups = Gauge(
            "sglang_tts:adapter_groups",
            "Groups holding a shared adapter (--tts-scope group; their requests count in adapted_requests)",
            multiprocess_mode="mostrecent",
        )
        self.failed_publishes = Counter(
            "sglang_tts:failed_publishes_total", "Publishes that failed part-way (the old weights were written back)"
        )
        self.tracked_requests = Gauge(
            "sglang_tts:tracked_requests",
            "Per-request entries TTS holds (anchors, counters, adapter slots): bounded by the running requests",
            multiprocess_mode="mostrecent",
        )
        self.prompt_updates = Counter("sglang_tts:prompt_updates_total", "Prompt updates applied (prompt adaptation)")
        self.prompt_positions = Counter(
            "sglang_tts:prompt_positions_total", "Prompt positions that kept prompt updates trained on"
        )
        self.prompt_update_seconds = Histogram(
            "sglang_tts:prompt_update_seconds",
            "Time of one prompt update (all its steps)",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30),
        )
        self.prompt_loss = Gauge(
            "sglang_tts:last_prompt_loss",
            "Prompt loss of the last kept prompt update, before its first step and before its last",
            ["step"],
            multiprocess_mode="mostrecent",
        )
        self.guard_resets = Counter(
            "sglang_tts:guard_resets_total", "Adapted drafters the do-no-harm guard reset to base (worse than base)"
        )
        self.guard_gain = Gauge(
            "sglang_tts:guard_gain",
            "Measured acceptance gain of the adapted drafter over base (guard windows, pooled)",
            multiprocess_mode="mostrecent",
        )
        self.update_stride = Gauge("sglang_tts:update_stride", "Update stride in force", multiprocess_mode="mostrecent")
        self.update_budget = Gauge(
            "sglang_tts:update_budget", "Share of serving time updates may take", multiprocess_mode="mostrecent"
        )
        self.update_share = Gauge(
            "sglang_tts:update_share",
            "Measured share of serving time the updates took (since start)",
            multiprocess_mode="mostrecent",
        )
        self.update_cost_seconds = Gauge(
            "sglang_tts:update_cost_seconds",
            "Serving time one update costs (EMA; blocked time plus the slowdown of the rounds it overlaps)",
            multiprocess_mode="mostrecent",
        )
        self.proposer_rounds = Counter(
            "sglang_tts:proposer_rounds_total", "Request rounds drafted by each proposer (--tts-hybrid)", ["proposer"]
        )
        self.proposer_accepted = Counter(
            "sglang_tts:proposer_accepted_tokens_total",
            "Drafted tokens accepted, by the proposer that drafted them (--tts-hybrid)",
            ["proposer"],
        )
        self.hybrid_round_seconds = Gauge(
            "sglang_tts:hybrid_round_seconds",
            "Median seconds of a decode round at the latest round's shape, by kind: 'suffix' (the drafter's "
            "steps skipped) or 'drafter' (--tts-hybrid)",
            ["kind"],
            multiprocess_mode="mostrecent",
        )
        self.hybrid_retired = Counter(
            "sglang_tts:hybrid_retired_requests_total",
            "Requests whose drafter the hybrid retired (suffix chains only; --tts-hybrid-retire-below)",
        )
        self.hybrid_skipped_extends = Counter(
            "sglang_tts:hybrid_skipped_extends_total",
            "Decode rounds whose draft-extend did not run: every request of the batch retired (--tts-hybrid)",
        )
        self.hybrid_idle_updates = Counter(
            "sglang_tts:hybrid_idle_updates_total",
            "Updates skipped: the learned drafter drafted no request-round of their stride "
            "(--tts-hybrid-idle-updates skip)",
        )
        self._retired_seen, self._skipped_extends_seen = 0, 0
        self._last_wait_ms = 0.0

    def observe_round(self, accept_lengths: dict[str, int]) -> None:
        self.rounds.inc(len(accept_lengths))
        self.accepted_tokens.inc(sum(accept_lengths.values()))

    def observe_proposers(self, rounds: dict[str, int], accepted: dict[str, int]) -> None:
        for proposer, n in rounds.items():
            if n:
                self.proposer_rounds.labels(proposer=proposer).inc(n)
                self.proposer_accepted.labels(proposer=proposer).inc(accepted.get(proposer, 0))

    def observe_retirements(self, retired: int, skipped_extends: int) -> None:
        """The hybrid's running totals (sglang/hybrid.py): what is new since the last call is counted."""
        if retired > self._retired_seen:
            self.hybrid_retired.inc(retired - self._retired_seen)
        if skipped_extends > self._skipped_extends_seen:
            self.hybrid_skipped_extends.inc(skipped_extends - self._skipped_extends_seen)
        self._retired_seen, self._skipped_extends_seen = retired, skipped_extends

    def observe_round_costs(self, seconds: dict[str, float | None]) -> None:
        for kind, value in seconds.items():
            if value is not None:
                self.hybrid_round_seconds.labels(kind=kind).set(value)

    def observe_publishing(self, resets: int, failed_publishes: int) -> None:
        if resets:
            self.resets.inc(resets)
        if failed_publishes:
            self.failed_publishes.inc(failed_publishes)

    def observe_update(self, applied: int, skipped: int, ms: float, stats, trained_rounds: int = 0) -> None:
        if applied:
            self.updates.inc(applied)
            self.trained_rounds.inc(trained_rounds)
            self.update_seconds.observe(ms / 1000.0 / max(applied, 1))
            self.kl.set(stats.last_kl_teacher)
        if skipped:
            self.skipped.inc(skipped)
        self.wait_seconds.inc(max(stats.wait_ms_total - self._last_wait_ms, 0.0) / 1000.0)
        self._last_wait_ms = stats.wait_ms_total

    def observe_budget(self, state, measured_share: float) -> None:
        """The update budget after an update (core/budget.py BudgetState)."""
        self.update_stride.set(state.stride)
        self.update_budget.set(state.budget)
        self.update_share.set(measured_share)
        if state.cost_ms == state.cost_ms:  # not NaN
            self.update_cost_seconds.set(state.cost_ms / 1000.0)
        if state.gain == state.gain:
            self.guard_gain.set(state.gain)

    def observe_prompt_update(self, applied: int, skipped: int, ms: float, positions: int, stats) -> None:
        if applied:
            self.prompt_updates.inc(applied)
            self.prompt_positions.inc(positions)
            self.prompt_loss.labels(step="first").set(stats.last_prompt_loss)
            self.prompt_loss.labels(step="last").set(stats.last_prompt_loss_after)
        if skipped:
            self.skipped.inc(skipped)
        if applied or skipped:
            self.prompt_update_seconds.observe(ms / 1000.0 / max(applied + skipped, 1))
        self.wait_seconds.inc(max(stats.wait_ms_total - self._last_wait_ms, 0.0) / 1000.0)
        self._last_wait_ms = stats.wait_ms_total


def scheduler_metrics() -> SchedulerMetrics | None:
    """Metrics only where SGLang collects them (--enable-metrics sets up the multiprocess dir)."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    try:
        return SchedulerMetrics()
    except (ImportError, ValueError):
        logger.warning("sglang-tts: Prometheus metrics unavailable", exc_info=True)
        return None


TOKENIZER_META_INFO = "sglang.srt.managers.tokenizer_manager.TokenizerManager.update_request_meta_info"
REQUEST_LEVEL_KEY = (
    "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
    ".is_request_level_customized_info_key"
)


def register_hooks(registry, hook_type) -> None:
    registry.register(TOKENIZER_META_INFO, update_request_meta_info_hook, hook_type.AROUND)
    registry.register(REQUEST_LEVEL_KEY, request_level_key_hook, hook_type.AROUND)
