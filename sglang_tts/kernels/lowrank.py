"""Per-token gathered low-rank delta (per-request adapters in the batched draft forward).

    out[n] = scale * B[s_n] @ (A[s_n] @ x[n])      x [N, in], A [S, r, in], B [S, out, r], s [N]

Every token may use a different request's adapter (a "segmented" / gathered matmul, as in
Punica's BGMV). The PyTorch reference (`lowrank_delta_torch`, also `sglang_tts.core.adapters`)
gathers [N, r, in] copies of A; the kernel instead reads each token's adapter in place: one program
per (token, output block) computes h = A[s] x in registers (r is small) and writes its block of
B[s] h. Stack row 0 is the all-zero "no adapter" row, so tokens without an adapter cost the same
and write zeros. ``import triton`` is guarded so the PyTorch path works without Triton.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # PyTorch-only install
    triton = None

__all__ = ["lowrank_delta_torch", "triton_available", "triton_lowrank_delta"]


def triton_available() -> bool:
    return triton is not None


def lowrank_delta_torch(x: Tensor, a: Tensor, b: Tensor, slots: Tensor, scale: float) -> Tensor:
    """Reference: [N, out]."""
    h = torch.bmm(a[slots], x.unsqueeze(-1))
    return torch.bmm(b[slots], h).squeeze(-1) * scale


if triton is not None:

    @triton.jit
    def _lowrank_delta_kernel(
        x_ptr,
        a_ptr,
        b_ptr,
        slot_ptr,
        out_ptr,
        in_features,
        out_features,
        scale,
        RANK: tl.constexpr,
        BLOCK_IN: tl.constexpr,
        BLOCK_OUT: tl.constexpr,
    ):
        token = tl.program_id(0)
        out_block = tl.program_id(1)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        ranks = tl.arange(0, RANK)
        # h = A[slot] @ x[token], accumulated over input blocks: [RANK]
        h = tl.zeros((RANK,), dtype=tl.float32)
        a_base = a_ptr + slot * RANK * in_features
        for start in range(0, in_features, BLOCK_IN):
            cols = start + tl.arange(0, BLOCK_IN)
            col_ok = cols < in_features
            xv = tl.load(x_ptr + token * in_features + cols, mask=col_ok, other=0.0).to(tl.float32)
            av = tl.load(a_base + ranks[:, None] * in_features + cols[None, :], mask=col_ok[None, :], other=0.0)
            h += tl.sum(av.to(tl.float32) * xv[None, :], axis=1)
        rows = out_block * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        row_ok = rows < out_features
        bv = tl.load(b_ptr + slot * out_features * RANK + rows[:, None] * RANK + ranks[None, :], mask=row_ok[:, None])
        delta = tl.sum(bv.to(tl.float32) * h[None, :], axis=1) * scale
        tl.store(out_ptr + token * out_features + rows, delta.to(out_ptr.dtype.element_ty), mask=row_ok)


def triton_lowrank_delta(
    x: Tensor, a: Tensor, b: Tensor, slots: Tensor, scale: float, block_in: int = 64, block_out: int = 64
) -> Tensor:
    """Triton kernel with the reference's contract. The rank must be a power of two (tl.arange)."""
    if triton is None:
        raise RuntimeError("triton is not installed: use lowrank_delta_torch")
    n, in_features = x.shape
    num_slots, rank, a_in = a.shape
    out_features = b.shape[1]
    if a_in != in_features or tuple(b.shape) != (num_slots, out_features, rank) or slots.shape != (n,):
        raise ValueError(f"shapes do not match: x {tuple(x.shape)} a {tuple(a.shape)} b {tuple(b.shape)}")
    if rank & (rank - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two rank, got {rank}")
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    out = torch.empty(n, out_features, device=x.device, dtype=x.dtype)
    if n == 0:
        return out
    grid = (n, triton.cdiv(out_features, block_out))
    _lowrank_delta_kernel[grid](
        x, a, b, slots.contiguous(), out, in_features, out_features, float(scale), rank, block_in, block_out
    )
    return out
