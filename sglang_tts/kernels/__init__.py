"""Kernels for the TTS drafter update and serving, and the one place that picks their backend.

Liger-Kernel layout: each kernel sits beside its PyTorch reference (``reference.py``, ``gather.py``,
``lowrank.py``), behind an ``autograd.Function`` where it trains (``chunked.py``, ``triton_linear_kl.py``), and
the public entry points below are the only dispatch (callers pass a backend name, ``auto`` by default):

* ``fused_linear_kl`` - ``naive`` (materialises ``[N, V]`` logits, autograd backward; reference only),
  ``chunked`` (PyTorch, chunked over positions and optionally the vocabulary, gradients computed in the forward),
  ``triton`` (Triton kernels for the per-row softmax/KL/gradient maths, matmuls stay in PyTorch);
* ``gather_draft_probs`` - ``torch`` | ``triton``;
* ``lowrank_delta`` - ``torch`` | ``triton`` (power-of-two ranks only);
* ``auto`` - ``triton`` for CUDA tensors when Triton imports, else the PyTorch path (``chunked`` for the loss).

Triton is imported lazily: the Triton modules are loaded on first use of a Triton backend (``gather`` and
``lowrank`` guard their ``import triton``), so this package imports, and the PyTorch backends work, without Triton.
Loading the kernel modules late also lets tests set ``TRITON_INTERPRET=1`` before any kernel is decorated.

The package lives inside ``sglang_tts`` rather than as a top-level ``triton_kernels``: that name is OpenAI's
kernel package, which SGLang imports for MXFP4/FP8 models (and probes with ``find_spec``); a folder of that name
in the checkout root would shadow it even without an ``__init__.py`` (a namespace package).
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
    "lowrank_delta",
    "naive_linear_kl",
    "resolve_backend",
    "triton_available",
]

_LINEAR_KL_BACKENDS = ("auto", "naive", "chunked", "triton")
_GATHER_BACKENDS = ("auto", "torch", "triton")
_LOWRANK_BACKENDS = ("auto", "torch", "triton")


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


def lowrank_delta(x: Tensor, a: Tensor, b: Tensor, slots: Tensor, scale: float, backend: str = "auto") -> Tensor:
    """Per-token gathered low-rank delta ``scale * B[slots[n]] @ (A[slots[n]] @ x[n])``.

    Args:
        x: ``[N, in]`` inputs.
        a: ``[S, r, in]`` stacked ``A`` factors.
        b: ``[S, out, r]`` stacked ``B`` factors.
        slots: ``[N]`` indices into the stacks.
        scale: ``alpha / r``.
        backend: ``auto`` | ``torch`` | ``triton``; ``auto`` takes ``triton`` only for CUDA tensors with a usable
            Triton and a power-of-two rank (the kernel's ``tl.arange`` needs one).

    Returns:
        ``[N, out]`` in ``x``'s dtype (the PyTorch path casts the factors to it).
    """
    if backend not in _LOWRANK_BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {_LOWRANK_BACKENDS}")
    if backend == "auto":
        rank = a.shape[1]
        power_of_two = rank > 0 and not rank & (rank - 1)
        backend = resolve_backend(backend, x, fallback="torch") if power_of_two else "torch"
    from . import lowrank

    if backend == "torch":
        return lowrank.lowrank_delta_torch(x, a.to(x.dtype), b.to(x.dtype), slots, scale)
    _require_triton()
    return lowrank.triton_lowrank_delta(x, a, b, slots, scale)


def _require_triton() -> None:
    if not triton_available():
        raise RuntimeError("backend='triton' requested but the triton package cannot be imported")
