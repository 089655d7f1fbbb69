"""The loss backends agree: the chunked path (CPU default) gives the naive loss and gradients."""

from __future__ import annotations

import torch

from sglang_tts.core.loss import compute_loss
from sglang_tts.kernels import resolve_backend


def _inputs(seed: int = 0, b: int = 2, c: int = 4, h: int = 16, v: int = 300):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, c, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    teacher = torch.softmax(torch.randn(b, c, v, generator=g) * 3, dim=-1)
    teacher[0, 1] = float("nan")  # a masked row may hold anything
    mask = torch.ones(b, c, dtype=torch.bool)
    mask[0, 1] = False
    mask[1, 3] = False
    weights = 0.8 ** torch.arange(c, dtype=torch.float32)
    return hidden, weight, teacher, weights, mask


def test_chunked_matches_naive_in_loss_and_gradients():
    results = {}
    for backend in ("naive", "chunked"):
        hidden, weight, teacher, weights, mask = _inputs()
        out = compute_loss(hidden, weight, teacher, weights, mask, backend=backend)
        out.loss.backward()
        results[backend] = (out.loss.detach(), out.kl_teacher, hidden.grad, weight.grad)
    naive, chunked = results["naive"], results["chunked"]
    assert torch.isfinite(naive[0]) and naive[0] > 0
    for a, b in zip(naive, chunked):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_auto_backend_is_chunked_on_cpu():
    cpu_tensor = torch.zeros(1)
    assert resolve_backend("auto", cpu_tensor, fallback="chunked") == "chunked"
    assert resolve_backend("naive", cpu_tensor, fallback="chunked") == "naive"
