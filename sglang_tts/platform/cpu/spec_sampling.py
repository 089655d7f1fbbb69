"""Distribution-preserving speculative verify on CPU (what SGLang's CUDA sampling kernel does).

Stock SGLang 0.5.23 verifies greedily on CPU even for sampling requests
(`eagle_utils._verify_uses_greedy` returns True when `is_cpu`): the committed tokens are then the
target's argmax, not samples of its distribution. Its sampling path needs
`tree_speculative_sampling_target_only`, which exists only as a CUDA kernel. This is a PyTorch
version with the kernel's semantics, and the hook that routes CPU sampling requests to it.

Semantics (target-only: the drafter's proposals are treated as deterministic guesses). At each
accepted node, with coin u ~ U(0, 1), walk the children in sibling order accumulating the target's
probability of each child's token; the first child whose running sum reaches u (or whose own
probability reaches threshold_single) is accepted. That is sampling from the target and checking
whether the sample is one of the proposals. If none is, the bonus token is drawn from the target
with the rejected proposals' mass removed (renormalised), so the committed token is distributed
exactly as the target's (for the default thresholds of 1).

Before that sampler runs, SGLang renormalises the target's probabilities to the request's top-k /
top-p support with `top_k_renorm_prob` / `top_p_renorm_prob` (FlashInfer on CUDA, Triton on ROCm;
`None` on CPU, where a `top_p` request used to kill the scheduler with "'NoneType' object is not
callable"). The PyTorch versions below keep the kernels' threshold semantics: a per-row pivot
probability, every token at or above it kept (ties at the pivot included), then renormalised.
"""

from __future__ import annotations

from types import ModuleType

import torch


def _per_row(value: torch.Tensor | float | int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """A scalar or per-row parameter -> [rows] tensor (SGLang passes [rows] or [rows, 1])."""
    if isinstance(value, torch.Tensor):
        out = value.reshape(-1).to(dtype)
        return out.expand(rows) if out.numel() == 1 else out
    return torch.full((rows,), value, dtype=dtype)


def _keep_from_pivot(probs: torch.Tensor, pivots: torch.Tensor) -> torch.Tensor:
    """Zero every probability below its row's pivot and renormalise the rest."""
    kept = torch.where(probs >= pivots[:, None], probs, torch.zeros((), dtype=probs.dtype))
    return kept / kept.sum(-1, keepdim=True)


def top_k_renorm_prob(probs: torch.Tensor, top_k: torch.Tensor | int) -> torch.Tensor:
    """Keep each row's k most likely tokens (and any tied with the k-th), renormalised.

    probs: [rows, vocab] (softmax output); top_k: [rows] or scalar, k >= vocab keeps all (SGLang's
    "no top-k" is 1 << 30). Returns a new fp32 tensor.
    """
    probs = probs.float()
    rows, vocab = probs.shape
    if rows == 0:
        return probs
    ks = _per_row(top_k, rows, torch.int64).clamp(1, vocab)
    k_max = int(ks.max())  # CPU op: the host reads k here, no device to sync with
    if k_max >= vocab:
        ordered = probs.sort(dim=-1, descending=True).values
    else:
        ordered = probs.topk(k_max, dim=-1).values  # descending
    pivots = ordered.gather(1, (ks - 1).clamp_max(ordered.shape[1] - 1)[:, None]).squeeze(1)
    return _keep_from_pivot(probs, pivots)


def top_p_renorm_prob(probs: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """Keep each row's smallest most-likely set whose mass reaches p (ties at the edge included).

    probs: [rows, vocab]; top_p: [rows] or scalar in (0, 1]. Ascending sort: the prefix whose
    cumulative mass stays below 1 - p is dropped; the first token past it is the pivot.
    """
    probs = probs.float()
    rows, vocab = probs.shape
    if rows == 0:
        return probs
    ps = _per_row(top_p, rows, torch.float32)
    ascending = probs.sort(dim=-1).values
    cdf = ascending.cumsum(-1)
    cutoff = torch.searchsorted(cdf, (1.0 - ps)[:, None].contiguous(), right=False).clamp_max(vocab - 1)
    pivots = ascending.gather(1, cutoff).squeeze(1)
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
    """In place: predicts [bs*n], accept_index [bs, steps], accept_token_num [bs], draft_probs."""
    bs, num_draft = candidates.shape
    num_steps = accept_index.shape[1]
    threshold_acc = max(float(threshold_acc), 1e-9)
    for b in range(bs):
        cur_node = 0
        prob_row = target_probs[b, 0]
        rejected = draft_probs[b, 0]
        coin = float(uniform_samples[b, 0])
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        num_accepted = 0
        for _ in range(1, num_steps):
            child = int(retrive_next_token[b, cur_node])
            prob_acc = 0.0
            while child != -1:
                token = int(candidates[b, child])
                p = float(prob_row[token])
                prob_acc += p
                if coin <= prob_acc / threshold_acc or p >= threshold_single:
                    num_accepted += 1
                    predicts[last] = token
                    last = int(retrive_index[b, child])
                    accept_index[b, num_accepted] = last
                    cur_node = child
                    prob_row = target_probs[b, child]
                    rejected = draft_probs[b, child]
                    coin = float(uniform_samples[b, child])
                    break
                rejected[token] = prob_row[token]  # this proposal's mass is excluded from the bonus draw
                child = int(retrive_next_sibling[b, child])
            if child == -1:
                break
        accept_token_num[b] = num_accepted
        residual = (prob_row - rejected).clamp_min(0)
        total = float(residual.sum())
        if total <= 0.0:  # every token was proposed and rejected: numerically impossible, keep argmax
            predicts[last] = int(prob_row.argmax())
            continue
        cdf = residual.cumsum(0)
        u = float(uniform_samples_for_final_sampling[b]) * total
        predicts[last] = int(
            torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype), right=True).clamp_max(residual.numel() - 1)
        )


def verify_uses_greedy_hook(original, *args, **kwargs):
    """AROUND hook on eagle_utils._verify_uses_greedy: sampling requests take the sampling path on CPU."""
    import sglang.srt.speculative.eagle_utils as eagle_utils

    fill_missing_sampling_ops(eagle_utils)
    if kwargs.get("is_cpu"):
        kwargs["is_cpu"] = False
    return original(*args, **kwargs)
