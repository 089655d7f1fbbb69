"""The TTS loss: gradients, zeros where they must be, masking, and the backend dispatch."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_tts.core.loss import compute_loss, dflash_weights, eagle3_weights, tts_loss


def _top_k_probs(logits: torch.Tensor, k: int) -> torch.Tensor:
    """A teacher that is exactly zero outside its top-k, as a top-k-restricted target gives."""
    top = logits.topk(k, dim=-1)
    probs = torch.zeros_like(logits).scatter(-1, top.indices, torch.softmax(top.values, dim=-1))
    return probs


def _reference_kl(p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Per-row KL(p || q) written out with an explicit loop over the vocabulary (0 log 0 = 0)."""
    out = torch.zeros(p.shape[:-1], dtype=torch.float64)
    for v in range(p.shape[-1]):
        pv = p[..., v].double()
        out += torch.where(pv > 0, pv * (torch.log(pv.clamp_min(1e-300)) - log_q[..., v].double()), 0.0)
    return out


def test_position_weight_helpers():
    assert torch.allclose(eagle3_weights(4), torch.tensor([1.0, 0.8, 0.64, 0.512]))
    assert torch.allclose(dflash_weights(3, gamma=7.0), torch.tensor([1.0, math.exp(-1 / 7), math.exp(-2 / 7)]))
    assert dflash_weights(16).shape == (16,)


def test_loss_matches_written_out_formula(generator):
    b, c, v, lam = 3, 4, 11, 0.3
    student = torch.randn(b, c, v, generator=generator)
    prev = torch.randn(b, c, v, generator=generator)
    teacher = _top_k_probs(torch.randn(b, c, v, generator=generator), k=3)
    weights = torch.rand(c, generator=generator)
    mask = torch.rand(b, c, generator=generator) > 0.3
    out = tts_loss(student, teacher, weights, mask, prev, lam)

    log_q = torch.log_softmax(student.double(), -1)
    w = weights.double() * mask
    kl_teacher = (w * _reference_kl(teacher, log_q)).sum() / b
    kl_reg = (w * _reference_kl(torch.softmax(prev.double(), -1), log_q)).sum() / b
    assert out.kl_teacher.item() == pytest.approx(kl_teacher.item(), rel=1e-5)
    assert out.kl_reg.item() == pytest.approx(kl_reg.item(), rel=1e-5)
    assert out.loss.item() == pytest.approx((kl_teacher + lam * kl_reg).item(), rel=1e-5)
    assert out.num_positions == int(mask.sum())


def test_gradcheck_float64(generator):
    b, c, v = 2, 3, 5
    student = torch.randn(b, c, v, generator=generator, dtype=torch.float64, requires_grad=True)
    prev = torch.randn(b, c, v, generator=generator, dtype=torch.float64)
    teacher = _top_k_probs(torch.randn(b, c, v, generator=generator, dtype=torch.float64), k=2)
    weights = torch.rand(b, c, generator=generator, dtype=torch.float64) + 0.1
    mask = torch.tensor([[True, False, True], [True, True, True]])

    def fn(logits: torch.Tensor) -> torch.Tensor:
        return tts_loss(logits, teacher, weights, mask, prev, reg_lambda=0.7).loss

    assert torch.autograd.gradcheck(fn, (student,), eps=1e-6, atol=1e-7)


def test_zero_when_student_equals_teacher(generator):
    logits = torch.randn(2, 4, 9, generator=generator)
    out = tts_loss(logits, torch.softmax(logits, -1), eagle3_weights(4), torch.ones(2, 4, dtype=torch.bool))
    assert abs(out.loss.item()) < 1e-6


def test_regulariser_zero_at_first_step_positive_after(generator):
    logits = torch.randn(2, 4, 9, generator=generator, requires_grad=True)
    teacher = torch.softmax(torch.randn(2, 4, 9, generator=generator), -1)
    mask = torch.ones(2, 4, dtype=torch.bool)
    first = tts_loss(logits, teacher, eagle3_weights(4), mask, prev_logits=logits.detach(), reg_lambda=0.5)
    assert abs(first.kl_reg.item()) < 1e-6
    # Its gradient at q = q_t is zero too: the loss's gradient equals the teacher term's alone.
    (grad_with,) = torch.autograd.grad(first.loss, logits)
    (grad_without,) = torch.autograd.grad(tts_loss(logits, teacher, eagle3_weights(4), mask).loss, logits)
    assert torch.allclose(grad_with, grad_without, atol=1e-6)

    moved = logits.detach() + 0.5 * torch.randn(2, 4, 9, generator=generator)
    later = tts_loss(moved, teacher, eagle3_weights(4), mask, prev_logits=logits.detach(), reg_lambda=0.5)
    assert later.kl_reg.item() > 1e-3
    assert later.loss.item() == pytest.approx(later.kl_teacher.item() + 0.5 * later.kl_reg.item(), rel=1e-6)


def test_masked_and_zero_weight_positions_contribute_nothing(generator):
    b, c, v = 2, 4, 7
    student = torch.randn(b, c, v, generator=generator, requires_grad=True)
    teacher = torch.softmax(torch.randn(b, c, v, generator=generator), -1)
    mask = torch.ones(b, c, dtype=torch.bool)
    mask[0, 2] = False
    weights = torch.ones(b, c)
    weights[1, 3] = 0.0
    out = tts_loss(student, teacher, weights, mask)
    (grad,) = torch.autograd.grad(out.loss, student)
    assert torch.all(grad[0, 2] == 0) and torch.all(grad[1, 3] == 0)
    assert grad[0, 1].abs().sum() > 0

    # Garbage (NaN) teacher rows at masked positions do not leak into loss or gradient.
    poisoned = teacher.clone()
    poisoned[0, 2] = math.nan
    out2 = tts_loss(student, poisoned, weights, mask)
    (grad2,) = torch.autograd.grad(out2.loss, student)
    assert out2.loss.item() == pytest.approx(out.loss.item(), rel=1e-6)
    assert torch.isfinite(grad2).all()


def test_loss_is_batch_mean_of_chain_sums(generator):
    student = torch.randn(1, 3, 6, generator=generator)
    teacher = torch.softmax(torch.randn(1, 3, 6, generator=generator), -1)
    mask = torch.ones(1, 3, dtype=torch.bool)
    single = tts_loss(student, teacher, torch.ones(3), mask).loss
    doubled = tts_loss(student.repeat(2, 1, 1), teacher.repeat(2, 1, 1), torch.ones(3), mask.repeat(2, 1)).loss
    assert doubled.item() == pytest.approx(single.item(), rel=1e-6)


def test_weight_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="length"):
        tts_loss(torch.zeros(1, 3, 4), torch.full((1, 3, 4), 0.25), torch.ones(4), torch.ones(1, 3, dtype=torch.bool))


def _loss_inputs(generator: torch.Generator):
    hidden = torch.randn(2, 4, 8, generator=generator, requires_grad=True)
    head = torch.randn(10, 8, generator=generator, requires_grad=True)
    teacher = torch.softmax(torch.randn(2, 4, 10, generator=generator), -1)
    mask = torch.tensor([[True, True, False, True], [True, True, True, True]])
    prev = torch.randn(2, 4, 10, generator=generator)
    return hidden, head, teacher, eagle3_weights(4), mask, prev


def test_naive_backend_equals_reference_and_trains_head(generator):
    hidden, head, teacher, weights, mask, prev = _loss_inputs(generator)
    out = compute_loss(hidden, head, teacher, weights, mask, prev, 0.2, backend="naive")
    ref = tts_loss(hidden @ head.t(), teacher, weights, mask, prev, 0.2)
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-6)
    out.loss.backward()
    assert hidden.grad.abs().sum() > 0 and head.grad.abs().sum() > 0
    assert compute_loss(hidden, head, teacher, weights, mask, backend="auto").loss.item() > 0  # CPU -> chunked


def test_kernel_backends_are_chosen_by_the_kernels_dispatcher(generator):
    """The kernels package resolves "auto" (chunked on CPU) and refuses unknown backend names."""
    hidden, head, teacher, weights, mask, prev = _loss_inputs(generator)
    auto = compute_loss(hidden, head, teacher, weights, mask, prev, 0.2, backend="auto").loss
    chunked = compute_loss(hidden, head, teacher, weights, mask, prev, 0.2, backend="chunked").loss
    assert auto.item() == chunked.item()
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        compute_loss(hidden, head, teacher, weights, mask, backend="fast")


def test_chunked_backend_matches_reference_with_the_regulariser(generator):
    """The real fused path (sglang_tts.kernels, chunked PyTorch on CPU) gets the mask folded into the
    weights and the previous drafter's probabilities, and reproduces the reference loss."""
    hidden, head, teacher, weights, mask, prev = _loss_inputs(generator)
    fused = compute_loss(hidden, head, teacher, weights, mask, prev, 0.2, backend="chunked")
    ref = tts_loss(hidden @ head.t(), teacher, weights, mask, prev, 0.2)
    assert ref.kl_reg.item() > 0
    assert fused.loss.item() == pytest.approx(ref.loss.item(), rel=1e-5)
