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


# --- top-k / top-p renormalisation (what FlashInfer's kernels do on CUDA) ---------------------


def test_top_k_keeps_the_k_most_likely_tokens_and_ties_at_the_kth():
    from sglang_tts.platform.cpu.spec_sampling import top_k_renorm_prob

    probs = torch.tensor(
        [
            [0.1, 0.4, 0.2, 0.3, 0.0],
            [0.1, 0.4, 0.2, 0.3, 0.0],
            [0.2, 0.2, 0.2, 0.3, 0.1],  # the 2nd..4th most likely tie at 0.2
            [0.1, 0.4, 0.2, 0.3, 0.0],
        ]
    )
    out = top_k_renorm_prob(probs, torch.tensor([1, 2, 2, 1 << 30]))
    torch.testing.assert_close(out[0], torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(out[1], torch.tensor([0.0, 0.4, 0.0, 0.3, 0.0]) / 0.7)
    torch.testing.assert_close(out[2], torch.tensor([0.2, 0.2, 0.2, 0.3, 0.0]) / 0.9)
    torch.testing.assert_close(out[3], probs[3])  # SGLang's "no top-k" keeps everything
    torch.testing.assert_close(top_k_renorm_prob(probs[:1], 2), out[1:2])  # a scalar k


def test_top_p_keeps_the_smallest_likely_set_reaching_p():
    from sglang_tts.platform.cpu.spec_sampling import top_p_renorm_prob

    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3, 0.0]]).repeat(4, 1)
    out = top_p_renorm_prob(probs, torch.tensor([[0.35], [0.69], [0.71], [1.0]]))
    torch.testing.assert_close(out[0], torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(out[1], torch.tensor([0.0, 0.4, 0.0, 0.3, 0.0]) / 0.7)
    torch.testing.assert_close(out[2], torch.tensor([0.0, 0.4, 0.2, 0.3, 0.0]) / 0.9)
    torch.testing.assert_close(out[3], probs[3])


def test_renorm_matches_sglangs_torch_reference_on_random_rows():
    """SGLang's own PyTorch top-p (sampler.top_p_normalize_probs_torch) agrees wherever no two
    probabilities tie; top-k agrees with keeping torch.topk's k tokens."""
    from sglang.srt.layers.sampler import top_p_normalize_probs_torch

    from sglang_tts.platform.cpu.spec_sampling import top_k_renorm_prob, top_p_renorm_prob

    torch.manual_seed(0)
    probs = torch.randn(64, 1000).mul(3).softmax(-1)
    ps = torch.rand(64) * 0.98 + 0.01
    torch.testing.assert_close(top_p_renorm_prob(probs, ps), top_p_normalize_probs_torch(probs, ps))
    ks = torch.randint(1, 1000, (64,))
    expected = torch.zeros_like(probs)
    for row, k in enumerate(ks.tolist()):
        values, index = probs[row].topk(k)
        expected[row, index] = values / values.sum()
    torch.testing.assert_close(top_k_renorm_prob(probs, ks), expected)


def test_missing_sampling_ops_are_filled_and_real_ones_kept():
    import types

    from sglang_tts.platform.cpu import spec_sampling

    def real_kernel(*args):
        return args

    module = types.SimpleNamespace(top_k_renorm_prob=None, top_p_renorm_prob=real_kernel)
    spec_sampling.fill_missing_sampling_ops(module)
    assert module.top_k_renorm_prob is spec_sampling.top_k_renorm_prob
    assert module.top_p_renorm_prob is real_kernel
    assert not hasattr(module, "tree_speculative_sampling_target_only")  # names it never had stay absent
