"""Triton backend of the TTS update loss (fused linear + KL), structured like Liger's fused linear cross-entropy.

For each chunk of positions PyTorch computes the logits block ``h_chunk @ W^T``; one Triton program per row then
streams over the vocabulary twice:

1. online softmax statistics (running max and rescaled sum of exponentials) together with ``sum p``,
   ``sum p log p`` and ``sum p x`` (and the same for ``r`` when the anchor term is on) -> the row's loss;
2. ``q = exp(x - lse)`` and ``dL/dx = w (P q - p) + lambda w (R q - r)``, written over the logits in place.

PyTorch matmuls then fold the gradient block into ``dL/dhidden`` and ``dL/dweight`` (shared driver in
:mod:`sglang_tts.kernels.chunked`). Masked tails handle ``V`` that is not a multiple of ``BLOCK_SIZE``; a zero-weight
row yields a zero loss and a zero gradient without special casing.

This module imports Triton at load time; :mod:`sglang_tts.kernels` only loads it when the Triton backend is used.
Under ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors, which is how the tests exercise it.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from .chunked import linear_kl_forward, pop_scaled_grads, stash_grads

__all__ = ["TritonLinearKL", "kl_rows_triton_", "triton_linear_kl"]

# Largest vocabulary block one program holds in registers per loop step (as in Liger: 64 Ki / 2 float32 values).
MAX_BLOCK_SIZE = 32768
# Logit elements per position chunk on GPU: 2**24 float32 values = 64 MiB, enough rows to keep the matmuls busy.
GPU_CHUNK_ELEMENTS = 1 << 24


@triton.jit
def _linear_kl_rows_kernel(
    logits_ptr,
    logits_row_stride,
    p_ptr,
    p_row_stride,
    r_ptr,
    r_row_stride,
    w_ptr,
    loss_ptr,
    n_cols,
    reg_lambda,
    HAS_PREV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # int64 row offsets: n_rows * V can exceed 2**31 for big chunks.
    row = tl.program_id(0).to(tl.int64)
    x_row = logits_ptr + row * logits_row_stride
    p_row = p_ptr + row * p_row_stride
    r_row = r_ptr + row * r_row_stride
    w = tl.load(w_ptr + row).to(tl.float32)

    # Sweep 1: online softmax statistics plus target statistics.
    run_max = float("-inf")
    run_sum = 0.0
    p_sum = 0.0
    p_negent = 0.0
    p_cross = 0.0
    r_sum = 0.0
    r_negent = 0.0
    r_cross = 0.0
    for start in range(0, n_cols, BLOCK_SIZE):
        offs = start + tl.arange(0, BLOCK_SIZE)
        mask = offs < n_cols
        x = tl.load(x_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, tl.max(x, axis=0))
        # Masked lanes hold -inf and add exp(-inf) = 0. The first block always has a valid lane, so new_max is
        # finite and exp(run_max - new_max) never sees -inf - (-inf).
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        run_max = new_max
        # -inf * 0 would be NaN, so zero the masked logits before the dot products; likewise log(1) = 0 stands in
        # for log(0) so that 0 * log 0 counts as 0 (this also keeps the interpreter free of numpy warnings).
        x_safe = tl.where(mask, x, 0.0)
        p = tl.load(p_row + offs, mask=mask, other=0.0).to(tl.float32)
        p_sum += tl.sum(p, axis=0)
        p_negent += tl.sum(p * tl.log(tl.where(p > 0.0, p, 1.0)), axis=0)
        p_cross += tl.sum(p * x_safe, axis=0)
        if HAS_PREV:
            r = tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)
            r_sum += tl.sum(r, axis=0)
            r_negent += tl.sum(r * tl.log(tl.where(r > 0.0, r, 1.0)), axis=0)
            r_cross += tl.sum(r * x_safe, axis=0)

    lse = run_max + tl.log(run_sum)
    loss = p_negent - p_cross + p_sum * lse
    coef_q = p_sum
    if HAS_PREV:
        loss += reg_lambda * (r_negent - r_cross + r_sum * lse)
        coef_q += reg_lambda * r_sum
    tl.store(loss_ptr + row, w * loss)
    coef_q = w * coef_q

    # Sweep 2: gradient w.r.t. the logits, in place.
    for start in range(0, n_cols, BLOCK_SIZE):
        offs = start + tl.arange(0, BLOCK_SIZE)
        mask = offs < n_cols
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(p_row + offs, mask=mask, other=0.0).to(tl.float32)
        grad = coef_q * tl.exp(x - lse) - w * p
        if HAS_PREV:
            r = tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)
            grad -= reg_lambda * w * r
        tl.store(x_row + offs, grad, mask=mask)


def _launch_config(n_cols: int, block_size: int | None) -> tuple[int, int]:
    """``(BLOCK_SIZE, num_warps)``: one block spans the vocabulary up to ``MAX_BLOCK_SIZE``."""
    if block_size is None:
        block_size = min(MAX_BLOCK_SIZE, triton.next_power_of_2(n_cols))
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    # Heuristic, untuned: enough warps that each thread owns a handful of elements per block.
    num_warps = max(4, min(32, block_size // 1024))
    return block_size, num_warps


def kl_rows_triton_(
    logits: Tensor,
    p: Tensor,
    w: Tensor,
    r: Tensor | None,
    reg_lambda: float,
    block_size: int | None = None,
) -> Tensor:
    """Triton twin of :func:`sglang_tts.kernels.chunked.kl_rows_torch_`: per-row loss, logits overwritten by grads."""
    n_rows, n_cols = logits.shape
    if logits.stride(1) != 1 or p.stride(1) != 1 or (r is not None and r.stride(1) != 1):
        raise ValueError("rows must be contiguous along the vocabulary")
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if n_rows == 0:
        return loss
    w = w.contiguous()
    block, num_warps = _launch_config(n_cols, block_size)
    has_prev = r is not None
    # The kernel never reads r without HAS_PREV; pass p so the pointer argument is a valid tensor.
    r_arg = r if has_prev else p
    _linear_kl_rows_kernel[(n_rows,)](
        logits,
        logits.stride(0),
        p,
        p.stride(0),
        r_arg,
        r_arg.stride(0),
        w,
        loss,
        n_cols,
        float(reg_lambda),
        HAS_PREV=has_prev,
        BLOCK_SIZE=block,
        num_warps=num_warps,
    )
    return loss


class TritonLinearKL(torch.autograd.Function):
    """Autograd wrapper: the Triton forward computes the loss and both gradients; ``backward`` only scales them."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        teacher_probs: Tensor,
        weights: Tensor,
        prev_probs: Tensor | None,
        reg_lambda: float,
        chunk_size: int | None,
        block_size: int | None,
    ) -> Tensor:
        if chunk_size is None:
            budget = GPU_CHUNK_ELEMENTS if hidden.is_cuda else None
            chunk_size = max(1, min(hidden.shape[0], budget // weight.shape[0])) if budget else None

        def rows_fn(logits: Tensor, p: Tensor, w: Tensor, r: Tensor | None, lam: float) -> Tensor:
            return kl_rows_triton_(logits, p.contiguous(), w, None if r is None else r.contiguous(), lam, block_size)

        loss, grad_hidden, grad_weight = linear_kl_forward(
            hidden,
            weight,
            teacher_probs,
            weights,
            prev_probs,
            reg_lambda,
            need_grad_hidden=ctx.needs_input_grad[0],
            need_grad_weight=ctx.needs_input_grad[1],
            chunk_size=chunk_size,
            rows_fn=rows_fn,
        )
        stash_grads(ctx, grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grad_hidden, grad_weight = pop_scaled_grads(ctx, grad_output)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def triton_linear_kl(
    hidden: Tensor,
    weight: Tensor,
    teacher_probs: Tensor,
    weights: Tensor,
    prev_probs: Tensor | None = None,
    reg_lambda: float = 0.0,
    chunk_size: int | None = None,
    block_size: int | None = None,
) -> Tensor:
    """Triton version of :func:`~sglang_tts.kernels.reference.naive_linear_kl` (same arguments and result).

    Args:
        chunk_size: positions per logits block (default: about 64 MiB of logits on GPU, 4 MiB elsewhere).
        block_size: vocabulary elements per kernel loop step, a power of two (default: ``next_pow2(V)`` capped at
            ``MAX_BLOCK_SIZE``). Tests use small values to exercise the masked tail.
    """
    return TritonLinearKL.apply(
        hidden, weight, teacher_probs, weights, prev_probs, float(reg_lambda), chunk_size, block_size
    )
