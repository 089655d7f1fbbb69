"""Naive PyTorch reference for the TTS update loss (the ground truth for the chunked and Triton paths).

For every canvas position k the drafter's distribution is ``q_k = softmax(h_k @ W^T)`` and the loss is

    L = sum_k w_k KL(p_k || q_k) + lambda * sum_k w_k KL(r_k || q_k)

where ``p`` holds the target (teacher) probabilities and ``r`` the previous drafter's probabilities. The loss is
a plain sum over positions: the caller decides how to normalise it.

This implementation materialises the full ``[N, V]`` logits (plus several same-sized autograd intermediates) and
lets autograd produce the gradients. It is the simplest correct version, not a fast or frugal one.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["check_linear_kl_inputs", "naive_linear_kl"]


def check_linear_kl_inputs(
    hidden: Tensor,
    weight: Tensor,
    teacher_probs: Tensor,
    weights: Tensor,
    prev_probs: Tensor | None,
    reg_lambda: float,
) -> None:
    """Validate shapes shared by every backend; raise ``ValueError`` with a readable message otherwise."""
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden must be [N, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    n, h = hidden.shape
    v = weight.shape[0]
    if weight.shape[1] != h:
        raise ValueError(f"hidden size mismatch: hidden has H={h}, weight has H={weight.shape[1]}")
    if tuple(teacher_probs.shape) != (n, v):
        raise ValueError(f"teacher_probs must be [N, V]=({n}, {v}), got {tuple(teacher_probs.shape)}")
    if tuple(weights.shape) != (n,):
        raise ValueError(f"weights must be [N]=({n},), got {tuple(weights.shape)}")
    if reg_lambda != 0.0:
        if prev_probs is None:
            raise ValueError("reg_lambda != 0 needs prev_probs")
        if tuple(prev_probs.shape) != (n, v):
            raise ValueError(f"prev_probs must be [N, V]=({n}, {v}), got {tuple(prev_probs.shape)}")


def naive_linear_kl(
    hidden: Tensor,
    weight: Tensor,
    teacher_probs: Tensor,
    weights: Tensor,
    prev_probs: Tensor | None = None,
    reg_lambda: float = 0.0,
) -> Tensor:
    """Weighted ``sum_k w_k [KL(p_k||q_k) + lambda KL(r_k||q_k)]`` with ``q = softmax(hidden @ weight^T)``.

    Args:
        hidden: ``[N, H]`` drafter hidden states (usually requires grad).
        weight: ``[V, H]`` drafter LM-head weight (usually requires grad).
        teacher_probs: ``[N, V]`` target probabilities ``p``; exact zeros are fine.
        weights: ``[N]`` per-position weights ``w``; zeros switch a position off.
        prev_probs: ``[N, V]`` previous drafter probabilities ``r``; needed only when ``reg_lambda != 0``.
        reg_lambda: weight of the ``KL(r || q)`` regulariser.

    Returns:
        A float32 scalar (sum over positions). Gradients flow to ``hidden`` and ``weight`` through autograd.
    """
    check_linear_kl_inputs(hidden, weight, teacher_probs, weights, prev_probs, reg_lambda)
    # Work in float32 whatever the input dtype, like the fused paths do.
    logits = hidden.float() @ weight.float().t()
    log_q = torch.log_softmax(logits, dim=-1)
    w = weights.float()

    def weighted_kl(target: Tensor) -> Tensor:
        target = target.float()
        # xlogy gives 0 * log 0 = 0, so teacher probabilities with exact zeros contribute nothing.
        kl = torch.xlogy(target, target).sum(-1) - (target * log_q).sum(-1)
        return (w * kl).sum()

    loss = weighted_kl(teacher_probs)
    if reg_lambda != 0.0:
        assert prev_probs is not None  # checked above; keeps type checkers happy
        loss = loss + reg_lambda * weighted_kl(prev_probs)
    return loss
