"""Distribution-preserving speculative verify without sgl-kernel or FlashInfer, on any device.

Stock SGLang 0.5.23 verifies greedily on CPU even for sampling requests
(`eagle_utils._verify_uses_greedy` returns True when `is_cpu`): the committed tokens are then the
target's argmax, not samples of its distribution. Its sampling path needs
`tree_speculative_sampling_target_only` (a CUDA kernel JIT-compiled against FlashInfer's headers) and
`top_k_renorm_prob` / `top_p_renorm_prob` (FlashInfer on CUDA, Triton on ROCm, `None` on CPU, where a
`top_p` request used to kill the scheduler with "'NoneType' object is not callable"). This module
holds PyTorch versions of the three, and the hook that routes CPU sampling requests to them.

Device-agnostic and free of host syncs: every op here is a fixed sequence of tensor operations on
the inputs' device, with shapes that depend only on the input shapes (no `.item()`, `.tolist()`,
`bool(tensor)`, `nonzero()` or masked selection; the only Python loops run over static sizes, the
tree depth and log2 of the draft width). So they serve a GPU without sgl-kernel or FlashInfer as they
serve a CPU, inside the overlap scheduler's stream without stalling it. A GPU stand-in imports them
with no side effect (this module imports only torch at load):

    from sglang_tts.platform.cpu.spec_sampling import (
        top_k_renorm_prob, top_p_renorm_prob, tree_speculative_sampling_target_only)

There SGLang resolves them as `flashinfer.sampling.top_k_renorm_probs` / `top_p_renorm_probs`
(`sglang/kernels/ops/sampling/renorm.py`, a LazyImport on CUDA) and
`sglang.kernels.ops.speculative.verify_sampling.tree_speculative_sampling_target_only`; the
signatures below are the ones SGLang calls (`eagle_utils.py`, `dflash_utils.py`).

Semantics of the tree sampler, those of SGLang's kernel (`sgl_kernel/speculative/sampling.cuh`,
target-only: the drafter's proposals are deterministic guesses, p_draft = 1 for the token drafted).
At each accepted node, with coin u ~ U(0, 1), walk its children in sibling order accumulating the
target's probability of each child's token; the first child with nonzero target probability whose
running sum exceeds u * threshold_acc (or whose own probability reaches threshold_single) is
accepted, and the walk moves to it with its own coin. That is sampling a token from the target and
checking whether it is one of the proposals: a single proposal x is accepted with probability
min(1, p_target(x) / p_draft(x)) = p_target(x). If no child is accepted, the bonus token is drawn
from the target with the rejected proposals' mass removed, renormalised (the residual
max(0, p_target - p_draft) of rejection sampling): the committed token is then distributed exactly
as the target's (for the default thresholds of 1). At the last level (tree depth reached) the bonus
token is drawn from the target itself.

Before the sampler runs, SGLang renormalises the target's probabilities to the request's top-k /
top-p support with the renorm ops. The versions here keep the kernels' threshold semantics: a per-row
pivot probability, every token at or above it kept (ties at the pivot included), then renormalised.
"""

from __future__ import annotations

from types import ModuleType

import torch


def _per_row(value: torch.Tensor | float | int, rows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A scalar or per-row parameter -> [rows] tensor on `device` (SGLang passes [rows] or [rows, 1])."""
    if isinstance(value, torch.Tensor):
        out = value.reshape(-1).to(device=device, dtype=dtype)
        return out.expand(rows) if out.numel() == 1 else out
    return torch.full((rows,), value, dtype=dtype, device=device)


def _keep_from_pivot(probs: torch.Tensor, pivots: torch.Tensor) -> torch.Tensor:
    """Zero every probability below its row's pivot and renormalise the rest.

    probs: [rows, vocab]; pivots: [rows], each one of its row's probabilities (so the kept mass is > 0
    for any row with mass)."""
    kept = torch.where(probs >= pivots[:, None], probs, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def top_k_renorm_prob(probs: torch.Tensor, top_k: torch.Tensor | int) -> torch.Tensor:
    """Keep each row's k most likely tokens (and any tied with the k-th), renormalised.

    probs: [rows, vocab] (softmax output); top_k: [rows] (or [rows, 1]) or a scalar, k >= vocab keeps
    all (SGLang's "no top-k" is 1 << 30). Returns a new fp32 tensor. A full sort per row: the k-th
    largest probability is read at a per-row index, so no k has to reach the host.
    """
    probs = probs.float()
    rows, vocab = probs.shape
    if rows == 0:
        return probs
    ks = _per_row(top_k, rows, torch.int64, probs.device).clamp(1, vocab)  # [rows]
    ordered = probs.sort(dim=-1, descending=True).values  # [rows, vocab]
    pivots = ordered.gather(1, (ks - 1)[:, None]).squeeze(1)  # [rows]
    return _keep_from_pivot(probs, pivots)


def top_p_renorm_prob(probs: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """Keep each row's smallest most-likely set whose mass reaches p (ties at the edge included).

    probs: [rows, vocab]; top_p: [rows] (or [rows, 1]) or a scalar in (0, 1]. Ascending sort: the
    prefix whose cumulative mass stays below 1 - p is dropped; the first token past it is the pivot.
    """
    probs = probs.float()
    rows, vocab = probs.shape
    if rows == 0:
        return probs
    ps = _per_row(top_p, rows, torch.float64, probs.device)  # [rows]
    ascending = probs.sort(dim=-1).values  # [rows, vocab]
    # The running mass in float64: CPU's cumsum accumulates float32 in double, CUDA's in float32, whose error
    # over a 32K-128K vocabulary (~1e-6) moves the cutoff past tail tokens of ~1e-5 on a few rows in a hundred.
    cdf = ascending.double().cumsum(-1)  # [rows, vocab]
    cutoff = torch.searchsorted(cdf, (1.0 - ps)[:, None].contiguous(), right=False).clamp_max(vocab - 1)  # [rows, 1]
    pivots = ascending.gather(1, cutoff).squeeze(1)  # [rows]
    return _keep_from_pivot(probs, pivots)


def fill_missing_sampling_ops(module: ModuleType) -> None:
    """Give a SGLang module that bound the platform's sampling kernels at import time (as `None`
    on CPU) the PyTorch versions of the ones it lacks; kernels that exist are left alone."""
    ops = {
        "top_k_renorm_prob": top_k_renorm_prob,
        "top_p_renorm_prob": top_p_renorm_prob,
        "tree_speculative_sampling_target_only": tree_speculative_sampling_target_only,
    }
    for name, op in ops.items():
        if hasattr(module, name) and getattr(module, name) is None:
            setattr(module, name, op)


def _tree_links(next_token: torch.Tensor, next_sibling: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each node's parent and its rank in its parent's sibling list, from SGLang's retrieve links.

    next_token, next_sibling: [bs, n] int64, a node's first child and next sibling (-1: none).
    Returns parent [bs, n] (-1 for the root and for nodes in no tree) and rank [bs, n] (0 for a first
    child). The sibling lists are walked by pointer jumping (Wyllie's list ranking): each round doubles
    how far every node's back pointer reaches, so (n - 1).bit_length() rounds of gathers cover any list.
    """
    bs, n = next_token.shape
    device = next_token.device
    nodes = torch.arange(n, device=device).expand(bs, n).contiguous()  # [bs, n]
    # Column n of the padded tables absorbs the writes of the -1 links (and is dropped).
    parent_of_first = torch.full((bs, n + 1), -1, dtype=torch.long, device=device)
    parent_of_first.scatter_(1, torch.where(next_token >= 0, next_token, n), nodes)
    prev = torch.full((bs, n + 1), -1, dtype=torch.long, device=device)
    prev = prev.scatter_(1, torch.where(next_sibling >= 0, next_sibling, n), nodes)[:, :n]  # [bs, n]
    back = torch.where(prev >= 0, prev, nodes)  # [bs, n] a chain's head points at itself
    rank = (prev >= 0).long()  # [bs, n] distance covered by `back`
    for _ in range((n - 1).bit_length()):
        rank = rank + rank.gather(1, back)
        back = back.gather(1, back)
    parent = parent_of_first[:, :n].gather(1, back)  # back is now each node's first sibling
    return parent, rank


def tree_speculative_sampling_target_only(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    uniform_samples: torch.Tensor,
    uniform_samples_for_final_sampling: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:
    """SGLang's target-only tree verify by sampling (module docstring), written in place.

    predicts: [bs * n] int32, out: at each accepted node's row (retrive_index) the token committed
        after it: the next accepted proposal, or the bonus token at the last one.
    accept_index: [bs, steps] int32, out: retrive_index of the root and of each accepted node (entries
        past the accepted ones are left as they were).
    accept_token_num: [bs] int32, out: proposals accepted (the bonus token excluded).
    candidates: [bs, n] int64 the draft tokens, node 0 the root (the last verified token).
    retrive_index: [bs, n] int64 each node's row in predicts / the flattened [bs * n] batch.
    retrive_next_token, retrive_next_sibling: [bs, n] int64 first child / next sibling (-1: none).
    uniform_samples: [bs, n] float32 each node's coin for choosing among its children.
    uniform_samples_for_final_sampling: [bs] float32 the coin of the bonus token.
    target_probs: [bs, n, vocab] float32 the target's distribution after each node.
    draft_probs: [bs, n, vocab] float32 subtracted from the target's at the node where the walk
        ends (zeros for target-only). Read only: the CUDA kernel writes the rejected proposals' target
        mass into it as scratch space, which SGLang discards.
    threshold_single, threshold_acc: SGLang's --speculative-accept-threshold-{single,acc} (1: exact).
    deterministic: accepted for the kernel's signature; this version is always deterministic.

    Every node's acceptance test is evaluated at once (it depends on its parent's coin and on its
    earlier siblings only); the walk down the accepted path is a loop over the static depth. Running
    sums over siblings add in another order than the kernel's left-to-right loop, so a coin within
    float rounding of a boundary may fall the other way: the distribution is the same.
    """
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    vocab = target_probs.shape[-1]
    if bs == 0:
        return
    device = candidates.device
    threshold_acc = max(float(threshold_acc), 1e-9)
    cand = candidates.long().clamp(0, vocab - 1)  # [bs, n]
    ret_index = retrive_index.long()  # [bs, n]
    nodes = torch.arange(n, device=device).expand(bs, n).contiguous()  # [bs, n]
    batch_rows = torch.arange(bs, device=device)[:, None] * n  # [bs, 1]
    flat_target = target_probs.reshape(bs * n, vocab)

    # --- every node's acceptance test, against its parent's distribution and coin
    parent, rank = _tree_links(retrive_next_token.long(), retrive_next_sibling.long())
    has_parent = parent >= 0  # [bs, n]
    p_single = flat_target[batch_rows + parent.clamp(min=0), cand]  # [bs, n] target prob of the node's token
    p_single = torch.where(has_parent, p_single, 0.0)
    # upto[b, i, j]: j is i or a sibling before it (the kernel's running sum at i covers these)
    same_parent = (parent[:, :, None] == parent[:, None, :]) & has_parent[:, None, :]  # [bs, n, n]
    upto = same_parent & (rank[:, None, :] <= rank[:, :, None])  # [bs, n, n]
    prob_acc = torch.where(upto, p_single[:, None, :], 0.0).sum(-1)  # [bs, n]
    coin = uniform_samples.float().gather(1, parent.clamp(min=0))  # [bs, n] the parent's coin
    passes = (coin < prob_acc / threshold_acc) | (p_single >= threshold_single)
    ok = has_parent & (p_single > 0) & passes  # [bs, n]
    earlier_ok = (upto & (rank[:, None, :] < rank[:, :, None]) & ok[:, None, :]).any(-1)  # [bs, n]
    accepted = ok & ~earlier_ok  # [bs, n] the child where its parent's walk stops (at most one)
    accepted_child = torch.full((bs, n + 1), -1, dtype=torch.long, device=device)
    accepted_child = accepted_child.scatter_(1, torch.where(accepted, parent, n), nodes)[:, :n]  # [bs, n]

    # --- the walk down the accepted path: a loop over the static depth
    cur = torch.zeros(bs, dtype=torch.long, device=device)  # [bs] node the walk is at
    alive = torch.ones(bs, dtype=torch.bool, device=device)  # [bs] still accepting
    num_accepted = torch.zeros(bs, dtype=torch.long, device=device)  # [bs]
    last = ret_index[:, 0]  # [bs] predicts row of the last accepted node
    accept_index[:, 0] = last.to(accept_index.dtype)
    for j in range(1, steps):
        child = accepted_child.gather(1, cur[:, None]).squeeze(1)  # [bs], -1: none accepted
        alive = alive & (child >= 0)
        child = child.clamp(min=0)
        token = cand.gather(1, child[:, None]).squeeze(1)  # [bs]
        index = ret_index.gather(1, child[:, None]).squeeze(1)  # [bs]
        old = predicts.gather(0, last)
        predicts.scatter_(0, last, torch.where(alive, token.to(predicts.dtype), old))
        accept_index[:, j] = torch.where(alive, index.to(accept_index.dtype), accept_index[:, j])
        num_accepted = num_accepted + alive.long()
        last = torch.where(alive, index, last)
        cur = torch.where(alive, child, cur)
    accept_token_num.copy_(num_accepted.to(accept_token_num.dtype))

    # --- the bonus token: the residual max(0, target - draft) at the last accepted node, with the
    # proposals rejected there removed; no draft distribution once the tree's depth is reached
    full_depth = num_accepted == steps - 1  # [bs]
    rows = batch_rows.squeeze(1) + cur  # [bs]
    q = flat_target.index_select(0, rows).float()  # [bs, vocab]
    p = draft_probs.reshape(bs * n, vocab).index_select(0, rows).float()  # [bs, vocab]
    residual = (q - torch.where(full_depth[:, None], 0.0, p)).clamp_min(0.0)  # [bs, vocab]
    rejected = (parent == cur[:, None]) & ~full_depth[:, None]  # [bs, n] every child of the last node
    keep = torch.ones(bs, vocab + 1, dtype=residual.dtype, device=device)
    keep = keep.scatter_(1, torch.where(rejected, cand, vocab), 0.0)[:, :vocab]  # [bs, vocab]
    residual = residual * keep
    u = uniform_samples_for_final_sampling.reshape(bs, 1).float() * residual.sum(-1, keepdim=True)  # [bs, 1]
    sampled = torch.searchsorted(residual.cumsum(-1), u, right=True).squeeze(1)  # [bs] first cdf > u
    # u at (or past, by rounding) the total: the last token with mass, as the kernel does
    last_valid = torch.where(residual > 0, torch.arange(vocab, device=device), -1).amax(-1)  # [bs]
    fallback = torch.where(last_valid >= 0, last_valid, vocab - 1)
    sampled = torch.where(sampled < vocab, sampled, fallback)
    predicts.scatter_(0, last, sampled.to(predicts.dtype))


def verify_uses_greedy_hook(original, *args, **kwargs):
    """AROUND hook on eagle_utils._verify_uses_greedy: sampling requests take the sampling path on CPU,
    or, inside a seeded verify (seeded_sampling.py), the greedy walk against the seeded samples."""
    import sglang.srt.speculative.eagle_utils as eagle_utils

    from sglang_tts.platform.cpu.seeded_sampling import active_verify

    if active_verify() is not None:
        return True
    fill_missing_sampling_ops(eagle_utils)
    if kwargs.get("is_cpu"):
        kwargs["is_cpu"] = False
    return original(*args, **kwargs)
