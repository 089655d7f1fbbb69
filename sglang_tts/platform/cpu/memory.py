"""SGLang's CPU memory accounting, counted in this process's own memory rather than the machine's.

Why: SGLang sizes the KV pool as if the device were its own, like a GPU. `measure_pre_model_load_memory`
(sglang/srt/distributed/bootstrap.py) reads the free memory before the weights load;
`KVCacheConfigurator._profile_available_bytes` (sglang/srt/mem_cache/kv_cache_configurator.py) reads it
again after them (and after the drafter, the CPU layer's packed weights, TTS's adapter slots) and grants
the KV pool `free_now - free_before * (1 - mem_fraction_static)`, raising "Loaded weights leave no GPU
memory for the KV cache" when that is not positive. `--max-total-tokens` only caps the result later
(`_apply_token_constraints`), so it cannot prevent the error. On CPU both readings are
`get_free_cpu_memory` (sglang/srt/utils/common.py): the machine's available memory, shared with every
other process. Whatever a neighbour allocates between the readings (another server loading, a test
process, a compiler SGLang spawns for the NGRAM corpus) is charged to this server's weights, and the
pool shrinks or the launch fails.

What the hook does: `get_free_cpu_memory` keeps its first reading in this process (the memory the
machine really had free when the server started) and from then on subtracts only the growth of this
process's own memory (`own_memory_bytes`). The weights, the drafter and everything else the process
allocates are still counted, as on a GPU; other processes are not. A machine that lacks memory when
the server starts still fails SGLang's check; memory neighbours allocate after that first reading is not
seen (docs/cpu.md: why that is the right trade on a shared machine).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from dataclasses import dataclass

import psutil

TARGET = "sglang.srt.utils.common.get_free_cpu_memory"

# /proc/self/status fields (kB) of the memory that leaves the machine's available memory when this
# process allocates: anonymous pages (tensors, the Python heap) and shared memory. File-backed pages
# (the memory-mapped checkpoint, libraries) are page cache, which the kernel counts as available.
_OWN_FIELDS = ("RssAnon", "RssShmem")


def own_memory_bytes() -> int:
    """This process's resident memory that the machine's available memory excludes (`_OWN_FIELDS`);
    the whole resident set where /proc does not report them (not Linux)."""
    try:
        status = pathlib.Path("/proc/self/status").read_text()
    except OSError:
        return psutil.Process().memory_info().rss
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if not all(name in fields for name in _OWN_FIELDS):
        return psutil.Process().memory_info().rss
    return sum(int(fields[name].split()[0]) * 1024 for name in _OWN_FIELDS)


@dataclass(frozen=True)
class Baseline:
    """The first reading in a process: the machine's free memory and this process's own memory then."""

    pid: int  # a forked child inherits the module state: it must take its own baseline
    free_bytes: int
    own_bytes: int


_baseline: Baseline | None = None


def free_cpu_memory_hook(original: Callable[[], int]) -> int:
    """AROUND hook of `get_free_cpu_memory`: the machine's free memory at this process's first reading,
    less what this process has allocated since (it grows back when the process frees memory)."""
    global _baseline
    own = own_memory_bytes()
    if _baseline is None or _baseline.pid != os.getpid():
        _baseline = Baseline(os.getpid(), int(original()), own)
    return max(0, _baseline.free_bytes - (own - _baseline.own_bytes))


def reset() -> None:
    """Forget the baseline (tests; the next reading takes a new one)."""
    global _baseline
    _baseline = None


def register_hooks(registry, hook_type) -> None:
    registry.register(TARGET, free_cpu_memory_hook, hook_type.AROUND)
