"""The TTS distillation loss (paper, section 4.1): the reference and the distiller's entry point.

    L(q) = sum_k w_k KL(p_k || q_k) + lambda * sum_k w_k KL(q_t,k || q_k)

p_k is the target's distribution at canvas position k, q_k the drafter being trained, q_t,k the
drafter as it was before this update (no gradient). Normalisation: the weighted KL is *summed*
over the (masked) positions of a chain, as in the paper, and *averaged over the B chains* of the
batch, so the learning rate means the same thing at batch 1 and batch B. A chain with no valid
position still counts in B (it simply contributes 0).

Note on lambda: with one optimizer step per update the regulariser's gradient is exactly zero
(the step is taken at q = q_t, where KL(q_t || q) is minimal), so it only matters for
steps_per_update > 1; the Distiller skips the extra drafter forward in that case.

`tts_loss` is the readable reference on materialised logits. `compute_loss` is the entry point
the distiller uses: "naive" materialises the [B, C, V] logits; every other backend name hands the
hidden states and the LM head to `sglang_tts.kernels.fused_linear_kl`, which never materialises
them and is the one place a kernel backend ("auto" included) is chosen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sglang_tts.kernels import fused_linear_kl


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable: KL term + lambda * regulariser
    kl_teacher: torch.Tensor  # scalar, detached: sum_k w_k KL(p || q), same normalisation as loss
    kl_reg: torch.Tensor  # scalar, detached: sum_k w_k KL(q_t || q), *not* multiplied by lambda
    num_positions: int  # positions that entered the loss (mask True)


def eagle3_weights(length: int) -> torch.Tensor:
    """EAGLE-3's step weights w_k = 0.8^(k-1), k = 1..length (official and SpecForge recipes)."""
    return 0.8 ** torch.arange(length, dtype=torch.float32)


def dflash_weights(length: int, gamma: float = 7.0) -> torch.Tensor:
    """DFlash's block weights w_k = exp(-(k-1)/gamma), k = 1..length (gamma = 7 for block 16)."""
    return torch.exp(-torch.arange(length, dtype=torch.float32) / gamma)


def position_weight_matrix(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Weights [C] or [B, C] -> [B, C] float, zero where mask is False."""
    batch, length = mask.shape
    if weights.dim() == 1:
        if weights.shape[0] != length:
            raise ValueError(f"position weights have length {weights.shape[0]}, canvas length is {length}")
        weights = weights.unsqueeze(0).expand(batch, length)
    elif weights.shape != (batch, length):
        raise ValueError(f"position weights {tuple(weights.shape)} do not match mask {(batch, length)}")
    return torch.where(mask, weights.to(device=mask.device, dtype=torch.float32), 0.0)


def _kl_rows(probs: torch.Tensor, log_probs: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(a || q) over the last dim, with 0 * log 0 = 0 where a is exactly zero (top-k teachers)."""
    # torch.where rather than a product: 0 * (-inf) would be NaN, and its gradient too.
    support = probs > 0
    terms = torch.where(support, probs * (log_probs - log_q), 0.0)
    return terms.sum(-1)


def tts_loss(
    student_logits: torch.Tensor,
    teacher_probs: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    prev_logits: torch.Tensor | None = None,
    reg_lambda: float = 0.0,
) -> LossOutput:
    """Reference TTS loss on materialised logits [B, C, V]; see the module docstring."""
    if student_logits.shape != teacher_probs.shape:
        raise ValueError(f"student {tuple(student_logits.shape)} vs teacher {tuple(teacher_probs.shape)}")
    batch = student_logits.shape[0]
    w = position_weight_matrix(weights, mask)
    compute_dtype = torch.promote_types(student_logits.dtype, torch.float32)  # fp32, or fp64 in gradcheck
    log_q = F.log_softmax(student_logits.to(compute_dtype), dim=-1)

    # Masked positions may hold garbage (even NaN) teacher rows: zero them so they cannot leak in.
    p = torch.where(mask.unsqueeze(-1), teacher_probs.to(compute_dtype), 0.0)
    log_p = torch.log(p.clamp_min(torch.finfo(compute_dtype).tiny))
    kl_teacher_rows = _kl_rows(p, log_p, log_q)
    kl_teacher = (w.to(compute_dtype) * kl_teacher_rows).sum() / batch
    loss = kl_teacher

    kl_reg = torch.zeros((), dtype=compute_dtype, device=student_logits.device)
    if prev_logits is not None and reg_lambda > 0.0:
        log_qt = F.log_softmax(prev_logits.detach().to(compute_dtype), dim=-1)
        kl_reg_rows = _kl_rows(log_qt.exp(), log_qt, log_q)
        kl_reg = (w.to(compute_dtype) * kl_reg_rows).sum() / batch
        loss = loss + reg_lambda * kl_reg

    return LossOutput(loss, kl_teacher.detach(), kl_reg.detach(), int(mask.sum()))


# --- the entry point ----------------------------------------------------------------------------


def compute_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    teacher_probs: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    prev_logits: torch.Tensor | None = None,
    reg_lambda: float = 0.0,
    backend: str = "naive",
) -> LossOutput:
    """TTS loss from final hidden states [B, C, H] and the LM head [V, H].

    "naive" materialises the logits and uses `tts_loss` (the only path that reports the two KL
    terms apart). Every other name ("auto", "chunked", "triton") goes to
    `sglang_tts.kernels.fused_linear_kl`, the one place a kernel backend is chosen and validated,
    on the masked positions only, with the per-position weights pre-divided by B (the same
    normalisation as `tts_loss`).
    """
    if backend == "naive":
        logits = hidden @ lm_head_weight.t()
        return tts_loss(logits, teacher_probs, weights, mask, prev_logits, reg_lambda)
    batch, length, width = hidden.shape
    # Only the masked positions reach the kernel: the others carry zero weight, and a stride's
    # stacked rounds are mostly padding. One host read of the row list (the update's thread).
    rows = mask.reshape(-1).nonzero().squeeze(1).to(hidden.device)
    w = (position_weight_matrix(weights, mask) / batch).reshape(-1).index_select(0, rows)
    prev_probs = None
    if prev_logits is not None and reg_lambda > 0.0:
        prev_rows = prev_logits.detach().reshape(batch * length, -1).index_select(0, rows)
        prev_probs = torch.softmax(prev_rows.float(), dim=-1)
    p = teacher_probs.reshape(batch * length, -1).index_select(0, rows)
    loss = fused_linear_kl(
        hidden.reshape(batch * length, width).index_select(0, rows),
        lm_head_weight,
        p,
        w,
        prev_probs=prev_probs,
        reg_lambda=reg_lambda,
        backend=backend,
    )
    # The fused kernels return the total only; without the regulariser it is the KL term.
    nan = torch.full((), math.nan, device=hidden.device)
    kl_teacher = loss.detach() if prev_probs is None else nan
    return LossOutput(loss, kl_teacher, nan, int(rows.numel()))
