"""Chunked and Triton (interpreter) linear-KL backends against the naive autograd reference."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from sglang_tts.kernels import ChunkedLinearKL, chunked_linear_kl, fused_linear_kl, naive_linear_kl
from sglang_tts.kernels.chunked import plan_chunks
from sglang_tts.kernels.triton_linear_kl import triton_linear_kl

LossFn = Callable[..., Tensor]


def make_inputs(
    n: int, h: int, v: int, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Random problem with the awkward cases built in: exact zeros in p, zero-weight rows, a one-hot teacher."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen) * 0.5
    weight = torch.randn(v, h, generator=gen) * 0.5
    teacher = torch.softmax(torch.randn(n, v, generator=gen) * 3.0, dim=-1)
    teacher[teacher < 1.0 / v] = 0.0  # roughly half the entries become exact zeros
    teacher[0] = 0.0
    teacher[0, v - 1] = 1.0  # one-hot on the last id, which sits in the masked tail block
    teacher = teacher / teacher.sum(-1, keepdim=True)
    prev = torch.softmax(torch.randn(n, v, generator=gen), dim=-1)
    weights = torch.rand(n, generator=gen) + 0.1
    weights[1::3] = 0.0
    return hidden.to(dtype), weight.to(dtype), teacher, weights, prev


def loss_and_grads(
    fn: LossFn, hidden: Tensor, weight: Tensor, *args: object, grad_scale: float = 1.0, **kwargs: object
) -> tuple[Tensor, Tensor, Tensor]:
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss = fn(h, w, *args, **kwargs)
    (loss * grad_scale).backward()
    return loss.detach(), h.grad, w.grad


def assert_matches(out: tuple[Tensor, ...], ref: tuple[Tensor, ...], rel: float = 1e-5) -> None:
    """Loss, dL/dh and dL/dW agree to ``rel`` relative to each reference tensor's largest magnitude."""
    for name, got, want in zip(("loss", "grad_hidden", "grad_weight"), out, ref, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=rel, atol=rel * scale, msg=lambda m, n=name: f"{n}: {m}")


def test_interpreter_is_on() -> None:
    # The Triton tests below are only meaningful if the kernels run through the interpreter on CPU.
    assert os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("reg_lambda", [0.0, 0.7])
@pytest.mark.parametrize(
    ("n", "h", "v", "chunk_size", "vocab_chunk_size"),
    [
        (7, 16, 301, None, None),  # one chunk
        (13, 24, 301, 4, None),  # ragged position chunks
        (13, 24, 301, 5, 64),  # both chunked, ragged vocabulary blocks
        (6, 8, 1000, 6, 999),  # vocabulary chunk one short of V
    ],
)
def test_chunked_matches_naive(
    n: int, h: int, v: int, chunk_size: int | None, vocab_chunk_size: int | None, reg_lambda: float
) -> None:
    hidden, weight, teacher, weights, prev = make_inputs(n, h, v, seed=n + v)
    ref = loss_and_grads(naive_linear_kl, hidden, weight, teacher, weights, prev, reg_lambda, grad_scale=1.5)
    out = loss_and_grads(
        chunked_linear_kl,
        hidden,
        weight,
        teacher,
        weights,
        prev,
        reg_lambda,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        grad_scale=1.5,
    )
    assert_matches(out, ref)


def test_plan_chunks() -> None:
    budget = 1 << 20
    assert plan_chunks(16, 32000, budget_elements=budget) == (16, 32000)  # fits: one block
    assert plan_chunks(64, 49152, budget_elements=budget) == (64, 16384)  # vocabulary blocks over all positions
    assert plan_chunks(4096, 49152, budget_elements=budget) == (512, 2048)  # narrowest block, position chunks
    assert plan_chunks(64, 49152, chunk_size=8, budget_elements=budget) == (8, 49152)  # Liger-style on request
    assert plan_chunks(64, 100, vocab_chunk_size=1000) == (64, 100)
    with pytest.raises(ValueError, match="positive"):
        plan_chunks(4, 10, chunk_size=0)


@pytest.mark.parametrize("reg_lambda", [0.0, 0.7])
@pytest.mark.parametrize(
    ("n", "h", "v", "chunk_size", "block_size"),
    [
        (5, 16, 100, None, 32),  # V = 3*32 + 4: ragged tail block
        (9, 24, 257, 4, 64),  # ragged tail and ragged position chunks
        (4, 8, 128, None, 128),  # V exactly one block
        (3, 8, 77, None, None),  # default block size (next power of two)
    ],
)
def test_triton_matches_naive(
    n: int, h: int, v: int, chunk_size: int | None, block_size: int | None, reg_lambda: float
) -> None:
    hidden, weight, teacher, weights, prev = make_inputs(n, h, v, seed=3 * n + v)
    ref = loss_and_grads(naive_linear_kl, hidden, weight, teacher, weights, prev, reg_lambda, grad_scale=0.5)
    out = loss_and_grads(
        triton_linear_kl,
        hidden,
        weight,
        teacher,
        weights,
        prev,
        reg_lambda,
        chunk_size=chunk_size,
        block_size=block_size,
        grad_scale=0.5,
    )
    assert_matches(out, ref)


@pytest.mark.parametrize("fn", [chunked_linear_kl, triton_linear_kl], ids=["chunked", "triton"])
def test_zero_weights_give_zero_loss_and_grads(fn: LossFn) -> None:
    hidden, weight, teacher, _, prev = make_inputs(4, 8, 50)
    loss, grad_h, grad_w = loss_and_grads(fn, hidden, weight, teacher, torch.zeros(4), prev, 0.5)
    assert loss.item() == 0.0
    assert torch.count_nonzero(grad_h) == 0 and torch.count_nonzero(grad_w) == 0


@pytest.mark.parametrize("fn", [chunked_linear_kl, triton_linear_kl], ids=["chunked", "triton"])
def test_loss_is_zero_when_drafter_equals_teacher(fn: LossFn) -> None:
    # KL(q || q) = 0 with a vanishing gradient: catches sign or normalisation slips the comparisons could share.
    hidden, weight, _, weights, _ = make_inputs(5, 8, 40)
    teacher = torch.softmax(hidden @ weight.t(), dim=-1)
    loss, grad_h, grad_w = loss_and_grads(fn, hidden, weight, teacher, weights)
    assert abs(loss.item()) < 1e-5
    assert grad_h.abs().max() < 1e-5 and grad_w.abs().max() < 1e-5


def test_prev_probs_ignored_without_lambda() -> None:
    hidden, weight, teacher, weights, prev = make_inputs(6, 8, 64)
    with_prev = loss_and_grads(triton_linear_kl, hidden, weight, teacher, weights, prev, 0.0, block_size=16)
    without = loss_and_grads(naive_linear_kl, hidden, weight, teacher, weights)
    assert_matches(with_prev, without)


def test_only_requested_grads_are_computed() -> None:
    hidden, weight, teacher, weights, _ = make_inputs(6, 8, 64)
    w = weight.clone().requires_grad_()
    chunked_linear_kl(hidden, w, teacher, weights).backward()  # hidden does not require grad
    ref_w = loss_and_grads(naive_linear_kl, hidden, weight, teacher, weights)[2]
    torch.testing.assert_close(w.grad, ref_w, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        loss = chunked_linear_kl(hidden, w, teacher, weights, vocab_chunk_size=16)
    torch.testing.assert_close(loss, naive_linear_kl(hidden, weight, teacher, weights), rtol=1e-5, atol=1e-6)


def test_second_backward_raises_instead_of_double_scaling() -> None:
    hidden, weight, teacher, weights, _ = make_inputs(3, 8, 32)
    h = hidden.clone().requires_grad_()
    loss = ChunkedLinearKL.apply(h, weight, teacher, weights, None, 0.0, None, None)
    (2.0 * loss).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already consumed"):
        loss.backward()


def test_bfloat16_chunked_close_to_naive() -> None:
    # Low-precision inputs take the casting branches (bf16 matmuls, float32 accumulation).
    hidden, weight, teacher, weights, prev = make_inputs(6, 16, 200, dtype=torch.bfloat16)
    ref = loss_and_grads(naive_linear_kl, hidden, weight, teacher, weights, prev, 0.3)
    out = loss_and_grads(chunked_linear_kl, hidden, weight, teacher, weights, prev, 0.3, chunk_size=4)
    assert out[1].dtype == torch.bfloat16 and out[2].dtype == torch.bfloat16
    assert_matches(out, ref, rel=3e-2)


@pytest.mark.parametrize("backend", ["auto", "naive", "chunked", "triton"])
def test_dispatch(backend: str) -> None:
    hidden, weight, teacher, weights, prev = make_inputs(5, 8, 70)
    ref = loss_and_grads(naive_linear_kl, hidden, weight, teacher, weights, prev, 0.2)
    out = loss_and_grads(fused_linear_kl, hidden, weight, teacher, weights, prev, 0.2, backend=backend, chunk_size=2)
    assert_matches(out, ref)


def test_input_validation() -> None:
    hidden, weight, teacher, weights, prev = make_inputs(4, 8, 30)
    with pytest.raises(ValueError, match="unknown backend"):
        fused_linear_kl(hidden, weight, teacher, weights, backend="cuda")
    with pytest.raises(ValueError, match="teacher_probs"):
        chunked_linear_kl(hidden, weight, teacher[:, :-1], weights)
    with pytest.raises(ValueError, match="prev_probs"):
        naive_linear_kl(hidden, weight, teacher, weights, None, 0.5)
    with pytest.raises(ValueError, match="hidden size"):
        triton_linear_kl(hidden[:, :-1], weight, teacher, weights)
