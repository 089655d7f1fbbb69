"""Deferred weight gradients: one matmul per weight for a drafter applied several times in one graph.

EAGLE-3's training forward unrolls the drafter over the canvas (one draft step per position, each
reading the previous step's hidden state), so every linear layer is applied once per position.
Autograd computes each application's weight gradient on its own, ``g_k^T x_k``, a tensor the size of
the weight, and adds it to the ones before: for a 4-position canvas four weight-sized outer products
and three weight-sized read-modify-writes per layer. At a verify round's handful of rows that memory
traffic, not arithmetic, is most of an update's backward (the Qwen drafter: 28 weight gradients of up
to 4.4M floats per update on CPU; see docs/update-cost.md).

`Linear` (an ``nn.Linear``, the drafters' own) defers: inside ``deferred_weight_grads(module)`` its
backward returns the input gradient only and records ``(g_k, x_k)``; ``WeightGradBank.flush()``
then writes each weight's gradient once, ``[g_1; ...; g_K]^T [x_1; ...; x_K]``, the same sum in one
matmul. Outside the context (serving, the guard's scoring, tests) the layer is a plain
``nn.Linear``. Bias gradients are small and stay autograd's. Nothing here syncs with the host, so
the side stream's update on CUDA runs it as it is.

Usage (core/distiller.py)::

    with deferred_weight_grads(drafter) as wgrad:
        loss = ...            # any number of applications of each Linear
        loss.backward()       # input gradients, and the (g, x) pairs recorded
        wgrad.flush()         # weight gradients written (accumulated into .grad as autograd would)

with one bank per trained drafter, kept across updates (its gradient buffers are reused).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class WeightGradBank:
    """The (output gradient, input) pairs recorded per weight since the last flush, and one gradient
    buffer per weight that flush() writes into.

    The buffers outlive the optimizer's ``zero_grad(set_to_none=True)``: the parameter lets go of its
    ``.grad`` (so an optimizer still skips a parameter that got no gradient, as per-request adapters
    need), and the next flush writes the same memory again. On CPU a fresh weight-sized tensor per
    update costs page faults (allocations that size are fresh mmaps): 3-5 ms per 4.4M-float weight,
    where writing into a buffer takes 0.5-1 ms (docs/update-cost.md). A bank that lives as long as the
    drafter it serves (the Distiller's) keeps them; its buffers are what autograd would hold as .grad
    during an update, nothing more."""

    def __init__(self) -> None:
        # id(weight) -> (weight, [g [N_k, out]], [x [N_k, in]])
        self._pending: dict[int, tuple[nn.Parameter, list[torch.Tensor], list[torch.Tensor]]] = {}
        self._buffers: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}  # id(weight) -> (weight, grad buffer)

    def record(self, weight: nn.Parameter, grad_output: torch.Tensor, inputs: torch.Tensor) -> None:
        """grad_output: [N, out]; inputs: [N, in] (rows of one application)."""
        entry = self._pending.setdefault(id(weight), (weight, [], []))
        entry[1].append(grad_output)
        entry[2].append(inputs)

    @property
    def num_pending(self) -> int:
        return sum(len(grads) for _, grads, _ in self._pending.values())

    def flush(self) -> None:
        """Write every recorded weight's gradient (added to .grad if it holds one), then forget them."""
        with torch.no_grad():
            for weight, grads, inputs in self._pending.values():
                g = grads[0] if len(grads) == 1 else torch.cat(grads)
                x = inputs[0] if len(inputs) == 1 else torch.cat(inputs)
                if weight.grad is None:
                    weight.grad = self._buffer(weight).zero_()
                weight.grad.addmm_(g.t().to(weight.dtype), x.to(weight.dtype))
        self._pending.clear()

    def _buffer(self, weight: nn.Parameter) -> torch.Tensor:
        held = self._buffers.get(id(weight))
        if held is None or held[0] is not weight or held[1].shape != weight.shape or held[1].dtype != weight.dtype:
            held = (weight, torch.empty_like(weight, memory_format=torch.contiguous_format))
            self._buffers[id(weight)] = held
        return held[1]

    def clear(self) -> None:
        """Forget what was recorded (an update that stopped before its flush); the buffers stay."""
        self._pending.clear()


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, bank: WeightGradBank) -> torch.Tensor:
        return F.linear(x, weight, bias)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        x, weight, bias, bank = inputs
        ctx.save_for_backward(x, weight)
        ctx.bank = bank
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        rows = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            ctx.bank.record(weight, rows, x.reshape(-1, x.shape[-1]))
        grad_bias = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias, None


class Linear(nn.Linear):
    """nn.Linear whose weight gradient can be deferred to a WeightGradBank (module docstring)."""

    wgrad: WeightGradBank | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bank = self.wgrad
        if bank is None or not torch.is_grad_enabled() or not self.weight.requires_grad:
            return F.linear(x, self.weight, self.bias)
        return _DeferredLinear.apply(x, self.weight, self.bias, bank)


@contextmanager
def deferred_weight_grads(module: nn.Module, bank: WeightGradBank | None = None) -> Iterator[WeightGradBank]:
    """Defer the weight gradients of `module`'s `Linear` layers to `bank` (a fresh one if None), yielded;
    call its flush() after backward. Leaving the context forgets whatever was not flushed (an update that
    stopped early). Pass the same bank every time to reuse its gradient buffers."""
    bank = WeightGradBank() if bank is None else bank
    layers = [m for m in module.modules() if isinstance(m, Linear)]
    for layer in layers:
        layer.wgrad = bank
    try:
        yield bank
    finally:
        for layer in layers:
            layer.wgrad = None
        bank.clear()
