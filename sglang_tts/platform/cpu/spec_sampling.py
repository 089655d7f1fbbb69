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
"""

from __future__ import annotations

import torch


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

    if eagle_utils.tree_speculative_sampling_target_only is None:
        eagle_utils.tree_speculative_sampling_target_only = tree_speculative_sampling_target_only
    if kwargs.get("is_cpu"):
        kwargs["is_cpu"] = False
    return original(*args, **kwargs)
