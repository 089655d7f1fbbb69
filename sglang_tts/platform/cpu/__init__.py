"""SGLang-on-CPU support: what SGLang's missing CPU kernel build would provide.

Active only where the real kernels are absent (no importable `sgl_kernel` and no CUDA device);
on a GPU machine `install()` returns without touching anything, so GPU users get stock SGLang.
What it does when active:
1. sets SGLANG_USE_CPU_ENGINE=1 (SGLang's `is_cpu()` reads it; `--device cpu` alone is not enough);
2. puts a pure-PyTorch `sgl_kernel` stand-in at the END of sys.path (and PYTHONPATH, for
   subprocesses); multiprocessing's spawn copies sys.path into SGLang's scheduler processes,
   which import `sgl_kernel` at module level before their own plugin loading runs;
3. registers HookRegistry AROUND hooks that teach the torch_native attention backend
   TARGET_VERIFY and give DraftBackendFactory torch-native multi-step draft / draft-extend backends;
4. routes sampling requests' verify to a PyTorch target-only tree sampler (stock SGLang commits
   the target's argmax on CPU even when the request samples);
5. lets stock DFLASH run on CPU (sglang_tts.platform.cpu.dflash);
6. runs the linear layers and LM heads of target and drafter through oneDNN weights packed once at
   load (sglang_tts.platform.cpu.linear: a few-row product, a verify, then costs near one row's);
7. with $SGLANG_TTS_CPU_ROUND_TIMING set, logs the wall time of every decode, draft, verify and
   draft-extend phase (sglang_tts.platform.cpu.round_timing, for scripts/bench_cpu_round.py);
8. counts only this process's own allocations in SGLang's free-memory readings, so what other processes
   allocate while a server loads does not shrink or refuse its KV pool (sglang_tts.platform.cpu.memory);
9. honours a request's sampling seed, and verifies sampling requests against the target's seeded
   samples, so a seeded answer is the same with or without speculation (sglang_tts.platform.cpu.seeded_sampling),
   drawing them with noise only for the columns that can win (sglang_tts.platform.cpu.seeded_gumbel);
10. has glibc keep freed memory for the next round's large tensors instead of faulting in fresh pages
   every round (sglang_tts.platform.cpu.allocator).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pathlib
import sys

logger = logging.getLogger(__name__)

SHIM_DIR = pathlib.Path(__file__).resolve().parent / "kernel_shim"
_installed = False


def real_kernels_present() -> bool:
    """True when a real sgl_kernel is importable (our stand-in excluded) or CUDA is usable."""
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is not None and spec.origin is not None and not str(spec.origin).startswith(str(SHIM_DIR)):
        return True
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - torch always importable where SGLang is
        return False


def needed() -> bool:
    """Whether the CPU layer should activate in this process."""
    if os.environ.get("SGLANG_TTS_CPU_SUPPORT", "auto") == "0":
        return False
    if os.environ.get("SGLANG_TTS_CPU_SUPPORT", "auto") == "1":
        return True
    return not real_kernels_present()


def _add_shim_to_path() -> None:
    shim = str(SHIM_DIR)
    if shim not in sys.path:
        sys.path.append(shim)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if shim not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([*parts, shim])


def _register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_tts.platform.cpu import (
        attention,
        dflash,
        linear,
        memory,
        round_timing,
        seeded_sampling,
        spec_sampling,
    )

    HookRegistry.register(
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
        attention.forward_extend_hook,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.speculative.draft_utils.DraftBackendFactory.create_decode_backend",
        attention.create_decode_backend_hook,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.speculative.draft_utils.DraftBackendFactory.create_draft_extend_backend",
        attention.create_draft_extend_backend_hook,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.speculative.eagle_utils._verify_uses_greedy",
        spec_sampling.verify_uses_greedy_hook,
        HookType.AROUND,
    )
    dflash.register_hooks(HookRegistry, HookType)
    linear.register_hooks(HookRegistry, HookType)
    round_timing.register_hooks(HookRegistry, HookType)
    memory.register_hooks(HookRegistry, HookType)
    seeded_sampling.register_hooks(HookRegistry, HookType)


def install() -> bool:
    """Activate CPU support if needed; idempotent. Returns whether it is active."""
    global _installed
    if _installed:
        return True
    if not needed():
        return False
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    _add_shim_to_path()
    _register_hooks()
    from sglang_tts.platform.cpu.allocator import keep_freed_memory

    keep_freed_memory()
    _installed = True
    logger.info("sglang-tts: CPU support active (torch-native sgl_kernel ops, verify and draft attention)")
    return True
