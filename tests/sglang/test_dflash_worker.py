"""Pieces of TTSDFlashWorker that need no server (the served behaviour is in test_tts_dflash_serving.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang_tts.sglang.dflash_worker import block_rows, refresh_fused_kv_weights


def test_block_rows_take_the_accepted_drafts_and_the_first_rejected_position():
    assert block_rows(4, [1, 3], "accepted") == [[0], [4, 5, 6]]
    assert block_rows(4, [1, 3], "full") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def _layers(num_layers=2, heads=2, kv_heads=1, head_dim=4, hidden=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    rotary = SimpleNamespace(rotary_dim=head_dim, is_neox_style=True)
    return [
        SimpleNamespace(
            self_attn=SimpleNamespace(
                qkv_proj=SimpleNamespace(weight=torch.randn(q_size + 2 * kv_size, hidden, generator=gen)),
                q_size=q_size,
                kv_size=kv_size,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rotary_emb=rotary,
                k_norm=SimpleNamespace(weight=torch.randn(head_dim, generator=gen), variance_epsilon=1e-6),
            )
        )
        for _ in range(num_layers)
    ]


def test_the_fused_context_kv_helper_sees_published_weights():
    """SGLang's fused helper (used on CUDA) stacks copies of the K/V projections at start-up; after
    a publish into the layers they are rewritten in place to what a fresh helper would hold."""
    from sglang.kernels.ops.speculative.fused_kv_materialize import FusedKVMaterializeHelper

    layers = _layers()

    def helper_for(ls):
        return FusedKVMaterializeHelper(ls, ls[0].self_attn.rotary_emb, 1, 4, torch.device("cpu"))

    helper = helper_for(layers)
    stacked, norms = helper.flat_kv_weight_t, helper.k_norm_weights
    for layer, new in zip(layers, _layers(seed=1)):  # the publish: param.copy_ into every layer
        layer.self_attn.qkv_proj.weight.copy_(new.self_attn.qkv_proj.weight)
        layer.self_attn.k_norm.weight.copy_(new.self_attn.k_norm.weight)
    assert not torch.equal(stacked, helper_for(layers).flat_kv_weight_t)

    refresh_fused_kv_weights(helper, layers)
    fresh = helper_for(layers)
    assert helper.flat_kv_weight_t is stacked and helper.k_norm_weights is norms  # in place
    assert torch.equal(helper.flat_kv_weight_t, fresh.flat_kv_weight_t)
    assert torch.equal(helper.k_norm_weights, fresh.k_norm_weights)
