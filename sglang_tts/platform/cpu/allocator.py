"""Large CPU tensors reuse freed memory instead of faulting in fresh pages every round.

A round on CPU allocates a few tensors of several MB and frees them: the verify's logits (16 rows x Qwen's
151,936 columns: 9.7 MB), the sampler's probabilities and log-probabilities, their float64 copies (19 MB).
glibc's malloc serves an allocation above its mmap threshold (128 KB at start, raised as mmapped chunks
are freed, at most 32 MB) with a fresh mmap and returns it to the kernel on free, so every round touches
new pages, and every 4 KB page costs a fault; in the virtual machines this project runs on, about 5 ms per
10-20 MB (a bool -> int64 copy of 16 x 151,936 values: 0.4 ms from reused memory, 5.4 ms from fresh
pages). PyTorch's CPU allocator has no cache of its own; SGLang's CPU guide preloads tcmalloc or jemalloc
for this. Without a preload, `keep_freed_memory` asks glibc (`mallopt`) to serve allocations of up to 32 MB
from its heap and to keep freed memory mapped, so the next round's tensors land on pages already touched.

The cost: memory freed by a round stays with the process (the peak of one round's temporaries, tens of
MB; at most 256 MB at the heap's top), which the KV pool, fixed at launch, does not need back. Since the
CPU layer counts a server's own memory growth as its weights (docs/cpu.md, "Memory"), memory
freed during the load and kept counts too; the load's large tensors (above 32 MB) are still mmapped and
returned, so that is the small ones' garbage. Off where glibc is not the C library (then
nothing is called) and with SGLANG_TTS_CPU_KEEP_FREED_MEMORY=0.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

ENV = "SGLANG_TTS_CPU_KEEP_FREED_MEMORY"
# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 256 * 1024 * 1024  # keep up to 256 MB of freed memory at the heap's top


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse (see the module docstring); whether it accepted both."""
    if os.environ.get(ENV, "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): leave the allocator alone
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        logger.warning("sglang-tts: glibc refused mallopt; large CPU tensors fault in fresh pages every round")
    return ok
