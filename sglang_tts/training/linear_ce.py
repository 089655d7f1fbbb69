"""Weighted cross-entropy through a frozen LM head, without a fresh [N, V] tensor per step.

DFlash trains against the target's own LM head (151,936 x 896 for Qwen2.5-Coder-0.5B, frozen): the
plain way, ``F.cross_entropy(hidden @ W.T, labels)``, allocates the logits, their log-softmax and
their gradient, each [N, V] (545 MB for N = 896), every step. On CPU those allocations are fresh
pages each time (glibc maps blocks this large directly), and zeroing and faulting them in cost about
a third of a training step in the kernel. Here one buffer, kept across steps, holds the logits, is
turned into the softmax in place and then into the gradient of the loss with respect to the logits;
the gradient with respect to ``hidden`` is computed in the forward pass (the loss is the end of the
graph: Liger-Kernel's fused linear cross-entropy does the same on GPU). The weight gets no gradient.

    loss = sum_i w_i * (logsumexp(h_i W^T) - (h_i W^T)[y_i]) / sum_i w_i

`linear_cross_entropy_reference` is the plain PyTorch version; the tests hold the two equal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_cross_entropy_reference(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, per-row cross-entropy [N] (detached), per-row argmax [N]) the plain way."""
    logits = hidden @ weight.T
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (weights * ce).sum() / weights.sum(), ce.detach(), logits.detach().argmax(-1)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, buffer):  # type: ignore[override]
        # hidden [N, D], weight [V, D] (no grad), labels [N] int64, weights [N], buffer [N, V] (scratch)
        logits = torch.mm(hidden, weight.T, out=buffer)
        label_logit = logits.gather(1, labels[:, None]).squeeze(1)
        top = logits.max(1, keepdim=True)
        pred = top.indices.squeeze(1)
        probs = logits.sub_(top.values).exp_()  # in place: the buffer now holds exp(logit - max)
        total = probs.sum(1, keepdim=True)
        ce = top.values.squeeze(1) + total.squeeze(1).log() - label_logit
        scale = weights / weights.sum()
        loss = (scale * ce).sum()
        if ctx.needs_input_grad[0]:
            # d loss / d logits = scale_i * (softmax_i - onehot(y_i)), in place; then through the head.
            probs.mul_(scale[:, None] / total)
            rows = torch.arange(probs.shape[0], device=probs.device)
            probs[rows, labels] -= scale
            ctx.save_for_backward(torch.mm(probs, weight))  # [N, D]
        ctx.mark_non_differentiable(ce, pred)
        return loss, ce, pred

    @staticmethod
    def backward(ctx, grad_loss, _ce, _pred):  # type: ignore[override]
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_loss, None, None, None, None


class LinearCrossEntropy:
    """``loss, ce, argmax = LinearCrossEntropy()(hidden, weight, labels, weights)``: the weighted mean
    cross-entropy of softmax(hidden @ weight.T) against labels, with the per-row cross-entropy and argmax
    (for metrics). Owns its scratch buffer (grown to the largest N seen, reused after): one instance per
    objective. The weight must be frozen (a borrowed target LM head)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def _scratch(self, rows: int, like: torch.Tensor, vocab: int) -> torch.Tensor:
        buf = self._buffer
        if buf is None or buf.shape[0] < rows or buf.shape[1] != vocab or buf.dtype != like.dtype:
            buf = self._buffer = torch.empty(rows, vocab, dtype=like.dtype, device=like.device)
        return buf[:rows]

    def __call__(
        self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # hidden [N, D], weight [V, D], labels [N], weights [N]
        if weight.requires_grad:
            raise ValueError("LinearCrossEntropy computes no gradient for the weight: pass a frozen (detached) one")
        buffer = self._scratch(hidden.shape[0], hidden, weight.shape[0])
        return _LinearCrossEntropy.apply(hidden, weight, labels, weights.to(hidden.dtype), buffer)
