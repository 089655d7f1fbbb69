"""Memory-efficient PyTorch implementation of the TTS update loss (the default on CPU).

Same maths as :func:`sglang_tts.kernels.reference.naive_linear_kl`, organised like Liger-Kernel's fused linear
cross-entropy: the forward pass walks over chunks of positions, computes one chunk of logits, turns it *in place*
into the gradient of the loss with respect to those logits, and immediately folds it into ``dL/dhidden`` and
``dL/dweight``. Only the two gradients survive the forward; ``backward`` merely scales them by ``grad_output``.
The largest float intermediate is therefore one chunk of logits instead of the full ``[N, V]`` matrix (plus the
handful of ``[N, V]``-sized autograd buffers the naive version keeps alive).

The vocabulary can be chunked as well: a first sweep over vocabulary blocks accumulates an online log-sum-exp
(and the target statistics) per position, a second sweep recomputes each logits block to emit its gradients.
That costs one extra logits matmul, but every weight block is read three times and each ``dL/dW`` block written
once, whereas position chunking re-reads ``W`` and read-modify-writes all of ``dL/dW`` once per chunk. When the
caller sets neither chunk size, :func:`plan_chunks` therefore prefers vocabulary blocks once the ``[N, V]``
logits exceed the budget; in both schemes one block holds at most about ``DEFAULT_CHUNK_ELEMENTS`` logits.

Per position, with ``x`` the logits, ``lse = logsumexp(x)`` and ``P = sum_v p_v``::

    KL(p || q) = sum_v p_v log p_v - sum_v p_v x_v + P * lse
    dKL/dx     = P * q - p

``P`` is 1 for a proper distribution, but keeping it makes the gradient exact for any non-negative ``p`` (and
makes all-zero rows, e.g. "target token outside the draft vocabulary", contribute exactly nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .reference import check_linear_kl_inputs

__all__ = [
    "ChunkedLinearKL",
    "chunked_linear_kl",
    "default_chunk_size",
    "kl_rows_torch_",
    "linear_kl_forward",
    "plan_chunks",
]

# Logit elements per chunk when the caller does not choose: 2**20 float32 values = 4 MiB, small next to any
# real LM head's gradient yet large enough that the matmuls stay efficient.
DEFAULT_CHUNK_ELEMENTS = 1 << 20

# Signature of the per-chunk "rows" operator: (logits [n, V] float32, p [n, V], w [n] float32, r [n, V] | None,
# lambda) -> per-row loss [n]; it must overwrite ``logits`` with dL/dlogits. ``p``/``r`` arrive in their input
# dtype (the operator upcasts). The Triton backend plugs its kernel in here.
RowsFn = Callable[[Tensor, Tensor, Tensor, "Tensor | None", float], Tensor]


# Narrowest vocabulary block the planner picks: below it the per-block overheads outweigh the savings.
MIN_VOCAB_BLOCK = 2048


def default_chunk_size(n_rows: int, n_cols: int, budget_elements: int = DEFAULT_CHUNK_ELEMENTS) -> int:
    """Number of positions per chunk so that one ``[chunk, n_cols]`` block holds about ``budget_elements``."""
    return max(1, min(n_rows, budget_elements // max(n_cols, 1)))


def plan_chunks(
    n_rows: int,
    vocab: int,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    budget_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> tuple[int, int]:
    """``(positions per chunk, vocabulary block)``, filling in whichever the caller left as ``None``.

    Only ``chunk_size`` given: full-vocabulary position chunks (the Liger scheme). Neither given: a single block if
    the whole ``[N, V]`` fits the budget, else vocabulary blocks of ``budget / N`` columns (at least
    ``MIN_VOCAB_BLOCK``) over as many positions as the budget allows.
    """
    if vocab_chunk_size is None:
        if chunk_size is not None or n_rows * vocab <= budget_elements:
            vocab_chunk_size = vocab
        else:
            vocab_chunk_size = max(MIN_VOCAB_BLOCK, budget_elements // max(n_rows, 1))
    vocab_chunk_size = min(vocab_chunk_size, vocab)
    if chunk_size is None:
        chunk_size = default_chunk_size(n_rows, vocab_chunk_size, budget_elements)
    if chunk_size < 1 or vocab_chunk_size < 1:
        raise ValueError(f"chunk sizes must be positive, got {chunk_size} and {vocab_chunk_size}")
    return chunk_size, vocab_chunk_size


def _row_dot(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise dot product of two ``[n, V]`` matrices without an ``[n, V]`` temporary (unlike ``(a*b).sum(-1)``)."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


# Elements per block of the p*log(p) sum: bounds that temporary to 1 MiB instead of a second logits-sized buffer.
_ENTROPY_BLOCK_ELEMENTS = 1 << 18


def _neg_entropy(p: Tensor) -> Tensor:
    """``sum_v p_v log p_v`` per row (float32), with ``0 log 0 = 0``."""
    out = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)
    cols = max(256, _ENTROPY_BLOCK_ELEMENTS // max(p.shape[0], 1))
    for start in range(0, p.shape[1], cols):
        # entr(x) = -x log x with entr(0) = 0; on CPU it is several times faster than xlogy.
        out -= torch.special.entr(p[:, start : start + cols].float()).sum(-1)
    return out


def kl_rows_torch_(logits: Tensor, p: Tensor, w: Tensor, r: Tensor | None, reg_lambda: float) -> Tensor:
    """Per-row weighted loss of one chunk; overwrites ``logits`` (float32 ``[n, V]``) with ``dL/dlogits``.

    The softmax is done in place (``sub_``/``exp_``/``mul_``) and the dot products use ``bmm``, so the chunk costs
    one logits buffer and no second ``[n, V]`` temporary.
    """
    # Targets in float32 (a no-op for float32 inputs; a chunk-sized copy for bf16/fp16 ones).
    p = p.float()
    r = r.float() if r is not None else None
    # Everything that needs the raw logits comes first.
    p_cross = _row_dot(p, logits)
    r_cross = _row_dot(r, logits) if r is not None else None
    row_max = logits.amax(dim=-1, keepdim=True)
    exp_sum = logits.sub_(row_max).exp_().sum(-1)  # logits now hold exp(x - max)
    lse = row_max.squeeze(1) + torch.log(exp_sum)

    p_sum = p.sum(-1)
    loss = w * (_neg_entropy(p) - p_cross + p_sum * lse)
    coef = w * p_sum
    if r is not None:
        r_sum = r.sum(-1)
        loss = loss + reg_lambda * w * (_neg_entropy(r) - r_cross + r_sum * lse)
        coef = coef + reg_lambda * w * r_sum
    # exp(x - max) -> coef * q -> w*(P q - p) + lambda*w*(R q - r), all in place.
    logits.mul_((coef / exp_sum).unsqueeze(1))
    logits.addcmul_(p, w.unsqueeze(1), value=-1.0)
    if r is not None:
        logits.addcmul_(r, (reg_lambda * w).unsqueeze(1), value=-1.0)
    return loss


def _chunk_logits(hidden_chunk: Tensor, weight_rows: Tensor) -> Tensor:
    # The matmul runs in the input dtype (fast path on GPU for bf16); softmax/KL maths is float32.
    # For float32 inputs ``.float()`` is a no-op, so no copy is made.
    return torch.mm(hidden_chunk, weight_rows.t()).float()


def linear_kl_forward(
    hidden: Tensor,
    weight: Tensor,
    teacher_probs: Tensor,
    weights: Tensor,
    prev_probs: Tensor | None,
    reg_lambda: float,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    rows_fn: RowsFn = kl_rows_torch_,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Loss and (optionally) both gradients in one chunked sweep. Returns ``(loss, grad_hidden, grad_weight)``.

    ``rows_fn`` is the per-chunk softmax/KL/grad operator (PyTorch by default, Triton for the Triton backend); it
    only applies to the full-vocabulary path, vocabulary chunking always uses PyTorch maths.
    """
    check_linear_kl_inputs(hidden, weight, teacher_probs, weights, prev_probs, reg_lambda)
    n, h = hidden.shape
    v = weight.shape[0]
    if reg_lambda == 0.0:
        prev_probs = None  # the regulariser is off: never touch r
    if rows_fn is not kl_rows_torch_:
        # Custom operators (the Triton kernel) see whole vocabulary rows.
        if vocab_chunk_size is not None and vocab_chunk_size < v:
            raise ValueError("vocabulary chunking is only implemented with the PyTorch rows operator")
        vocab_chunk_size = v
    chunk_size, vocab_chunk_size = plan_chunks(n, v, chunk_size, vocab_chunk_size)

    w_all = weights.float()
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    # Gradients accumulate in float32 (across vocabulary blocks for dh, across position chunks for dW); for
    # float32 inputs these buffers *are* the returned gradients, no copy. ``empty`` is enough when there is work:
    # the first contribution to every block is written with ``out=`` (saves a fill and a read of V x H floats).
    alloc = torch.empty if n > 0 else torch.zeros
    grad_hidden = alloc(n, h, dtype=torch.float32, device=hidden.device) if need_grad_hidden else None
    grad_weight = alloc(v, h, dtype=torch.float32, device=weight.device) if need_grad_weight else None
    need_grad = need_grad_hidden or need_grad_weight

    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        h_c = hidden[start:end]
        w_c = w_all[start:end]
        p_c = teacher_probs[start:end]
        r_c = prev_probs[start:end] if prev_probs is not None else None
        if vocab_chunk_size == v:
            logits = _chunk_logits(h_c, weight)
            loss += rows_fn(logits, p_c, w_c, r_c, reg_lambda).sum()
            if need_grad:
                _accumulate_grads(logits, h_c, weight, 0, grad_hidden, grad_weight, start)
            # Free this chunk before the next matmul allocates its successor (rebinding alone would keep both).
            del logits
        else:
            loss += _vocab_chunked_rows(
                h_c, weight, p_c, w_c, r_c, reg_lambda, vocab_chunk_size, grad_hidden, grad_weight, start, need_grad
            )

    if grad_hidden is not None:
        grad_hidden = grad_hidden.to(hidden.dtype)
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    return loss, grad_hidden, grad_weight


def _accumulate_grads(
    grad_logits: Tensor,
    h_c: Tensor,
    weight: Tensor,
    vocab_start: int,
    grad_hidden: Tensor | None,
    grad_weight: Tensor | None,
    start: int,
) -> None:
    """Add one ``[n, v_chunk]`` block of dL/dlogits into the float32 dL/dhidden rows and dL/dweight rows.

    The first block to reach a gradient slice (vocabulary block 0 for dh rows, position chunk 0 for dW rows)
    overwrites it, later ones accumulate.
    """
    end = start + grad_logits.shape[0]
    v_end = vocab_start + grad_logits.shape[1]
    w_rows = weight[vocab_start:v_end]
    if grad_hidden is not None:
        dh = grad_hidden[start:end]
        if w_rows.dtype != torch.float32:
            # Casting the small grad block down beats casting a [v_chunk, H] slice of the weight up.
            block = torch.mm(grad_logits.to(w_rows.dtype), w_rows).float()
            if vocab_start == 0:
                dh.copy_(block)
            else:
                dh.add_(block)
        elif vocab_start == 0:
            torch.mm(grad_logits, w_rows, out=dh)
        else:
            dh.addmm_(grad_logits, w_rows)
    if grad_weight is not None:
        dw = grad_weight[vocab_start:v_end]
        if start == 0:
            torch.mm(grad_logits.t(), h_c.float(), out=dw)
        else:
            dw.addmm_(grad_logits.t(), h_c.float())


def _vocab_chunked_rows(
    h_c: Tensor,
    weight: Tensor,
    p_c: Tensor,
    w_c: Tensor,
    r_c: Tensor | None,
    reg_lambda: float,
    vocab_chunk_size: int,
    grad_hidden: Tensor | None,
    grad_weight: Tensor | None,
    start: int,
    need_grad: bool,
) -> Tensor:
    """Two sweeps over vocabulary blocks for one position chunk; returns the chunk's summed loss."""
    n = h_c.shape[0]
    v = weight.shape[0]
    dev = h_c.device
    lse = torch.full((n,), float("-inf"), dtype=torch.float32, device=dev)
    p_sum = torch.zeros(n, dtype=torch.float32, device=dev)
    p_cross = torch.zeros_like(p_sum)  # sum_v p_v x_v
    p_negent = torch.zeros_like(p_sum)  # sum_v p_v log p_v
    r_sum, r_cross, r_negent = torch.zeros_like(p_sum), torch.zeros_like(p_sum), torch.zeros_like(p_sum)

    # Sweep 1: online log-sum-exp plus the target statistics the loss needs.
    for vs in range(0, v, vocab_chunk_size):
        ve = min(vs + vocab_chunk_size, v)
        logits = _chunk_logits(h_c, weight[vs:ve])
        p_blk = p_c[:, vs:ve]
        p_sum += p_blk.sum(-1, dtype=torch.float32)
        p_cross += _row_dot(p_blk.float(), logits)
        p_negent += _neg_entropy(p_blk)
        if r_c is not None:
            r_blk = r_c[:, vs:ve]
            r_sum += r_blk.sum(-1, dtype=torch.float32)
            r_cross += _row_dot(r_blk.float(), logits)
            r_negent += _neg_entropy(r_blk)
        # Block log-sum-exp in place (torch.logsumexp would allocate a second block), merged into the running one.
        blk_max = logits.amax(dim=-1, keepdim=True)
        blk_lse = blk_max.squeeze(1) + torch.log(logits.sub_(blk_max).exp_().sum(-1))
        lse = torch.logaddexp(lse, blk_lse)
        del logits

    loss = w_c * (p_negent - p_cross + p_sum * lse)
    coef = w_c * p_sum
    if r_c is not None:
        loss = loss + reg_lambda * w_c * (r_negent - r_cross + r_sum * lse)
        coef = coef + reg_lambda * w_c * r_sum
    if not need_grad:
        return loss.sum()

    # Sweep 2: recompute each logits block and emit its gradient contribution.
    for vs in range(0, v, vocab_chunk_size):
        ve = min(vs + vocab_chunk_size, v)
        g = _chunk_logits(h_c, weight[vs:ve])
        g.sub_(lse.unsqueeze(1)).exp_().mul_(coef.unsqueeze(1))
        g.addcmul_(p_c[:, vs:ve].float(), w_c.unsqueeze(1), value=-1.0)
        if r_c is not None:
            g.addcmul_(r_c[:, vs:ve].float(), (reg_lambda * w_c).unsqueeze(1), value=-1.0)
        _accumulate_grads(g, h_c, weight, vs, grad_hidden, grad_weight, start)
        del g  # as in sweep 1: release the block before the next one is allocated
    return loss.sum()


def stash_grads(ctx: Any, grad_hidden: Tensor | None, grad_weight: Tensor | None) -> None:
    """Keep the precomputed gradients on ``ctx`` until ``backward`` (shared by the chunked and Triton Functions)."""
    ctx.precomputed_grads = (grad_hidden, grad_weight)


def pop_scaled_grads(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """Return the stashed gradients times ``grad_output`` and drop them from ``ctx``.

    Scaling happens in place, so the gradients must not be handed out twice: a second ``backward`` through the
    same graph (``retain_graph=True``) raises instead of silently returning doubly-scaled values.
    """
    grads = getattr(ctx, "precomputed_grads", None)
    if grads is None:
        raise RuntimeError("linear-KL gradients were already consumed; backward through this loss twice is unsupported")
    ctx.precomputed_grads = None
    # On CPU the check is free; on GPU ``.item()`` would force a sync, so there the multiply always happens.
    if grad_output.device.type == "cpu" and grad_output.item() == 1.0:
        return grads
    return tuple(None if g is None else g.mul_(grad_output.to(g.dtype)) for g in grads)  # type: ignore[return-value]


class ChunkedLinearKL(torch.autograd.Function):
    """Autograd wrapper: gradients are computed during ``forward`` and only scaled in ``backward``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        teacher_probs: Tensor,
        weights: Tensor,
        prev_probs: Tensor | None,
        reg_lambda: float,
        chunk_size: int | None,
        vocab_chunk_size: int | None,
    ) -> Tensor:
        loss, grad_hidden, grad_weight = linear_kl_forward(
            hidden,
            weight,
            teacher_probs,
            weights,
            prev_probs,
            reg_lambda,
            need_grad_hidden=ctx.needs_input_grad[0],
            need_grad_weight=ctx.needs_input_grad[1],
            chunk_size=chunk_size,
            vocab_chunk_size=vocab_chunk_size,
        )
        stash_grads(ctx, grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grad_hidden, grad_weight = pop_scaled_grads(ctx, grad_output)
        # No gradients for the targets, weights, lambda or the chunk sizes.
        return grad_hidden, grad_weight, None, None, None, None, None, None


def chunked_linear_kl(
    hidden: Tensor,
    weight: Tensor,
    teacher_probs: Tensor,
    weights: Tensor,
    prev_probs: Tensor | None = None,
    reg_lambda: float = 0.0,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
) -> Tensor:
    """Chunked version of :func:`~sglang_tts.kernels.reference.naive_linear_kl` (same arguments and result).

    Args:
        chunk_size: positions per chunk. Given alone: full-vocabulary chunks of that many positions.
        vocab_chunk_size: vocabulary block (``< V`` enables the two-sweep online log-sum-exp path).
            With neither given, :func:`plan_chunks` keeps one logits block near 4 MiB.
    """
    return ChunkedLinearKL.apply(
        hidden, weight, teacher_probs, weights, prev_probs, float(reg_lambda), chunk_size, vocab_chunk_size
    )
