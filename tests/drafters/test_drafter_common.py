"""Shared layers: RoPE against transformers' independent implementation, RMSNorm, attention."""

from __future__ import annotations

import pytest
import torch

from sglang_tts.drafters.common import (
    RMSNorm,
    RopeSpec,
    Rotary,
    RowGroups,
    UnsupportedDrafterConfigError,
    masked_attention,
)

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING])
def test_inverse_frequencies_match_transformers(scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.configuration_llama import LlamaConfig

    cfg = {
        "hidden_size": 256,
        "num_attention_heads": 4,
        "head_dim": 64,
        "max_position_embeddings": 512,
        "rope_theta": 500000.0,
    }
    if scaling is not None:
        cfg["rope_scaling"] = dict(scaling)
    hf = LlamaConfig(**cfg)
    if scaling is None:
        expected = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    # Both the v4 (rope_theta + rope_scaling) and v5 (rope_parameters) spellings parse the same.
    for spelling in (cfg, {k: v for k, v in hf.to_dict().items() if k not in ("rope_theta", "rope_scaling")}):
        spec = RopeSpec.from_config(spelling, default_max_position=8192)
        torch.testing.assert_close(spec.inv_freq(), expected.float())


def test_rotary_depends_on_relative_position_only_and_preserves_norms():
    torch.manual_seed(0)
    for neox in (True, False):
        rotary = Rotary(RopeSpec(head_dim=16, rotary_dim=16, theta=10000.0, neox_style=neox))
        q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)

        def score(pq: int, pk: int, rotary=rotary, q=q, k=k) -> torch.Tensor:
            return (rotary(q, torch.tensor([[pq]])) * rotary(k, torch.tensor([[pk]]))).sum(-1)

        torch.testing.assert_close(score(7, 3), score(104, 100), rtol=1e-4, atol=1e-5)
        assert not torch.allclose(score(7, 3), score(7, 5), atol=1e-4)
        torch.testing.assert_close(rotary(q, torch.tensor([[9]])).norm(dim=-1), q.norm(dim=-1))
    neox = Rotary(RopeSpec(16, 16, 10000.0, neox_style=True))(q, torch.tensor([[5]]))
    gptj = Rotary(RopeSpec(16, 16, 10000.0, neox_style=False))(q, torch.tensor([[5]]))
    assert not torch.allclose(neox, gptj)


def test_partial_rotary_and_linear_scaling():
    x = torch.randn(1, 1, 2, 16)
    partial = Rotary(
        RopeSpec.from_config(
            {"hidden_size": 64, "num_attention_heads": 4, "partial_rotary_factor": 0.5}, default_max_position=8192
        )
    )
    out = partial(x, torch.tensor([[3, 8]]))
    torch.testing.assert_close(out[..., 8:], x[..., 8:])  # the non-rotary half passes through
    linear_cfg = {"hidden_size": 64, "num_attention_heads": 4, "rope_scaling": {"type": "linear", "factor": 4.0}}
    linear = Rotary(RopeSpec.from_config(linear_cfg, default_max_position=8192))
    plain = Rotary(RopeSpec(16, 16, 10000.0))
    torch.testing.assert_close(linear(x, torch.tensor([[8, 12]])), plain(x, torch.tensor([[2, 3]])))
    with pytest.raises(UnsupportedDrafterConfigError, match="dynamic"):
        RopeSpec.from_config(
            {"hidden_size": 64, "num_attention_heads": 4, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            default_max_position=8192,
        )


def test_rmsnorm_fused_residual():
    norm = RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 8))
    x, r = torch.randn(3, 8), torch.randn(3, 8)
    normed, summed = norm(x, r)
    torch.testing.assert_close(summed, x + r)
    s = x + r
    torch.testing.assert_close(normed, s / s.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * norm.weight)


def test_grouped_query_attention_uses_kv_head_of_its_group():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 2, 8)
    k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    visible = torch.tensor([[[True, True, False], [True, True, True]]])
    out = masked_attention(q, k, v, visible, 8**-0.5).view(1, 2, 4, 8)
    for head in range(4):
        kv = head // 2
        scores = (q[0, head] @ k[0, kv].T) * 8**-0.5
        scores = scores.masked_fill(~visible[0], float("-inf"))
        torch.testing.assert_close(out[0, :, head], torch.softmax(scores, -1) @ v[0, kv])


def test_attention_over_kv_segments_equals_attention_over_the_joined_keys():
    # An update's unroll attends to the context and to each step's own K/V as separate segments:
    # the same values and gradients as one joined cache.
    torch.manual_seed(2)
    q = torch.randn(2, 6, 3, 8, requires_grad=True)
    context = [torch.randn(2, 2, 9, 8) for _ in range(2)]  # detached, as a canvas's past_kv
    own = [torch.randn(2, 2, 2, 8, requires_grad=True) for _ in range(2)]
    new = [torch.randn(2, 2, 3, 8, requires_grad=True) for _ in range(2)]
    visible = torch.rand(2, 3, 14) < 0.5
    visible[:, :, -1] = True
    ks, vs = [context[0], own[0], new[0]], [context[1], own[1], new[1]]
    out = masked_attention(q, ks, vs, visible, 8**-0.5)
    joined = masked_attention(q, torch.cat(ks, 2), torch.cat(vs, 2), visible, 8**-0.5)
    torch.testing.assert_close(out, joined)
    grad = torch.randn_like(out)
    leaves = (q, *own, *new)
    for a, b in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(joined, leaves, grad)):
        torch.testing.assert_close(a, b)


def test_a_segment_of_batch_one_is_every_rows_context():
    # A window at one request: every row reads one copy of the request's context (batch 1), with
    # its own mask; the values and gradients of that context expanded to every row.
    torch.manual_seed(4)
    q = torch.randn(5, 6, 3, 8, requires_grad=True)
    context = [torch.randn(1, 2, 9, 8) for _ in range(2)]  # one request's, detached
    new = [torch.randn(5, 2, 3, 8, requires_grad=True) for _ in range(2)]
    visible = torch.rand(5, 3, 12) < 0.5
    visible[:, :, -1] = True
    out = masked_attention(q, [context[0], new[0]], [context[1], new[1]], visible, 8**-0.5)
    copies = [c.expand(5, -1, -1, -1).clone() for c in context]
    expected = masked_attention(q, [copies[0], new[0]], [copies[1], new[1]], visible, 8**-0.5)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    leaves = (q, *new)
    for a, b in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(expected, leaves, grad)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "entry_of_row",
    [[1, 0, 0, 1, 2], [0, 0, 1, 1, 2], [2, 0, 1], [0, 1, 2]],
    ids=["scattered", "grouped", "as-many-rows-as-entries", "row-i-reads-entry-i"],
)
def test_a_segment_of_one_entry_per_request_is_each_rows_requests_context(entry_of_row):
    # The rows of a window at several requests: the first segment holds one context per request and
    # each row reads its request's (RowGroups), with the values and gradients of a copy per row.
    torch.manual_seed(5)
    b = len(entry_of_row)
    q = torch.randn(b, 6, 2, 8, requires_grad=True)
    context = [torch.randn(3, 2, 9, 8) for _ in range(2)]  # three requests', detached
    new = [torch.randn(b, 2, 2, 8, requires_grad=True) for _ in range(2)]
    visible = torch.rand(b, 2, 11) < 0.5
    visible[:, :, -1] = True
    groups = RowGroups.of(entry_of_row, "cpu")
    assert sum(groups.sizes) == b and (groups.order is None) == (entry_of_row == sorted(entry_of_row))
    out = masked_attention(q, [context[0], new[0]], [context[1], new[1]], visible, 8**-0.5, groups)
    copies = [c[entry_of_row] for c in context]  # [B, H_kv, L, D], what stacking used to gather
    expected = masked_attention(q, [copies[0], new[0]], [copies[1], new[1]], visible, 8**-0.5)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    leaves = (q, *new)
    for a, b_ in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(expected, leaves, grad)):
        torch.testing.assert_close(a, b_)


def test_a_segment_in_another_dtype_is_read_as_it_is_and_the_output_keeps_the_new_rows_dtype():
    # A past kept in bf16 beside fp32 rows: the segment is not cast (its probabilities are), and the
    # result is the joined fp32 attention's up to bf16 rounding of those probabilities.
    torch.manual_seed(3)
    q = torch.randn(1, 4, 2, 8)
    past = [torch.randn(1, 2, 5, 8).bfloat16() for _ in range(2)]
    new = [torch.randn(1, 2, 2, 8) for _ in range(2)]
    visible = torch.ones(1, 2, 7, dtype=torch.bool)
    out = masked_attention(q, [past[0], new[0]], [past[1], new[1]], visible, 8**-0.5)
    joined = masked_attention(
        q, torch.cat((past[0].float(), new[0]), 2), torch.cat((past[1].float(), new[1]), 2), visible, 8**-0.5
    )
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, joined, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (7, 1)])
def test_grouped_query_attention_reads_the_shared_kv_without_repeating_it(heads):
    # Values and gradients of the repeat_interleave formulation, with K/V an expanded view (as an
    # update's stacked rounds pass one request's context): nothing writes into it, nothing copies it.
    torch.manual_seed(1)
    h_q, h_kv = heads
    q = torch.randn(2, h_q, 3, 8, requires_grad=True)
    k_one, v_one = torch.randn(1, h_kv, 7, 8), torch.randn(1, h_kv, 7, 8)
    k, v = k_one.expand(2, -1, -1, -1).requires_grad_(), v_one.expand(2, -1, -1, -1).requires_grad_()
    visible = torch.rand(2, 3, 7) < 0.6
    visible[:, :, -1] = True
    out = masked_attention(q, k, v, visible, 8**-0.5)
    groups = h_q // h_kv
    scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) * 8**-0.5
    probs = torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), -1)
    expected = (probs @ v.repeat_interleave(groups, 1)).transpose(1, 2).flatten(2)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
