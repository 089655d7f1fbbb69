"""SGLang plugin (entry point `sglang.srt.plugins`) of the GPU serving run: kernels without sglang-kernel.

On CUDA without sglang-kernel and flashinfer, two of SGLang's speculative paths have no kernel:
- sampled verification (`tree_speculative_sampling_target_only`, a JIT kernel that includes flashinfer's
  headers) and the top-k / top-p renormalisation before it (flashinfer): routed to the project's PyTorch
  versions (sglang_tts.platform.cpu.spec_sampling, looked up at each call), when
  SGLANG_TTS_GPU_SAMPLING=torch;
- EAGLE's tree build and greedy verify are SGLang's own kernels, compiled with tvm-ffi and nvcc at first
  use; SGLANG_TTS_GPU_TREE=triton routes them to SGLang's Triton versions (its XPU path) instead.
- SGLang's Llama MLP asks `sglang.kernels.ops.gemm.cutedsl_dual_gemm` (Blackwell CuTe-DSL kernels) whether
  its dual GEMM applies while the model is built; that module imports `cutlass` (nvidia-cutlass-dsl), which
  the GPU machine lacks. Where `cutlass` is absent, a stand-in module answers "never applies"
  (`can_use_dual_gemm` False: the MLP keeps its two GEMMs), with the real module's names and modes.
Only where CUDA is present. A route replaces the attribute in the module that defines it and, by identity,
in every module already holding the same object (`from x import name` copies it); a name that is None (as
these are without CUDA) is never routed, since every None would match. HookRegistry's REPLACE is not used:
it wraps with functools.wraps, which reads `__name__` from the flashinfer LazyImport and so imports
flashinfer. `ROUTED` lists what this process routed, for the import check.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

SAMPLING_ENV = "SGLANG_TTS_GPU_SAMPLING"
TREE_ENV = "SGLANG_TTS_GPU_TREE"
ROUTED: list[str] = []

SAMPLING_TARGETS = {
    "sglang.kernels.ops.speculative.verify_sampling.tree_speculative_sampling_target_only": (
        "tree_speculative_sampling_target_only"
    ),
    "sglang.kernels.ops.sampling.renorm.top_k_renorm_prob": "top_k_renorm_prob",
    "sglang.kernels.ops.sampling.renorm.top_p_renorm_prob": "top_p_renorm_prob",
}


def _project_sampling_op(name: str):
    def op(*args, **kwargs):
        from sglang_tts.platform.cpu import spec_sampling

        return getattr(spec_sampling, name)(*args, **kwargs)

    op.__name__ = f"sglang_tts_{name}"
    return op


def triton_build_tree(*args, **kwargs):
    from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton

    return sgl_build_tree_kernel_triton(*args, **kwargs)


def triton_verify_tree_greedy(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    target_predict,
):
    """`tree.verify_tree_greedy`'s signature (sgl_kernel's `retrive_*` spelling) on SGLang's Triton kernel."""
    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_triton

    verify_tree_greedy_triton(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_token_num,
        candidates=candidates,
        retrieve_index=retrive_index,
        retrieve_next_token=retrive_next_token,
        retrieve_next_sibling=retrive_next_sibling,
        target_predict=target_predict,
    )


DUAL_GEMM_MODULE = "sglang.kernels.ops.gemm.cutedsl_dual_gemm"


class DualGemmQuantMode(enum.IntEnum):
    """The real module's modes, same values (SGLang compares them by identity within the stand-in)."""

    STATIC_PER_TENSOR = 0
    STATIC_PER_TOKEN = 1
    DYNAMIC_PER_TENSOR = 2
    DYNAMIC_PER_TOKEN = 3
    UNQUANT = 4

    @property
    def is_quantized(self) -> bool:
        return self is not DualGemmQuantMode.UNQUANT


def _no_dual_gemm(*args, **kwargs):
    raise NotImplementedError(f"{DUAL_GEMM_MODULE}: not in the GPU serving stand-in (no cutlass on this machine)")


def dual_gemm_standin() -> types.ModuleType:
    """`cutedsl_dual_gemm` as a module whose dual GEMM never applies."""
    module = types.ModuleType(DUAL_GEMM_MODULE, "GPU serving stand-in: the CuTe-DSL dual GEMM never applies.")
    module.MAX_DUAL_GEMM_DECODE_TOKENS = 16
    module.DualGemmQuantMode = DualGemmQuantMode
    module.can_use_dual_gemm = lambda *args, **kwargs: False
    module.dual_gemm_swiglu = module.dual_gemm_swiglu_fp8 = _no_dual_gemm
    module.SGLANG_TTS_GPU_STANDIN = True
    return module


def stand_in_dual_gemm() -> bool:
    """Install the stand-in where `cutlass` is missing (before anything imports the real module)."""
    if importlib.util.find_spec("cutlass") is not None or DUAL_GEMM_MODULE in sys.modules:
        return False
    sys.modules[DUAL_GEMM_MODULE] = dual_gemm_standin()
    ROUTED.append(DUAL_GEMM_MODULE)
    return True


TREE_TARGETS = {
    "sglang.kernels.ops.speculative.spec_tree.sgl_build_tree_kernel_efficient": triton_build_tree,
    "sglang.kernels.ops.speculative.tree.verify_tree_greedy": triton_verify_tree_greedy,
}


def route(target: str, new: Callable[..., Any]) -> bool:
    """Point `target` (module.attribute) and every module's binding of the same object at `new`."""
    module_name, name = target.rsplit(".", 1)
    module = importlib.import_module(module_name)
    old = getattr(module, name, None)
    if old is None:
        logger.warning("sglang-tts gpu_serve: %s is absent or None here, not routed", target)
        return False
    for other in list(sys.modules.values()):
        try:
            namespace = vars(other)
        except TypeError:
            continue
        for attr, value in list(namespace.items()):
            if value is old:
                setattr(other, attr, new)
    ROUTED.append(target)
    return True


def register() -> None:
    import torch

    if not torch.cuda.is_available():
        logger.info("sglang-tts gpu_serve: no CUDA device, nothing routed")
        return
    stand_in_dual_gemm()
    if os.environ.get(SAMPLING_ENV) == "torch":
        for target, name in SAMPLING_TARGETS.items():
            route(target, _project_sampling_op(name))
    if os.environ.get(TREE_ENV) == "triton":
        for target, op in TREE_TARGETS.items():
            route(target, op)
    logger.info("sglang-tts gpu_serve: routed %s", ", ".join(t.rsplit(".", 1)[1] for t in ROUTED) or "nothing")
