"""Observability: per-request TTS counters in meta_info, and server-wide Prometheus metrics.

Per request, the worker writes token-aligned lists into `req.customized_info` (SGLang's own
channel from scheduler to meta_info, sliced by output token, so streaming works too):
- `tts_num_updates`, `tts_num_skipped_updates`, `tts_update_ms`, `tts_fallback_checked/_mismatches`:
  cumulative values at each token; a tokenizer-side hook turns them into the final scalar.
- `tts_failures`: TTS work that failed in this request's rounds and was skipped (failures.py).
- `tts_accept_lengths` (only when the request sets `custom_params.tts_return_accept_lengths`):
  the accepted length of each verify round, bonus token included (SGLang's convention).
  Per token the value is the round's length at the round's first token and None elsewhere; the
  hook drops the Nones, leaving one entry per round.
Server-wide (with --enable-metrics): counters and histograms named `sglang_tts:*`.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

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
    "tts_adapter_capped",
    "tts_failures",
)
ACCEPT_KEY = "tts_accept_lengths"
# sha256 of the serving drafter weights at the request's first and last round (opt-in, for tests and
# audits: proves that weights changed during a request and were reset to base bitwise after it).
DIGEST_START, DIGEST_END = "tts_weight_digest_start", "tts_weight_digest_end"


def write_request_info(
    req: Req, counters: RequestCounters, accept_len: int, options: RequestOptions, digest: str | None = None
) -> None:
    """Append this round's values for the `accept_len` tokens it produced."""
    if req.customized_info is None:
        req.customized_info = {}
    info = req.customized_info
    values = {
        "tts_num_updates": counters.num_updates,
        "tts_num_skipped_updates": counters.num_skipped_updates,
        "tts_update_ms": round(counters.update_ms, 3),
        "tts_fallback_checked": counters.fallback_checked,
        "tts_fallback_mismatches": counters.fallback_mismatches,
        "tts_adapter_capped": counters.adapter_capped,
        "tts_failures": counters.failures,
    }
    if digest is not None:
        if counters.digest_start is None:
            counters.digest_start = digest
        values[DIGEST_START] = counters.digest_start
        values[DIGEST_END] = digest
    # Align with the request's output tokens: SGLang slices these lists by token offset. The first
    # token always comes from prefill (no round of ours); under the overlap scheduler output_ids can
    # lag a round behind the worker, so the prefill token may not be visible yet at the first round.
    already = max(len(req.output_ids) if req.output_ids is not None else 0, 1)
    for key, value in values.items():
        column = info.setdefault(key, [])
        if len(column) < already:
            column.extend([value] * (already - len(column)))
        column.extend([value] * accept_len)
    if options.accept_lengths:
        column = info.setdefault(ACCEPT_KEY, [])
        if len(column) < already:
            column.extend([None] * (already - len(column)))
        column.extend([accept_len] + [None] * (accept_len - 1))


def finalize_meta_info(meta_info: dict) -> None:
    """Token-aligned lists (as the tokenizer accumulates them) -> the values a response reports."""
    picks = {key: -1 for key in (*SCALAR_KEYS, DIGEST_END)} | {DIGEST_START: 0, ACCEPT_KEY: None}
    for key, pick in picks.items():
        values = meta_info.get(key)
        if not isinstance(values, list):
            continue
        tokens = meta_info.get("completion_tokens")
        if isinstance(tokens, int) and len(values) > tokens:
            # Under the overlap scheduler (DFLASH keeps it on CPU) the worker already ran the next
            # round when a request finished; SGLang drops that round's tokens, and its values go too.
            values = values[:tokens]
        present = [v for v in values if v is not None]
        if pick is None:
            meta_info[key] = present
        elif present:
            meta_info[key] = present[pick]
        else:
            meta_info[key] = 0 if key in SCALAR_KEYS else None


def update_request_meta_info_hook(original, manager, meta_info, *args, **kwargs):
    """AROUND hook on TokenizerManager.update_request_meta_info."""
    out = original(manager, meta_info, *args, **kwargs)
    finalize_meta_info(meta_info)
    return out


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
        self.failed_publishes = Counter(
            "sglang_tts:failed_publishes_total", "Publishes that failed part-way (the old weights were written back)"
        )
        self.tracked_requests = Gauge(
            "sglang_tts:tracked_requests",
            "Per-request entries TTS holds (anchors, counters, adapter slots): bounded by the running requests",
            multiprocess_mode="mostrecent",
        )
        self._last_wait_ms = 0.0

    def observe_round(self, accept_lengths: dict[str, int]) -> None:
        self.rounds.inc(len(accept_lengths))
        self.accepted_tokens.inc(sum(accept_lengths.values()))

    def observe_publishing(self, resets: int, failed_publishes: int) -> None:
        if resets:
            self.resets.inc(resets)
        if failed_publishes:
            self.failed_publishes.inc(failed_publishes)

    def observe_update(self, applied: int, skipped: int, ms: float, stats) -> None:
        if applied:
            self.updates.inc(applied)
            self.update_seconds.observe(ms / 1000.0 / max(applied, 1))
            self.kl.set(stats.last_kl_teacher)
        if skipped:
            self.skipped.inc(skipped)
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


def register_hooks(registry, hook_type) -> None:
    registry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.update_request_meta_info",
        update_request_meta_info_hook,
        hook_type.AROUND,
    )
