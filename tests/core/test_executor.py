"""The executor contract: async submit, CPU-side wait barrier, captured errors, timing."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from sglang_tts.core.executor import (
    SideStreamExecutor,
    SyncExecutor,
    ThreadExecutor,
    executor_class,
    make_executor,
)


def test_sync_executor_runs_inline_and_captures_errors():
    executor = SyncExecutor()
    ran = []
    executor.submit(lambda: ran.append(1) or "value")
    assert ran == [1] and executor.pending
    result = executor.wait()
    assert result.ok and result.value == "value" and not executor.pending
    assert result.timing.wait_blocked_s == pytest.approx(result.timing.run_s)  # nothing was hidden
    assert executor.wait() is None

    def boom():
        raise ValueError("bad update")

    executor.submit(boom)  # does not raise into the caller
    failed = executor.wait()
    assert not failed.ok and isinstance(failed.error, ValueError)


def test_thread_executor_overlaps_and_wait_blocks_until_done():
    executor = ThreadExecutor()
    release = threading.Event()
    worker_thread = []

    def update():
        worker_thread.append(threading.current_thread())
        release.wait(timeout=5)
        time.sleep(0.05)
        return torch.ones(2).sum().item()

    executor.submit(update)
    assert executor.pending  # submit returned while the update is still running
    release.set()
    result = executor.wait()
    assert result.ok and result.value == 2.0 and not executor.pending
    assert worker_thread[0] is not threading.current_thread()
    timing = result.timing
    assert timing.submitted_at <= timing.started_at < timing.finished_at
    assert timing.run_s >= 0.05 and timing.wait_blocked_s >= 0.04
    executor.close()
    assert not executor._thread.is_alive()


def test_thread_executor_hides_update_time_behind_serving():
    executor = ThreadExecutor()
    executor.submit(lambda: time.sleep(0.05))
    time.sleep(0.25)  # "serving" while the update runs
    timing = executor.wait().timing
    assert timing.wait_blocked_s < timing.run_s / 2 and timing.hidden_s >= 0.025
    assert executor.totals.num_completed == 1 and executor.totals.hidden_s == pytest.approx(timing.hidden_s)
    executor.close()


def test_thread_executor_error_and_one_pending_at_a_time():
    executor = ThreadExecutor()
    order = []

    def slow_first():
        time.sleep(0.05)
        order.append("first")
        raise RuntimeError("first failed")

    executor.submit(slow_first)
    executor.submit(lambda: order.append("second"))  # waits for the first before queueing
    assert order[0] == "first"
    assert isinstance(executor.last_result.error, RuntimeError)
    assert executor.wait().ok and order == ["first", "second"]
    executor.close()


def test_executor_selection():
    assert executor_class("cpu", sync=True) is SyncExecutor
    assert executor_class("cpu", sync=False) is SyncExecutor  # inline between rounds: the CPU default
    assert executor_class("cpu", sync=False, cpu_thread=True) is ThreadExecutor
    assert executor_class("cuda", sync=True) is SyncExecutor
    assert executor_class(torch.device("cuda", 1), sync=False) is SideStreamExecutor
    assert executor_class(torch.device("cuda", 1), sync=False, cpu_thread=True) is SideStreamExecutor
    executor = make_executor("cpu", sync=False, cpu_thread=True)
    assert isinstance(executor, ThreadExecutor)
    executor.close()
    assert isinstance(make_executor(torch.device("cpu"), sync=True), SyncExecutor)
    with pytest.raises(ValueError, match="CUDA"):
        SideStreamExecutor("cpu")
