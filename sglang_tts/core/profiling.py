"""Where an update's time goes: an optional phase timer the Distiller reports into.

`Distiller.timer = PhaseTimer(...)` makes every update record the wall time of its phases
(rollback copy, teacher, forward, loss, backward, clipping, optimizer, finite check, guard
scoring) and every barrier its publish. Off by default (the Distiller then uses a no-op
context); scripts/profile_update.py turns it on. On CUDA pass `sync=torch.cuda.synchronize`:
a phase then ends when its kernels have, which serialises the update (profiling only).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class PhaseTimer:
    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.sync is not None:
            self.sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def mean_ms(self, per: int) -> dict[str, float]:
        """Milliseconds per `per` units of work (e.g. per update) of each phase."""
        return {name: 1e3 * s / max(per, 1) for name, s in self.seconds.items()}
