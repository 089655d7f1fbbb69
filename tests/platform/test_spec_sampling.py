"""The CPU target-only tree sampler commits tokens distributed exactly as the target's."""

from __future__ import annotations

import pytest
import torch

from sglang_tts.platform.cpu.spec_sampling import (
    top_k_renorm_prob,
    top_p_renorm_prob,
    tree_speculative_sampling_target_only,
)

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


# --- the device-agnostic sampler against a line-by-line port of SGLang's CUDA kernel -------------


def _kernel_reference(
    predicts, accept_index, accept_num, candidates, retrive_index, next_token, next_sibling,
    coins, final_coins, target_probs, draft_probs, threshold_single=1.0, threshold_acc=1.0,
):  # fmt: skip
    """TreeSpeculativeSamplingTargetOnly (sgl_kernel/speculative/sampling.cuh) one batch row at a time,
    float32 arithmetic as on the GPU; writes the rejected proposals' mass into draft_probs as it does."""
    f32 = torch.float32
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    vocab = target_probs.shape[-1]
    thr_acc = torch.tensor(max(threshold_acc, 1e-9), dtype=f32)
    thr_single = torch.tensor(threshold_single, dtype=f32)
    for b in range(bs):
        prob_acc = torch.zeros((), dtype=f32)
        row = 0
        coin = coins[b, 0]
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        num = 0
        cur = 0
        for _ in range(1, steps):
            cur = int(next_token[b, cur])
            while cur != -1:
                token = int(candidates[b, cur])
                p = target_probs[b, row, token]
                prob_acc = prob_acc + p
                if p > 0 and (coin < prob_acc / thr_acc or p >= thr_single):
                    prob_acc = torch.zeros((), dtype=f32)
                    row = cur
                    coin = coins[b, cur]
                    predicts[last] = token
                    num += 1
                    last = int(retrive_index[b, cur])
                    accept_index[b, num] = last
                    break
                draft_probs[b, row, token] = target_probs[b, row, token]
                cur = int(next_sibling[b, cur])
            if cur == -1:
                break
        accept_num[b] = num
        q = target_probs[b, row]
        p = draft_probs[b, row] if num != steps - 1 else torch.zeros_like(q)
        residual = (q - p).clamp_min(0)
        u = final_coins[b] * residual.sum()
        sampled, aggregate, last_valid = vocab, torch.zeros((), dtype=f32), -1
        for i in range(vocab):
            if residual[i] > 0:
                last_valid = i
            aggregate = aggregate + residual[i]
            if sampled == vocab and residual[i] > 0 and aggregate > u:
                sampled = i
        predicts[last] = sampled if sampled < vocab else (last_valid if last_valid >= 0 else vocab - 1)


def _random_trees(bs: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """next_token / next_sibling [bs, n] of random trees over nodes 0..n-1 (node 0 the root), each
    node's parent drawn among the nodes before it, siblings linked in a random order."""
    next_token = torch.full((bs, n), -1, dtype=torch.long)
    next_sibling = torch.full((bs, n), -1, dtype=torch.long)
    for b in range(bs):
        children: dict[int, list[int]] = {}
        for node in range(1, n):
            children.setdefault(int(torch.randint(0, node, (1,), generator=gen)), []).append(node)
        for parent, kids in children.items():
            kids = [kids[i] for i in torch.randperm(len(kids), generator=gen).tolist()]
            next_token[b, parent] = kids[0]
            for a, c in zip(kids, kids[1:]):
                next_sibling[b, a] = c
    return next_token, next_sibling


def _verify_case(bs: int, n: int, vocab: int, steps: int, seed: int, zeros: bool, draft: bool):
    gen = torch.Generator().manual_seed(seed)
    next_token, next_sibling = _random_trees(bs, n, gen)
    # few distinct tokens, so siblings often propose the same or likely tokens and the walk goes deep
    candidates = torch.randint(0, min(vocab, 6), (bs, n), generator=gen)
    probs = (torch.randn(bs, n, vocab, generator=gen) * 2).softmax(-1)
    if zeros:  # top-k-like zeros: proposals without target mass
        probs = top_k_renorm_prob(probs.view(bs * n, vocab), 3).view(bs, n, vocab)
    draft_probs = torch.rand(bs, n, vocab, generator=gen) * 0.1 if draft else torch.zeros(bs, n, vocab)
    return dict(
        candidates=candidates,
        retrive_index=torch.arange(bs * n).view(bs, n),
        retrive_next_token=next_token,
        retrive_next_sibling=next_sibling,
        uniform_samples=torch.rand(bs, n, generator=gen),
        uniform_samples_for_final_sampling=torch.rand(bs, generator=gen),
        target_probs=probs,
        draft_probs=draft_probs,
    )


def _outputs(bs: int, n: int, steps: int, device: str = "cpu"):
    return (
        torch.full((bs * n,), -1, dtype=torch.int32, device=device),
        torch.full((bs, steps), -1, dtype=torch.int32, device=device),
        torch.full((bs,), -7, dtype=torch.int32, device=device),
    )


@pytest.mark.parametrize(
    ("n", "vocab", "steps", "zeros", "draft", "thresholds"),
    [
        (1, 7, 1, False, False, (1.0, 1.0)),  # no proposal at all: the bonus token alone
        (4, 9, 4, False, False, (1.0, 1.0)),  # chains and shallow trees, the walk can reach full depth
        (8, 12, 3, True, False, (1.0, 1.0)),  # zero-mass proposals, depth cut below the tree's
        (12, 16, 6, False, True, (1.0, 1.0)),  # a draft distribution subtracted from the residual
        (10, 10, 5, True, False, (0.3, 0.6)),  # SGLang's relaxed acceptance thresholds
    ],
)
def test_sampler_equals_a_port_of_sglangs_kernel(n, vocab, steps, zeros, draft, thresholds):
    bs = 64
    case = _verify_case(bs, n, vocab, steps, seed=n * 100 + vocab, zeros=zeros, draft=draft)
    single, acc = thresholds
    want = _outputs(bs, n, steps)
    reference_case = {k: v.clone() for k, v in case.items()}
    _kernel_reference(*want, *reference_case.values(), threshold_single=single, threshold_acc=acc)
    got = _outputs(bs, n, steps)
    draft_before = case["draft_probs"].clone()
    tree_speculative_sampling_target_only(*got, **case, threshold_single=single, threshold_acc=acc)
    for name, g, w in zip(("predicts", "accept_index", "accept_token_num"), got, want):
        assert torch.equal(g, w), f"{name} differs:\n{g}\n{w}"
    assert torch.equal(case["draft_probs"], draft_before)  # read only
    if steps > 1 and n > 1:
        assert 0 < int(want[2].sum()) < bs * (steps - 1)  # some accepted, some rejected: not vacuous


def test_sampler_takes_sglangs_int32_outputs_and_int64_links_on_a_batch_of_one():
    case = _verify_case(1, 5, 8, 3, seed=3, zeros=False, draft=False)
    case = {k: (v.int() if k == "retrive_index" else v) for k, v in case.items()}  # int32 rows work too
    got, want = _outputs(1, 5, 3), _outputs(1, 5, 3)
    _kernel_reference(*want, *{k: v.clone() for k, v in case.items()}.values())
    tree_speculative_sampling_target_only(*got, **case)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    tree_speculative_sampling_target_only(*_outputs(0, 5, 3), **{k: v[:0] for k, v in case.items()})  # empty batch


def test_committed_tokens_follow_the_top_k_top_p_target_on_a_two_level_tree():
    """The first two committed tokens, over 40,000 draws, against the exact target joint after SGLang's
    top-k and top-p renormalisation (chi-square): x1 ~ q0; after a proposal x1 (accepted), x2 ~ q_x1."""
    from scipy.stats import chisquare

    vocab, bs = 8, 40_000
    A, B, C, D = 1, 2, 3, 5  # root -> A, B (siblings); A -> C, D
    n = 5
    candidates = torch.tensor([0, A, B, C, D]).repeat(bs, 1)
    next_token = torch.tensor([1, 3, -1, -1, -1]).repeat(bs, 1)
    next_sibling = torch.tensor([-1, 2, -1, 4, -1]).repeat(bs, 1)
    logits = torch.tensor(
        [
            [0.5, 1.2, 0.9, 0.1, 0.4, 0.8, -0.5, 0.3],  # after the root
            [0.2, 0.1, 0.3, 1.5, 0.2, 0.9, 0.7, -1.0],  # after A
            [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0],  # after B
            [0.0] * 8,
            [0.0] * 8,
        ]
    )
    rows = logits.softmax(-1).repeat(bs, 1)  # [bs * n, vocab], as SGLang hands them to the renorm ops
    probs = top_p_renorm_prob(top_k_renorm_prob(rows, 6), 0.9).view(bs, n, vocab)
    predicts, accept_index, accept_num = _outputs(bs, n, 3)
    gen = torch.Generator().manual_seed(0)
    tree_speculative_sampling_target_only(
        predicts, accept_index, accept_num, candidates, torch.arange(bs * n).view(bs, n), next_token, next_sibling,
        torch.rand(bs, n, generator=gen), torch.rand(bs, generator=gen), probs, torch.zeros_like(probs),
    )  # fmt: skip
    q0, qa, qb = probs[0, 0], probs[0, 1], probs[0, 2]
    first = predicts.view(bs, n)[:, 0].long()
    nodes = torch.tensor([-1] * vocab)
    nodes[A], nodes[B] = 1, 2
    # x2: at the accepted node's row (its retrive_index), vocab ("no second token") after a bonus x1
    at_node = nodes[first]
    second = torch.where(
        at_node >= 0, predicts.view(bs, n).gather(1, at_node.clamp(min=0)[:, None]).squeeze(1).long(), vocab
    )
    observed = torch.bincount(first * (vocab + 1) + second, minlength=vocab * (vocab + 1)).double()
    expected = torch.zeros(vocab, vocab + 1, dtype=torch.float64)
    expected[:, vocab] = q0.double()
    expected[A, vocab], expected[B, vocab] = 0.0, 0.0
    expected[A, :vocab] = q0[A].double() * qa.double()
    expected[B, :vocab] = q0[B].double() * qb.double()
    expected = expected.flatten() / expected.sum() * bs  # float32 rows sum to 1 only within rounding
    support = expected > 0
    assert float(observed[~support].sum()) == 0.0  # nothing outside the top-k / top-p support
    assert bool((expected[support] >= 5).all())
    stat, p_value = chisquare(observed[support], expected[support])
    assert p_value > 1e-3, (stat, p_value)
    proposed_first = (first == A) | (first == B)
    proposed_second = (first == A) & ((second == C) | (second == D))
    assert torch.equal(accept_num.long(), proposed_first.long() + proposed_second.long())


# --- device-agnostic and free of host syncs ---------------------------------------------------


def _all_ops_on(device: str):
    """Inputs on `device` for every op; returns the call that runs them all."""
    bs, n, vocab, steps = 4, 6, 32, 4
    case = _verify_case(bs, n, vocab, steps, seed=1, zeros=True, draft=False)
    case = {k: v.to(device) for k, v in case.items()}
    rows = case["target_probs"].reshape(bs * n, vocab)
    top_ks, top_ps = torch.full((bs * n,), 5, device=device), torch.full((bs * n, 1), 0.8, device=device)
    outputs = _outputs(bs, n, steps, device)

    def run() -> None:
        top_k_renorm_prob(rows, top_ks)
        top_k_renorm_prob(rows, 5)
        top_p_renorm_prob(rows, top_ps)
        top_p_renorm_prob(rows, 0.8)
        tree_speculative_sampling_target_only(*outputs, **case)

    return run


def test_every_op_runs_on_the_meta_device():
    """A meta tensor has no values: any host read (.item(), .tolist(), bool(), nonzero()) raises, and so
    does mixing in a tensor made on the host."""
    _all_ops_on("meta")()


def test_no_host_read_during_the_ops(monkeypatch):
    run = _all_ops_on("cpu")

    def refuse(*args, **kwargs):
        raise AssertionError("a host read inside a sampling op")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    monkeypatch.setattr(torch, "nonzero", refuse)
    monkeypatch.setattr(torch, "masked_select", refuse)
    run()


def test_the_module_imports_only_torch():
    """What a GPU stand-in for sgl_kernel / flashinfer imports: no SGLang, nothing installed."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from sglang_tts.platform.cpu.spec_sampling import (\n"
        "    top_k_renorm_prob, top_p_renorm_prob, tree_speculative_sampling_target_only)\n"
        "prefixes = ('sglang.', 'sgl_kernel', 'flashinfer')\n"
        "bad = sorted(m for m in sys.modules if m == 'sglang' or m.startswith(prefixes))\n"
        "assert not bad, bad\n"
        "import os; assert 'SGLANG_USE_CPU_ENGINE' not in os.environ\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
