"""The torch-native TARGET_VERIFY and EXTEND attention: visibility rules against hand-built masks and SGLang."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from sglang.srt.layers.radix_attention import AttentionType

from sglang_tts.platform.cpu.attention import (
    _sdpa,
    extend_mask,
    extend_plan,
    forward_extend_prefix_aware,
    target_verify_mask,
    verify_plan,
)


def test_chain_is_causal_over_drafts_and_sees_whole_prefix():
    spec = SimpleNamespace(tree_topk=1, custom_mask=None)
    m = target_verify_mask(prefix_len=3, n=4, spec_info=spec, request_index=0, bidirectional=False)
    assert m.shape == (4, 7)
    assert m[:, :3].all()
    assert torch.equal(m[:, 3:], torch.ones(4, 4, dtype=torch.bool).tril())


def test_tree_uses_the_requests_own_qlen_block():
    n = 3
    # request 0: a chain; request 1: root with two children (1 and 2 both see only the root and themselves)
    r0 = torch.ones(n, n, dtype=torch.bool).tril()
    r1 = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    spec = SimpleNamespace(tree_topk=2, custom_mask=torch.cat([r0.flatten(), r1.flatten()]))
    m = target_verify_mask(prefix_len=2, n=n, spec_info=spec, request_index=1, bidirectional=False)
    assert m[:, :2].all()
    assert torch.equal(m[:, 2:], r1)


def test_bidirectional_block_sees_everything():
    spec = SimpleNamespace(tree_topk=1, custom_mask=None)
    assert target_verify_mask(5, 4, spec, 0, bidirectional=True).all()


def test_sdpa_matches_explicit_softmax_attention_with_gqa_and_mask():
    torch.manual_seed(0)
    n, L, hq, hkv, d = 3, 5, 4, 2, 8
    q, k, v = torch.randn(n, hq, d), torch.randn(L, hkv, d), torch.randn(L, hkv, d)
    mask = torch.rand(n, L) > 0.3
    mask[:, 0] = True
    out = _sdpa(q, k, v, mask, scale=0.5, gqa=True)
    kk, vv = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, kk) * 0.5
    scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
    ref = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), vv)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_verify_plan_is_built_once_per_forward_and_rebuilt_for_new_contents():
    req_to_token = torch.arange(40, dtype=torch.int32).view(2, 20)
    spec = SimpleNamespace(tree_topk=1, custom_mask=None)
    batch = SimpleNamespace(seq_lens=torch.tensor([3, 5]), req_pool_indices=torch.tensor([1, 0]), spec_info=spec)
    plan = verify_plan(batch, req_to_token, 4, False, "cpu")
    assert verify_plan(batch, req_to_token, 4, False, "cpu") is plan  # the next layer reuses it
    (rows0, slots0, mask0), (rows1, slots1, mask1) = plan
    assert rows0 == slice(0, 4) and rows1 == slice(4, 8)  # each request's draft tokens, back to back
    assert slots0.dtype == torch.long and torch.equal(slots0, torch.arange(20, 27))
    assert torch.equal(slots1, torch.arange(0, 9))
    assert torch.equal(mask0, target_verify_mask(3, 4, spec, 0, False))
    assert torch.equal(mask1, target_verify_mask(5, 4, spec, 1, False))

    batch.seq_lens = torch.tensor([4, 5])  # the same object with other contents: a fresh plan
    again = verify_plan(batch, req_to_token, 4, False, "cpu")
    assert again is not plan and torch.equal(again[0][1], torch.arange(20, 28))
    assert all(m.all() for _, _, m in verify_plan(batch, req_to_token, 4, True, "cpu"))


def _stock_extend(q, k_cache, v_cache, req_to_token, pools, seq_lens, prefix_lens, causal, window, scale):
    """SGLang's own padded extend attention (the reference the prefix-aware path must equal)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    owner = SimpleNamespace(_make_sliding_window_mask=TorchNativeAttnBackend._make_sliding_window_mask)
    out = torch.zeros_like(q)
    TorchNativeAttnBackend._run_sdpa_forward_extend(
        owner,
        q,
        out,
        k_cache,
        v_cache,
        req_to_token,
        pools,
        seq_lens,
        prefix_lens,
        seq_lens - prefix_lens,
        scaling=scale,
        enable_gqa=True,
        causal=causal,
        sliding_window_size=window,
    )
    return out


def _extend_batch(seq_lens, prefix_lens, pools):
    seq_lens, prefix_lens = torch.tensor(seq_lens), torch.tensor(prefix_lens)
    return SimpleNamespace(seq_lens=seq_lens, extend_prefix_lens=prefix_lens, req_pool_indices=torch.tensor(pools))


def test_extend_mask_offsets_the_causal_rule_by_the_prefix():
    assert extend_mask(0, 4, None) is None  # plain causal prefill: SDPA's own mask
    m = extend_mask(3, 2, None)
    assert torch.equal(m, torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool))
    w = extend_mask(3, 2, sliding_window=1)  # position 3 sees 2..3, position 4 sees 3..4
    assert torch.equal(w, torch.tensor([[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool))


def test_prefix_aware_extend_equals_sglangs_padded_extend():
    """Prefill, extend after a prefix, draft-extend of a few tokens, sliding window, encoder-only."""
    torch.manual_seed(0)
    hq, hkv, d, pool_rows, width = 4, 2, 8, 3, 40
    k_cache, v_cache = torch.randn(pool_rows * width, hkv, d), torch.randn(pool_rows * width, hkv, d)
    req_to_token = torch.randperm(pool_rows * width).view(pool_rows, width).int()
    batch = _extend_batch(seq_lens=[7, 30, 12], prefix_lens=[0, 26, 5], pools=[2, 0, 1])
    q = torch.randn(int((batch.seq_lens - batch.extend_prefix_lens).sum()), hq, d)
    pool = SimpleNamespace(get_key_buffer=lambda layer_id: k_cache, get_value_buffer=lambda layer_id: v_cache)
    backend = SimpleNamespace(
        token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), swa_out_cache_loc=None
    )
    for causal, window in [(True, None), (True, 4), (False, None)]:
        ref = _stock_extend(
            q,
            k_cache,
            v_cache,
            req_to_token,
            batch.req_pool_indices,
            batch.seq_lens,
            batch.extend_prefix_lens,
            causal,
            window,
            0.3,
        )
        layer = SimpleNamespace(
            attn_type=AttentionType.DECODER if causal else AttentionType.ENCODER_ONLY,
            sliding_window_size=-1 if window is None else window,
            tp_q_head_num=hq,
            tp_k_head_num=hkv,
            qk_head_dim=d,
            v_head_dim=d,
            layer_id=0,
            scaling=0.3,
        )
        out = forward_extend_prefix_aware(backend, q.flatten(1), None, None, layer, batch, save_kv_cache=False)
        torch.testing.assert_close(out.view_as(q), ref, atol=1e-5, rtol=1e-5)
    assert extend_plan(batch, req_to_token, True, None, "cpu") is extend_plan(batch, req_to_token, True, None, "cpu")
