"""Which drafter layers per-request adapters adapt (sglang/adapters.py: adapted_layers).

The do-no-harm guard scores the base drafter on each update's canvas, reading the context K/V in
SGLang's draft KV pool. Those K/V are written by the request's drafter: if its adapter reaches the
layers that write them (fc, k_proj, v_proj, or any layer before the last), a broken adapter corrupts
the context the base drafter is scored on, and the guard cannot see the harm (measured on the Qwen
testbed: docs/update-cost.md). By default an EAGLE-3 adapter leaves the context K/V exactly the base
drafter's, whatever its weights; `--tts-adapter-kv on` adapts the K/V writers too.
"""

from __future__ import annotations

import pytest
import torch

from sglang_tts.config import TTSConfig
from sglang_tts.drafters import load_drafter
from sglang_tts.drafters.checkpoints import write_tiny_eagle3
from sglang_tts.sglang.adapters import KV_WRITERS, adapters_from_config

TARGET = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 200,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": False,
}  # fmt: skip


def _drafter(tmp_path, num_layers: int):
    path = write_tiny_eagle3(tmp_path / f"eagle3-{num_layers}", TARGET, num_layers=num_layers)
    embedding = torch.randn(TARGET["vocab_size"], TARGET["hidden_size"], generator=torch.Generator().manual_seed(0))
    return load_drafter(path, target_embedding=embedding, target_config=TARGET)


def _context_kv(adapted, slots):
    gen = torch.Generator().manual_seed(1)
    drafter = adapted.base
    ids = torch.randint(0, TARGET["vocab_size"], (2, 6), generator=gen)
    features = torch.randn(2, 6, drafter.fc.in_features, generator=gen)
    positions = (3 + torch.arange(6)).expand(2, 6)
    adapted.active_slots = slots
    try:
        return drafter.kv_for_context(ids, features, positions)
    finally:
        adapted.active_slots = None


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("adapter_kv", [False, True])
def test_a_broken_adapter_leaves_the_context_kv_at_base_unless_told(tmp_path, num_layers, adapter_kv):
    adapted = adapters_from_config(
        _drafter(tmp_path, num_layers), TTSConfig(scope="request", max_adapted_requests=2, adapter_kv=adapter_kv)
    )
    names = [layer.name for layer in adapted.bank.layers]
    writers = [n for n in names if n.rsplit(".", 1)[-1] in KV_WRITERS]
    assert bool(writers) == adapter_kv
    assert "lm_head" in names and any(n.endswith("q_proj") for n in names)
    if num_layers > 1 and not adapter_kv:  # an earlier layer's output feeds the next layer's K/V
        assert all(n == "lm_head" or n.startswith(f"layers.{num_layers - 1}.") for n in names)
    base_kv = _context_kv(adapted, None)
    with torch.no_grad():  # break slot 0 the way a learning rate far too high would
        for b in adapted.bank.b:
            b.normal_(std=1.0, generator=torch.Generator().manual_seed(2))
    served_kv = _context_kv(adapted, torch.tensor([0, 0]))
    same = all(torch.equal(k0, k1) and torch.equal(v0, v1) for (k0, v0), (k1, v1) in zip(base_kv, served_kv))
    assert same == (not adapter_kv)
