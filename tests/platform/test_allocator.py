"""sglang_tts.platform.cpu.allocator: glibc keeps freed memory for the next round's large tensors."""

from __future__ import annotations

import subprocess
import sys

from sglang_tts.platform.cpu import allocator

# A fresh process: mallopt changes the allocator of the process that calls it for good.
PROBE = """
import time, torch
from sglang_tts.platform.cpu import allocator
torch.set_num_threads(1)
if {keep}:
    assert allocator.keep_freed_memory()
x = torch.rand(16, 151_936)
best = 1e9
for _ in range(20):  # each copy is a fresh 19 MB tensor, freed right after
    start = time.perf_counter()
    x.to(torch.float64)
    best = min(best, time.perf_counter() - start)
print(best)
"""


def _fastest_copy_s(keep: bool) -> float:
    # Without the call, the threshold glibc starts with (no dynamic raise) stands for a busy server's arenas.
    env = None if keep else {"MALLOC_MMAP_THRESHOLD_": "131072", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(keep=keep)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return float(out.stdout.split()[-1])


def test_glibc_accepts_both_settings_and_the_switch_turns_them_off(monkeypatch) -> None:
    assert allocator.keep_freed_memory() is True  # this test machine runs glibc
    monkeypatch.setenv(allocator.ENV, "0")
    assert allocator.keep_freed_memory() is False


def test_a_fresh_large_tensor_lands_on_pages_already_touched() -> None:
    # 19 MB of fresh pages fault in at several ms; memory already touched copies in a fraction of that.
    assert _fastest_copy_s(keep=True) < 0.5 * _fastest_copy_s(keep=False)
