"""Gather the target model's distribution onto the EAGLE-3 draft vocabulary (PyTorch reference + Triton kernel).

EAGLE-3 drafters predict over a reduced vocabulary of ``Vd`` tokens. Draft id ``i`` stands for target id
``i + d2t[i]``; ``t2d[j]`` tells whether target id ``j`` has a draft id. The TTS update needs, per position,

* the target distribution restricted to those ``Vd`` ids and renormalised (the teacher ``p`` of the KL loss);
* ``mask = t2d[argmax target]``: whether the target's greedy token is expressible by the drafter at all.

From logits the renormalised restriction is simply a softmax over the gathered logits (the full-vocabulary
normaliser cancels), so neither backend ever builds the ``[N, Vt]`` probabilities. A row without mass on the draft
vocabulary (all gathered probabilities zero, or all gathered logits ``-inf``) comes back as zeros, not NaN, so
that multiplying it by a zero position weight stays zero.

The Triton kernel uses one program per row: an online argmax over the target row, then two sweeps over the
draft ids (online max/sum, then normalised writes) reading the target row through the ``d2t`` offsets.
``import triton`` is guarded so the PyTorch path works without Triton.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # PyTorch-only install: gather_draft_probs_triton raises a clear error instead
    triton = None

__all__ = ["gather_draft_probs_torch", "gather_draft_probs_triton", "target_to_draft_mask"]

# Vocabulary elements per loop step of the Triton kernel (target sweep and draft sweeps).
MAX_BLOCK_SIZE = 8192


def target_to_draft_mask(d2t: Tensor, target_vocab_size: int) -> Tensor:
    """``t2d`` as a bool ``[Vt]`` tensor: True where a target id is reachable from some draft id."""
    ids = _draft_to_target_ids(d2t)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool, device=d2t.device)
    t2d[ids] = True
    return t2d


def _draft_to_target_ids(d2t: Tensor) -> Tensor:
    return torch.arange(d2t.shape[0], device=d2t.device, dtype=torch.long) + d2t.long()


def _check_inputs(target: Tensor, d2t: Tensor, t2d: Tensor | None) -> Tensor:
    if target.dim() != 2:
        raise ValueError(f"target must be [N, Vt], got {tuple(target.shape)}")
    if d2t.dim() != 1:
        raise ValueError(f"d2t must be [Vd], got {tuple(d2t.shape)}")
    if t2d is None:
        return target_to_draft_mask(d2t, target.shape[1])
    if tuple(t2d.shape) != (target.shape[1],):
        raise ValueError(f"t2d must be [Vt]=({target.shape[1]},), got {tuple(t2d.shape)}")
    return t2d.bool()


def gather_draft_probs_torch(
    target: Tensor, d2t: Tensor, t2d: Tensor | None = None, input_is_logits: bool = True
) -> tuple[Tensor, Tensor]:
    """Reference: ``(draft_probs [N, Vd] float32, mask [N] bool)``; see the module docstring."""
    t2d = _check_inputs(target, d2t, t2d)
    gathered = target[:, _draft_to_target_ids(d2t)].float()
    if input_is_logits:
        row_max = gathered.amax(dim=-1, keepdim=True)
        has_mass = torch.isfinite(row_max)
        # Shift by 0 on rows that are all -inf so that exp gives 0 instead of exp(-inf - -inf) = NaN.
        unnorm = torch.exp(gathered - torch.where(has_mass, row_max, torch.zeros_like(row_max)))
    else:
        unnorm = gathered
    total = unnorm.sum(dim=-1, keepdim=True)
    probs = torch.where(total > 0, unnorm / torch.where(total > 0, total, torch.ones_like(total)), 0.0)
    mask = t2d[target.argmax(dim=-1)]
    return probs, mask


if triton is not None:

    @triton.jit
    def _gather_draft_kernel(
        target_ptr,
        target_row_stride,
        d2t_ptr,
        t2d_ptr,
        out_ptr,
        out_row_stride,
        mask_ptr,
        n_target,
        n_draft,
        IS_LOGITS: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        t_row = target_ptr + row * target_row_stride
        o_row = out_ptr + row * out_row_stride

        # Online argmax over the target row; strict '>' across blocks keeps the first maximum, like torch.argmax.
        best_val = float("-inf")
        best_idx = 0
        for start in range(0, n_target, BLOCK_T):
            offs = start + tl.arange(0, BLOCK_T)
            x = tl.load(t_row + offs, mask=offs < n_target, other=float("-inf")).to(tl.float32)
            blk_val = tl.max(x, axis=0)
            blk_idx = tl.argmax(x, axis=0) + start
            take = blk_val > best_val
            best_idx = tl.where(take, blk_idx, best_idx)
            best_val = tl.where(take, blk_val, best_val)
        tl.store(mask_ptr + row, tl.load(t2d_ptr + best_idx))

        # Sweep 1 over draft ids: normaliser (online max + rescaled sum for logits, plain sum for probabilities).
        run_max = float("-inf")
        run_sum = 0.0
        for start in range(0, n_draft, BLOCK_D):
            offs = start + tl.arange(0, BLOCK_D)
            dmask = offs < n_draft
            ids = offs + tl.load(d2t_ptr + offs, mask=dmask, other=0)
            if IS_LOGITS:
                x = tl.load(t_row + ids, mask=dmask, other=float("-inf")).to(tl.float32)
                new_max = tl.maximum(run_max, tl.max(x, axis=0))
                # Reference point 0 while everything seen is -inf, so no -inf - -inf = NaN appears.
                ref = tl.where(new_max == float("-inf"), 0.0, new_max)
                run_sum = run_sum * tl.exp(run_max - ref) + tl.sum(tl.exp(x - ref), axis=0)
                run_max = new_max
            else:
                run_sum += tl.sum(tl.load(t_row + ids, mask=dmask, other=0.0).to(tl.float32), axis=0)

        # Rows without mass get scale 0 -> all-zero output.
        scale = tl.where(run_sum > 0.0, 1.0 / tl.where(run_sum > 0.0, run_sum, 1.0), 0.0)
        if IS_LOGITS:
            shift = tl.where(run_max == float("-inf"), 0.0, run_max)

        # Sweep 2: write the renormalised probabilities.
        for start in range(0, n_draft, BLOCK_D):
            offs = start + tl.arange(0, BLOCK_D)
            dmask = offs < n_draft
            ids = offs + tl.load(d2t_ptr + offs, mask=dmask, other=0)
            if IS_LOGITS:
                x = tl.load(t_row + ids, mask=dmask, other=float("-inf")).to(tl.float32)
                val = tl.exp(x - shift) * scale
            else:
                val = tl.load(t_row + ids, mask=dmask, other=0.0).to(tl.float32) * scale
            tl.store(o_row + offs, val, mask=dmask)


def gather_draft_probs_triton(
    target: Tensor,
    d2t: Tensor,
    t2d: Tensor | None = None,
    input_is_logits: bool = True,
    block_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Triton version of :func:`gather_draft_probs_torch` (same result).

    ``block_size`` (a power of two) overrides both loop block sizes; tests use small values to exercise tails.
    """
    if triton is None:
        raise RuntimeError("gather_draft_probs_triton needs the triton package")
    t2d = _check_inputs(target, d2t, t2d)
    n_rows, n_target = target.shape
    n_draft = d2t.shape[0]
    if target.stride(1) != 1:
        target = target.contiguous()
    probs = torch.empty(n_rows, n_draft, dtype=torch.float32, device=target.device)
    mask = torch.empty(n_rows, dtype=torch.bool, device=target.device)
    if n_rows == 0:
        return probs, mask
    block_t = block_size or min(MAX_BLOCK_SIZE, triton.next_power_of_2(n_target))
    block_d = block_size or min(MAX_BLOCK_SIZE, triton.next_power_of_2(n_draft))
    # bool tensors travel as uint8 views (same bytes), the most portable pointer type for Triton.
    _gather_draft_kernel[(n_rows,)](
        target,
        target.stride(0),
        d2t.contiguous(),
        t2d.contiguous().view(torch.uint8),
        probs,
        probs.stride(0),
        mask.view(torch.uint8),
        n_target,
        n_draft,
        IS_LOGITS=input_is_logits,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        num_warps=8 if max(block_t, block_d) >= 4096 else 4,
    )
    return probs, mask
