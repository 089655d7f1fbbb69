"""Kernels for the TTS drafter update: fused linear + KL loss and target-to-draft probability gathering.

Public entry points pick a backend:

* ``naive``   - plain PyTorch, materialises ``[N, V]`` logits, autograd backward (reference only);
* ``chunked`` - PyTorch, chunked over positions (optionally vocabulary), gradients computed in the forward;
* ``triton``  - Triton kernels for the per-row softmax/KL/gradient maths, matmuls stay in PyTorch;
* ``auto``    - ``triton`` for CUDA tensors when Triton imports, else ``chunked`` (``torch`` for the gather).

Triton is imported lazily: ``triton_linear_kl`` (Triton only) is loaded on first use of the Triton backend and
``gather`` guards its ``import triton``, so this package imports, and the PyTorch backends work, without Triton.
Loading the kernel modules late also lets tests set ``TRITON_INTERPRET=1`` before any kernel is decorated.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache

from torch import Tensor

from .chunked import ChunkedLinearKL, chunked_linear_kl
from .reference import naive_linear_kl

__all__ = [
    "ChunkedLinearKL",
    "chunked_linear_kl",
    "fused_linear_kl",
    "gather_draft_probs",
    "naive_linear_kl",
    "resolve_backend",
    "triton_available",
]

_LINEAR_KL_BACKENDS = ("auto", "naive", "chunked", "triton")
_GATHER_BACKENDS = ("auto", "torch", "triton")


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when the ``triton`` package can be imported (it may still lack a GPU driver; see ``resolve_backend``)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except (ImportError, OSError, RuntimeError):  # a broken install (missing libs, ABI mismatch): not usable
        return False
    return True


def resolve_backend(backend: str, tensor: Tensor, fallback: str) -> str:
    """Map ``auto`` to ``triton`` for CUDA tensors with a usable Triton, else to ``fallback``."""
    if backend != "auto":
        return backend
    return "triton" if tensor.is_cuda and triton_available() else fallback


def fused_linear_kl(
    hidden: Tensor,
    weight: Tensor,
    teacher_probs: Tensor,
    weights: Tensor,
    prev_probs: Tensor | None = None,
    reg_lambda: float = 0.0,
    backend: str = "auto",
    chunk_size: int | None = None,
) -> Tensor:
    """TTS update loss ``sum_k w_k [KL(p_k || q_k) + lambda KL(r_k || q_k)]``, ``q_k = softmax(h_k W^T)``.

    Args:
        hidden: ``[N, H]`` drafter hidden states.
        weight: ``[V, H]`` drafter LM-head weight.
        teacher_probs: ``[N, V]`` target probabilities (rows summing to 1, or all zero to contribute nothing).
        weights: ``[N]`` per-position weights; zero disables a position.
        prev_probs: ``[N, V]`` previous drafter probabilities, used when ``reg_lambda != 0``.
        reg_lambda: weight of the ``KL(r || q)`` anchor term.
        backend: ``auto`` | ``naive`` | ``chunked`` | ``triton``.
        chunk_size: positions per chunk for ``chunked``/``triton`` (default: about 4 MiB of float32 logits).

    Returns:
        Float32 scalar: the sum over positions (normalise in the caller). Differentiable w.r.t. ``hidden`` and
        ``weight``; the targets and ``weights`` get no gradient.
    """
    if backend not in _LINEAR_KL_BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {_LINEAR_KL_BACKENDS}")
    backend = resolve_backend(backend, hidden, fallback="chunked")
    if backend == "naive":
        return naive_linear_kl(hidden, weight, teacher_probs, weights, prev_probs, reg_lambda)
    if backend == "chunked":
        return chunked_linear_kl(hidden, weight, teacher_probs, weights, prev_probs, reg_lambda, chunk_size)
    _require_triton()
    from .triton_linear_kl import triton_linear_kl

    return triton_linear_kl(hidden, weight, teacher_probs, weights, prev_probs, reg_lambda, chunk_size)


def gather_draft_probs(
    target: Tensor,
    d2t: Tensor,
    t2d: Tensor | None = None,
    input_is_logits: bool = True,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Target distribution restricted to the EAGLE-3 draft vocabulary, renormalised, plus a per-row mask.

    Args:
        target: ``[N, Vt]`` target logits (or probabilities with ``input_is_logits=False``).
        d2t: ``[Vd]`` integer offsets: draft id ``i`` is target id ``i + d2t[i]``.
        t2d: ``[Vt]`` bool, whether a target id is in the draft vocabulary; derived from ``d2t`` when omitted.
        input_is_logits: whether ``target`` holds logits (softmax applied) or probabilities.
        backend: ``auto`` | ``torch`` | ``triton``.

    Returns:
        ``(draft_probs [N, Vd] float32, mask [N] bool)``; ``mask[n] = t2d[argmax_v target[n, v]]``. A row with no
        probability mass on the draft vocabulary comes back all zeros (never NaN).
    """
    if backend not in _GATHER_BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {_GATHER_BACKENDS}")
    backend = resolve_backend(backend, target, fallback="torch")
    from . import gather

    if backend == "torch":
        return gather.gather_draft_probs_torch(target, d2t, t2d, input_is_logits)
    _require_triton()
    return gather.gather_draft_probs_triton(target, d2t, t2d, input_is_logits)


def _require_triton() -> None:
    if not triton_available():
        raise RuntimeError("backend='triton' requested but the triton package cannot be imported")
