"""The CPU target-only tree sampler commits tokens distributed exactly as the target's."""

from __future__ import annotations

import torch

from sglang_tts.platform.cpu.spec_sampling import tree_speculative_sampling_target_only

V = 6
A, B, C = 1, 2, 3  # proposed tokens


def _tree_batch(bs: int):
    # node 0 = root (verified token); children of root: node 1 (token A), node 2 (token B);
    # child of node 1: node 3 (token C).
    n = 4
    candidates = torch.tensor([[0, A, B, C]]).repeat(bs, 1)
    retrive_index = (torch.arange(bs)[:, None] * n + torch.arange(n)[None]).int()
    next_token = torch.tensor([[1, 3, -1, -1]]).repeat(bs, 1)
    next_sibling = torch.tensor([[-1, 2, -1, -1]]).repeat(bs, 1)
    probs = torch.zeros(bs, n, V)
    probs[:, 0] = torch.tensor([0.1, 0.3, 0.2, 0.1, 0.2, 0.1])  # after the root
    probs[:, 1] = torch.tensor([0.05, 0.05, 0.1, 0.5, 0.2, 0.1])  # after A
    probs[:, 2] = torch.full((V,), 1 / V)
    probs[:, 3] = torch.full((V,), 1 / V)
    return n, candidates, retrive_index, next_token, next_sibling, probs


def test_first_and_second_tokens_follow_the_target():
    torch.manual_seed(0)
    bs = 6000
    n, candidates, retrive_index, next_token, next_sibling, probs = _tree_batch(bs)
    predicts = torch.full((bs * n,), -1, dtype=torch.int32)
    accept_index = torch.full((bs, 3), -1, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    tree_speculative_sampling_target_only(
        predicts, accept_index, accept_num, candidates, retrive_index, next_token, next_sibling,
        torch.rand(bs, n), torch.rand(bs), probs, torch.zeros_like(probs),
    )  # fmt: skip
    first = predicts.view(bs, n)[:, 0].long()
    freq = torch.bincount(first, minlength=V).float() / bs
    torch.testing.assert_close(freq, probs[0, 0], atol=0.03, rtol=0)
    # proposals are accepted exactly when the sample hits them
    assert torch.equal(accept_num > 0, (first == A) | (first == B))
    # after accepting A, the next token follows the target's distribution after A
    after_a = predicts.view(bs, n)[first == A, 1].long()
    freq_a = torch.bincount(after_a, minlength=V).float() / after_a.numel()
    torch.testing.assert_close(freq_a, probs[0, 1], atol=0.05, rtol=0)
    assert bool((accept_index[first == B, 1] >= 0).all()) and bool((accept_num[first == B] == 1).all())


def test_a_certain_proposal_is_always_accepted():
    n, candidates, retrive_index, next_token, next_sibling, probs = _tree_batch(1)
    probs[0, 0] = torch.nn.functional.one_hot(torch.tensor(B), V).float()
    predicts = torch.full((n,), -1, dtype=torch.int32)
    accept_index = torch.full((1, 3), -1, dtype=torch.int32)
    accept_num = torch.zeros(1, dtype=torch.int32)
    tree_speculative_sampling_target_only(
        predicts, accept_index, accept_num, candidates, retrive_index, next_token, next_sibling,
        torch.full((1, n), 0.999), torch.rand(1), probs, torch.zeros_like(probs),
    )  # fmt: skip
    assert int(predicts[0]) == B and int(accept_num[0]) == 1 and accept_index[0, :2].tolist() == [0, 2]
