"""Where drafter updates run: inline, on a CPU worker thread, or on a side CUDA stream.

One contract for all three (paper, appendix C.1-C.3):

    submit(fn)  start the update; returns at once (SyncExecutor: after running it inline).
                At most one update is in flight: submitting while one is pending first waits for
                it (a CPU-side block, recorded as wait time); its result is then only kept in
                `last_result`, so callers that need every result call wait() before submit()
                (the Distiller does).
    wait()      the CPU-side barrier: blocks until the pending update has *completed* (on CUDA:
                its side-stream kernels have finished, not just been enqueued) and returns an
                UpdateResult, or None if nothing was pending. Never raises: an exception in the
                update comes back inside the result.

The barrier must be on the CPU because CUDA-graph replay ignores cross-stream waits: the serving
thread may only replay the next draft graph after wait() has returned.

Every update records its timing (submitted, started, finished, and how long wait() blocked), so
the part of the update hidden behind serving ("overlap") can be reported.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class UpdateTiming:
    """perf_counter() seconds; wait_blocked_s is how long the caller was blocked waiting for it."""

    submitted_at: float
    started_at: float = 0.0
    finished_at: float = 0.0
    wait_blocked_s: float = 0.0

    @property
    def run_s(self) -> float:
        return self.finished_at - self.started_at

    @property
    def hidden_s(self) -> float:
        """Update time that overlapped serving instead of blocking it."""
        return max(0.0, self.run_s - self.wait_blocked_s)


@dataclass
class UpdateResult:
    value: Any = None
    error: BaseException | None = None
    timing: UpdateTiming = field(default_factory=lambda: UpdateTiming(time.perf_counter()))

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class ExecutorTotals:
    num_completed: int = 0
    run_s: float = 0.0
    wait_blocked_s: float = 0.0
    hidden_s: float = 0.0

    def add(self, timing: UpdateTiming) -> None:
        self.num_completed += 1
        self.run_s += timing.run_s
        self.wait_blocked_s += timing.wait_blocked_s
        self.hidden_s += timing.hidden_s


class UpdateExecutor(ABC):
    #: True when updates run on the serving path itself (nothing to overlap, wait() never blocks).
    inline: bool = False

    def __init__(self) -> None:
        self.last_result: UpdateResult | None = None
        self.totals = ExecutorTotals()

    @property
    @abstractmethod
    def pending(self) -> bool:
        """An update was submitted and wait() has not yet returned its result."""

    @property
    def running(self) -> bool:
        """An update is still computing (pending and not finished); inline updates never are."""
        return False

    @abstractmethod
    def submit(self, fn: Callable[[], Any]) -> None: ...

    @abstractmethod
    def wait(self) -> UpdateResult | None: ...

    def close(self) -> None:
        """Wait for the pending update (if any) and release resources."""
        self.wait()

    def _finish(self, result: UpdateResult) -> UpdateResult:
        self.last_result = result
        self.totals.add(result.timing)
        return result


def _run_captured(fn: Callable[[], Any], result: UpdateResult) -> None:
    result.timing.started_at = time.perf_counter()
    try:
        result.value = fn()
    except BaseException as exc:  # noqa: BLE001 - never propagate into serving; see result.error
        result.error = exc
    result.timing.finished_at = time.perf_counter()


class SyncExecutor(UpdateExecutor):
    """Runs the update inline in submit(): the synchronous baseline (--tts-sync)."""

    inline = True

    def __init__(self) -> None:
        super().__init__()
        self._done: UpdateResult | None = None

    @property
    def pending(self) -> bool:
        return self._done is not None

    def submit(self, fn: Callable[[], Any]) -> None:
        if self._done is not None:
            self.wait()
        result = UpdateResult(timing=UpdateTiming(time.perf_counter()))
        _run_captured(fn, result)
        result.timing.wait_blocked_s = result.timing.run_s  # the caller was blocked for all of it
        self._done = result

    def wait(self) -> UpdateResult | None:
        result, self._done = self._done, None
        return None if result is None else self._finish(result)


@dataclass
class _Job:
    fn: Callable[[], Any]
    result: UpdateResult
    done: threading.Event = field(default_factory=threading.Event)
    cuda_event: Any = None  # torch.cuda.Event on the side stream (SideStreamExecutor)


class _WorkerThreadExecutor(UpdateExecutor):
    """One daemon worker thread running submitted updates in order; subclasses choose the stream."""

    def __init__(self, thread_name: str) -> None:
        super().__init__()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._pending_job: _Job | None = None
        self._thread = threading.Thread(target=self._work, name=thread_name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> bool:
        return self._pending_job is not None

    @property
    def running(self) -> bool:
        job = self._pending_job
        return job is not None and not job.done.is_set()

    def submit(self, fn: Callable[[], Any]) -> None:
        if self._pending_job is not None:
            self.wait()
        job = _Job(fn, UpdateResult(timing=UpdateTiming(time.perf_counter())))
        self._before_submit(job)
        self._pending_job = job
        self._jobs.put(job)

    def wait(self) -> UpdateResult | None:
        job, self._pending_job = self._pending_job, None
        if job is None:
            return None
        blocked_from = time.perf_counter()
        job.done.wait()
        self._after_done(job)
        job.result.timing.wait_blocked_s = time.perf_counter() - blocked_from
        return self._finish(job.result)

    def close(self) -> None:
        self.wait()
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._run(job)
            except BaseException as exc:  # noqa: BLE001 - a failing hook must not leave wait() blocked
                job.result.error = job.result.error or exc
            finally:
                job.done.set()

    # Hooks: the CPU twin does nothing extra; the CUDA executor orders streams and records events.
    def _before_submit(self, job: _Job) -> None:
        pass

    def _run(self, job: _Job) -> None:
        _run_captured(job.fn, job.result)

    def _after_done(self, job: _Job) -> None:
        pass


class ThreadExecutor(_WorkerThreadExecutor):
    """CPU: the update runs on a worker thread while the serving thread keeps drafting/verifying."""

    def __init__(self) -> None:
        super().__init__("tts-update")


class SideStreamExecutor(_WorkerThreadExecutor):
    """CUDA: the worker thread runs the update under a side stream; wait() is a CPU-side barrier.

    The side stream first waits for the serving stream (so the update sees the canvas copy the
    serving thread just enqueued). The worker synchronizes the update's event before reporting
    done, so the recorded finish time is the GPU's; wait() synchronizes it again (free by then) as
    the explicit barrier before the next CUDA-graph replay.
    """

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"SideStreamExecutor needs a CUDA device, got {device}")
        self.stream = torch.cuda.Stream(device=device)
        # With its index: SGLang passes "cuda" (the current device), and set_device() in the worker needs one.
        self.device = self.stream.device
        super().__init__("tts-update-cuda")

    def _before_submit(self, job: _Job) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def _run(self, job: _Job) -> None:
        # Current device and stream are per thread in PyTorch: set both inside the worker.
        torch.cuda.set_device(self.device)
        with torch.cuda.stream(self.stream):
            _run_captured(job.fn, job.result)
            job.cuda_event = torch.cuda.Event()
            job.cuda_event.record(self.stream)
        job.cuda_event.synchronize()
        job.result.timing.finished_at = time.perf_counter()

    def _after_done(self, job: _Job) -> None:
        if job.cuda_event is not None:
            job.cuda_event.synchronize()


def executor_class(device: torch.device | str, sync: bool, cpu_thread: bool = False) -> type[UpdateExecutor]:
    """Sync on request; otherwise a side stream on CUDA. Elsewhere inline, unless `cpu_thread`: on a
    CPU the update and the serving forward share the cores, and a second thread of OpenMP workers made
    every round ~25% slower on the project's 2-core machine, rounds without an update in flight
    included (docs/update-cost.md), more than the overlap gives back."""
    if sync:
        return SyncExecutor
    if torch.device(device).type == "cuda":
        return SideStreamExecutor
    return ThreadExecutor if cpu_thread else SyncExecutor


def make_executor(device: torch.device | str, sync: bool, cpu_thread: bool = False) -> UpdateExecutor:
    cls = executor_class(device, sync, cpu_thread)
    return cls(torch.device(device)) if cls is SideStreamExecutor else cls()
