"""Peak-memory measurement for the kernel tests and benchmark.

The CPU allocator keeps no statistics, and ``tracemalloc``/RSS either miss torch's allocations or blur them with
allocator caching. So the function runs under ``torch.profiler`` with ``profile_memory=True``: every c10
allocation and free is recorded with its size and address, and replaying them in time order gives the exact
peak of live tensor bytes. Allocations outside c10 (a BLAS library's private workspace, say) are not seen; they
are the same for every backend compared here. The same replay works for CUDA's caching allocator (it reports
each block to the profiler), which keeps CPU and GPU numbers comparable.

Besides the plain peak we report a *working* peak that ignores chosen live tensors, typically the gradients a
loss must return anyway: ``dL/dW`` of a ``[V, H]`` LM head is identical for every backend and can dwarf the
``[N, V]`` intermediates that the backends actually differ in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

__all__ = ["MemoryPeak", "measure_peak_memory"]


@dataclass(frozen=True)
class MemoryPeak:
    """Peaks in bytes above the level when the measured call started."""

    total: int  # every allocation counted
    working: int  # allocations of the excluded tensors (e.g. the returned gradients) left out
    result: Any  # what the measured function returned


def measure_peak_memory(
    fn: Callable[[], Any],
    device: torch.device | str = "cpu",
    exclude: Callable[[Any], Iterable[Tensor | None]] | None = None,
) -> MemoryPeak:
    """Run ``fn()`` once under the profiler and replay its allocations on ``device``.

    Args:
        fn: the work to measure; tensors it returns (or leaves in ``.grad``) count while they are live.
        device: which allocator to follow (``cpu`` or ``cuda[:i]``).
        exclude: called with ``fn``'s result after it ran; returns tensors whose storage allocation is left out
            of ``working`` (``None`` entries are skipped).
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = sorted(_allocation_events(prof, device))
    if not events:
        # A silent 0 would let any "uses less memory" assertion pass; fail loudly if the profiler API changed.
        raise RuntimeError(f"torch.profiler recorded no allocation events on {device}")

    excluded_ptrs = set()
    if exclude is not None:
        excluded_ptrs = {t.untyped_storage().data_ptr() for t in exclude(result) if t is not None}
    # The excluded tensors are live at the end, so their allocation is the *last* allocation at that address.
    last_alloc_at: dict[int, int] = {}
    for i, (_, size, ptr) in enumerate(events):
        if size > 0 and ptr in excluded_ptrs:
            last_alloc_at[ptr] = i
    skipped = set(last_alloc_at.values())

    live_total = live_working = peak_total = peak_working = 0
    for i, (_, size, _) in enumerate(events):
        live_total += size  # frees carry negative sizes
        if i not in skipped:
            live_working += size
        peak_total = max(peak_total, live_total)
        peak_working = max(peak_working, live_working)
    return MemoryPeak(total=peak_total, working=peak_working, result=result)


def _allocation_events(prof: profile, device: torch.device) -> list[tuple[int, int, int]]:
    """``(time_ns, signed bytes, address)`` of every allocation/free the profiler saw on ``device``."""
    from torch._C._profiler import _EventType

    out: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == device.type and (device.index is None or fields.device.index == device.index):
                out.append((node.start_time_ns, fields.alloc_size, fields.ptr))
        stack.extend(node.children)
    return out
