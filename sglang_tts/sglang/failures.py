"""Failures of TTS work inside SGLang's scheduler: absorbed, counted, logged without flooding.

Everything TTS runs on the scheduler thread (the barrier and reset before a draft, the capture
after verify, the prefill anchors, the adapter hooks inside the draft forward, the controller
callbacks) goes through `FailureLog.absorb(site)`. An exception there disables TTS for that
piece of that round only: the round is served by SGLang's own code with the weights in place
(drafts are only proposals, so the output stays exactly the target's), the failure is counted
per site (Prometheus `sglang_tts:failures_total{site}`), charged to the requests of the batch
(`tts_failures` in meta_info), and logged: with its traceback the first time a site fails, then
as one line per `log_every` failures, never a traceback per round.

For tests, `SGLANG_TTS_FAULT_SITES="capture:3,barrier:5"` makes every 3rd capture and every 5th
barrier raise, at the end of the site's work (as a real failure there would: the work done so
far stays done, nothing after it runs).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator

logger = logging.getLogger(__name__)

SITES = (
    "barrier",
    "capture",
    "report",
    "prefill_anchor",
    "adapter_map",
    "adapter_hook",
    "controller",
    "prompt_capture",
    "prompt",
    "target_update",  # weight_sync.py: the drafter's side of a target weight update
    "drafter_update",  # weight_sync.py: a retrained drafter loaded through selector "draft" (rolled back)
)
FAULT_SITES_ENV = "SGLANG_TTS_FAULT_SITES"


class InjectedFault(RuntimeError):
    """Raised on purpose at a site named in SGLANG_TTS_FAULT_SITES."""


def fault_sites_from_env() -> dict[str, int]:
    """`site:every,...` -> {site: every}; unknown sites are a launch-time error."""
    spec = os.environ.get(FAULT_SITES_ENV, "").strip()
    sites: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        site, _, every = item.partition(":")
        if site not in SITES:
            raise ValueError(f"{FAULT_SITES_ENV}: unknown site {site!r} (one of {', '.join(SITES)})")
        sites[site] = max(int(every or 1), 1)
    return sites


class FailureLog:
    def __init__(self, log_every: int = 100, inject: dict[str, int] | None = None) -> None:
        self.counts: dict[str, int] = dict.fromkeys(SITES, 0)  # fixed keys: bounded
        # Per site, the latest failure as text (for answers that name it; no traceback kept alive).
        self.last_error: dict[str, str] = {}
        self.log_every = log_every
        self._inject = inject or {}
        self._calls: dict[str, int] = dict.fromkeys(self._inject, 0)
        # Called with (site, request ids) for each failure: per-request counters and Prometheus.
        self.on_failure: Callable[[str, list[str]], None] | None = None

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @contextlib.contextmanager
    def absorb(self, site: str, request_ids: Iterable[str] = ()) -> Iterator[None]:
        """Run the body; an exception in it is recorded against `site` and goes no further."""
        try:
            yield
            self._maybe_inject(site)
        except Exception as error:  # noqa: BLE001 - the point: nothing TTS does may fail a batch
            self.record(site, error, list(request_ids))

    def record(self, site: str, error: BaseException, request_ids: list[str]) -> None:
        self.counts[site] = self.counts.get(site, 0) + 1
        self.last_error[site] = f"{type(error).__name__}: {error}"
        count = self.counts[site]
        if count == 1:
            logger.error(
                "sglang-tts: %s failed; TTS skips it this round and serves on (logged once with its "
                "traceback, then every %d failures)",
                site,
                self.log_every,
                exc_info=error,
            )
        elif count % self.log_every == 0:
            logger.warning("sglang-tts: %s failed %d times so far (last: %r)", site, count, error)
        if self.on_failure is not None:
            try:
                self.on_failure(site, request_ids)
            except Exception:  # noqa: BLE001 - counting must not become a failure of its own
                logger.debug("sglang-tts: could not count a failure", exc_info=True)

    def _maybe_inject(self, site: str) -> None:
        every = self._inject.get(site)
        if every is None:
            return
        self._calls[site] += 1
        if self._calls[site] % every == 0:
            raise InjectedFault(f"injected fault at {site} (call {self._calls[site]})")
