"""GPU serving stand-in for `sgl_kernel` (the sglang-kernel wheel, absent on the GPU machine).

SGLang 0.5.23 binds about twenty names from sgl_kernel at import on CUDA. With the run's settings
(SGLANG_FORCE_FUSED_OP_BACKEND=torch, --attention-backend triton, --sampling-backend pytorch,
--cuda-graph-backend-prefill disabled) a Llama target with an EAGLE-3 or DFlash drafter calls only
`utils.is_arch_support_pdl`. The norm and activation ops below are plain torch, device-agnostic, in
case a forward_cuda path is reached anyway; every other name raises NotImplementedError naming itself
when called (gpu_serve_missing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gpu_serve_missing import missing_attr, serve_submodules

serve_submodules("sgl_kernel")
SGLANG_TTS_GPU_STANDIN = True


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    x = input.float()
    y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(input.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    residual.add_(input)
    input.copy_(rmsnorm(residual, weight, eps))


def gemma_rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    return rmsnorm(input, weight + 1.0, eps, out)


def gemma_fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    fused_add_rmsnorm(input, residual, weight + 1.0, eps)


def _gated(activation, input, out=None):
    half = input.shape[-1] // 2
    y = (activation(input[..., :half].float()) * input[..., half:].float()).to(input.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def silu_and_mul(input, out=None, enable_pdl=None):
    return _gated(F.silu, input, out)


def gelu_and_mul(input, out=None, enable_pdl=None):
    return _gated(F.gelu, input, out)


def gelu_tanh_and_mul(input, out=None, enable_pdl=None):
    return _gated(lambda x: F.gelu(x, approximate="tanh"), input, out)


def __getattr__(name):
    return missing_attr(__name__, name)
