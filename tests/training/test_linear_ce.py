"""The fused LM-head cross-entropy equals the plain one: loss, per-row values, picks and gradients."""

from __future__ import annotations

import pytest
import torch

from sglang_tts.training.linear_ce import LinearCrossEntropy, linear_cross_entropy_reference


def _case(rows: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, 16, generator=gen) * 3
    weight = torch.randn(300, 16, generator=gen)
    labels = torch.randint(0, 300, (rows,), generator=gen)
    weights = torch.rand(rows, generator=gen) + 0.1
    return hidden, weight, labels, weights


def test_loss_values_picks_and_gradient_equal_the_plain_cross_entropy():
    fused = LinearCrossEntropy()
    for rows, seed in ((7, 0), (23, 1), (5, 2)):  # grows, then shrinks: the buffer is reused
        hidden, weight, labels, weights = _case(rows, seed)
        mine = hidden.clone().requires_grad_(True)
        ref = hidden.clone().requires_grad_(True)
        loss, ce, picks = fused(mine, weight, labels, weights)
        want_loss, want_ce, want_picks = linear_cross_entropy_reference(ref, weight, labels, weights)
        (2.5 * loss).backward()
        (2.5 * want_loss).backward()
        torch.testing.assert_close(loss, want_loss)
        torch.testing.assert_close(ce, want_ce)
        assert torch.equal(picks, want_picks)
        torch.testing.assert_close(mine.grad, ref.grad)
        assert not ce.requires_grad and not picks.requires_grad
    assert fused._buffer.shape == (23, 300)  # kept at the largest size seen, not reallocated per call


def test_without_grad_it_only_measures_and_a_trainable_weight_is_refused():
    hidden, weight, labels, weights = _case(9)
    with torch.no_grad():
        loss, ce, picks = LinearCrossEntropy()(hidden, weight, labels, weights)
    want = linear_cross_entropy_reference(hidden, weight, labels, weights)
    torch.testing.assert_close(loss, want[0])
    assert torch.equal(picks, want[2])
    with pytest.raises(ValueError, match="frozen"):
        LinearCrossEntropy()(hidden, weight.requires_grad_(True), labels, weights)
