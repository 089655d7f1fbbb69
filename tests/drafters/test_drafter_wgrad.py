"""Deferred weight gradients (sglang_tts/drafters/wgrad.py): the same gradients as autograd's, one matmul each."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from sglang_tts.drafters.wgrad import Linear, WeightGradBank, deferred_weight_grads


def _grads(
    drafter: nn.Module, loss_fn, deferred: bool, bank: WeightGradBank | None = None, records: bool = True
) -> dict[str, torch.Tensor]:
    drafter.zero_grad(set_to_none=True)
    if deferred:
        with deferred_weight_grads(drafter, bank) as wgrad:
            loss_fn(drafter).backward()
            assert (wgrad.num_pending > 0) == records
            wgrad.flush()
            assert wgrad.num_pending == 0
    else:
        loss_fn(drafter).backward()
    return {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def _assert_same(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def _eagle3_loss(canvas):
    weights = torch.randn(canvas.batch_size, canvas.length, generator=torch.Generator().manual_seed(3))

    def loss(drafter):
        return (drafter.canvas_logits(canvas).logsumexp(-1) * weights).sum()

    return loss


def test_eagle3_unroll_gets_autograds_gradients_with_one_record_per_application(eagle3, make_eagle3_inputs):
    drafter = copy.deepcopy(eagle3)
    canvas = make_eagle3_inputs(drafter, length=4)["canvas"]
    loss = _eagle3_loss(canvas)
    expected = _grads(drafter, loss, deferred=False)
    # Every weight of the layer is applied once per canvas position (4), fc once: all in the bank.
    bank = WeightGradBank()
    with deferred_weight_grads(drafter, bank):
        drafter.zero_grad(set_to_none=True)
        loss(drafter).backward()
        linears = [m for m in drafter.modules() if isinstance(m, Linear) and m is not drafter.lm_head]
        assert bank.num_pending == 4 * (len(linears) - 1) + 1
        # Deferred weights have no gradient until the flush; biases and norms have autograd's.
        assert all(m.weight.grad is None for m in linears)
        bank.flush()
    _assert_same(expected, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None})


def test_dflash_block_gets_autograds_gradients(dflash, make_dflash_canvas):
    drafter = copy.deepcopy(dflash)
    canvas = make_dflash_canvas(drafter)

    def loss(d):
        return d.canvas_logits(canvas).logsumexp(-1).sum()

    _assert_same(_grads(drafter, loss, deferred=False), _grads(drafter, loss, deferred=True))


def test_bank_reuses_its_buffers_and_does_not_accumulate_across_updates(eagle3, make_eagle3_inputs):
    drafter = copy.deepcopy(eagle3)
    canvases = [make_eagle3_inputs(drafter, seed=s)["canvas"] for s in (0, 1)]
    bank = WeightGradBank()
    first = _grads(drafter, _eagle3_loss(canvases[0]), deferred=True, bank=bank)
    pointers = {n: p.grad.data_ptr() for n, p in drafter.named_parameters() if p.grad is not None}
    second = _grads(drafter, _eagle3_loss(canvases[1]), deferred=True, bank=bank)
    # The deferred weights' gradients were written into the same memory...
    again = {n: p.grad.data_ptr() for n, p in drafter.named_parameters() if p.grad is not None}
    assert again["layers.0.mlp.gate_proj.weight"] == pointers["layers.0.mlp.gate_proj.weight"]
    assert again["fc.weight"] == pointers["fc.weight"]
    # ...and, with zero_grad(set_to_none=True) between them, the second update's gradients are its own.
    _assert_same(_grads(drafter, _eagle3_loss(canvases[1]), deferred=False), second)
    assert any(not torch.equal(first[n], second[n]) for n in first)


def test_flush_adds_to_a_gradient_already_there(eagle3, make_eagle3_inputs):
    drafter = copy.deepcopy(eagle3)
    loss = _eagle3_loss(make_eagle3_inputs(drafter)["canvas"])
    once = _grads(drafter, loss, deferred=False)
    drafter.zero_grad(set_to_none=True)
    loss(drafter).backward()  # autograd's gradient first, then a deferred one on top
    with deferred_weight_grads(drafter) as wgrad:
        loss(drafter).backward()
        wgrad.flush()
    _assert_same(
        {n: 2 * g for n, g in once.items()}, {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None}
    )


def test_outside_the_context_and_without_grad_it_is_a_plain_linear():
    layer = Linear(3, 2)
    x = torch.randn(4, 3, requires_grad=True)
    torch.testing.assert_close(layer(x), x @ layer.weight.t() + layer.bias)
    with deferred_weight_grads(layer) as wgrad:
        with torch.no_grad():
            layer(x)
        layer.weight.requires_grad_(False)
        layer(x).sum().backward()  # a frozen weight records nothing
        assert wgrad.num_pending == 0
        layer.weight.requires_grad_(True)
    assert layer.wgrad is None


def test_leaving_the_context_forgets_what_was_not_flushed():
    layer = Linear(3, 2, bias=False)
    bank = WeightGradBank()
    with pytest.raises(RuntimeError, match="stopped"):
        with deferred_weight_grads(layer, bank):
            layer(torch.randn(2, 3)).sum().backward()
            assert bank.num_pending == 1
            raise RuntimeError("update stopped")
    assert bank.num_pending == 0 and layer.weight.grad is None and layer.wgrad is None


def test_adapter_hooks_on_a_frozen_base_are_unaffected(eagle3, make_eagle3_inputs):
    """Per-request adapters hook the drafter's Linear layers; their base weights are frozen."""
    from sglang_tts.core.adapters import AdaptedDrafter

    drafter = AdaptedDrafter(copy.deepcopy(eagle3), num_slots=2, rank=4)
    canvas = make_eagle3_inputs(eagle3)["canvas"]
    canvas.slots = torch.tensor([0, 1])
    with torch.no_grad():
        for _, p in drafter.trainable_named_parameters():
            p.add_(0.01 * torch.randn_like(p))  # B starts at zero: give every factor a gradient

    def loss(d):
        return d.canvas_logits(canvas).logsumexp(-1).sum()

    _assert_same(_grads(drafter, loss, deferred=False), _grads(drafter, loss, deferred=True, records=False))
