"""Tiny target configs, drafter checkpoints written in the public layouts, and canvas builders."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import pytest
import torch

from sglang_tts.core.canvas import Canvas
from sglang_tts.drafters import DFlashDrafter, Eagle3Drafter, load_drafter
from sglang_tts.drafters.checkpoints import write_tiny_dflash, write_tiny_eagle3

# Llama-shaped target: GQA 4/2, head_dim = hidden / heads.
LLAMA_TARGET = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 200,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
# Qwen3-shaped target: head_dim 32 != hidden / heads, 3 layers.
QWEN3_TARGET = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 160,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


def target_tensors(cfg: dict, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random target embedding and LM head [V, H]."""
    gen = torch.Generator().manual_seed(1000 + seed)
    v, h = cfg["vocab_size"], cfg["hidden_size"]
    return torch.randn(v, h, generator=gen), 0.1 * torch.randn(v, h, generator=gen)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("drafters")


@pytest.fixture(scope="module")
def eagle3(ckpt_dir) -> Eagle3Drafter:
    path = write_tiny_eagle3(ckpt_dir / "eagle3", LLAMA_TARGET, seed=0)
    embedding, _ = target_tensors(LLAMA_TARGET)
    return load_drafter(path, target_embedding=embedding, target_config=LLAMA_TARGET)


@pytest.fixture(scope="module")
def dflash(ckpt_dir) -> DFlashDrafter:
    path = write_tiny_dflash(ckpt_dir / "dflash", QWEN3_TARGET, block_size=4, num_layers=2, seed=0)
    embedding, lm_head = target_tensors(QWEN3_TARGET)
    return load_drafter(path, target_embedding=embedding, target_lm_head=lm_head, target_config=QWEN3_TARGET)


def eagle3_inputs(drafter: Eagle3Drafter, batch: int = 2, context: int = 5, length: int = 4, seed: int = 0) -> dict:
    """Context rows (for past_kv) and a chain canvas right after them."""
    gen = torch.Generator().manual_seed(seed)
    vocab, width = drafter.cfg.vocab_size, drafter.fc.in_features
    start = 3  # first context token sits at position 3 (an arbitrary prefix before it)
    ctx_ids = torch.randint(0, vocab, (batch, context), generator=gen)
    ctx_pos = (start + torch.arange(context)).expand(batch, context)
    ctx_feat = torch.randn(batch, context, width, generator=gen)
    canvas = Canvas(
        input_ids=torch.randint(0, vocab, (batch, length), generator=gen),
        positions=(start + context + torch.arange(length)).expand(batch, length).clone(),
        target_logits=torch.randn(batch, length, vocab, generator=gen),
        valid=torch.ones(batch, length, dtype=torch.bool),
        features=torch.randn(batch, width, generator=gen),
        past_kv=drafter.kv_for_context(ctx_ids, ctx_feat, ctx_pos),
        past_mask=torch.ones(batch, context, dtype=torch.bool),
    )
    return {"canvas": canvas, "ctx_ids": ctx_ids, "ctx_pos": ctx_pos, "ctx_feat": ctx_feat}


def dflash_canvas(drafter: DFlashDrafter, batch: int = 2, context: int = 6, length: int = 4, seed: int = 0) -> Canvas:
    """A block round anchored right after `context` committed tokens (positions 0..context-1)."""
    gen = torch.Generator().manual_seed(seed)
    vocab, width = drafter.cfg.vocab_size, drafter.fc.in_features
    return Canvas(
        input_ids=torch.randint(0, vocab - 1, (batch, length), generator=gen),
        positions=(context + torch.arange(length)).expand(batch, length).clone(),
        target_logits=torch.randn(batch, length, vocab, generator=gen),
        valid=torch.ones(batch, length, dtype=torch.bool),
        features=torch.randn(batch, context, width, generator=gen),
        context_positions=torch.arange(context).expand(batch, context).clone(),
        context_mask=torch.ones(batch, context, dtype=torch.bool),
    )


@pytest.fixture
def make_eagle3_inputs() -> Callable[..., dict]:
    return eagle3_inputs


@pytest.fixture
def make_dflash_canvas() -> Callable[..., Canvas]:
    return dflash_canvas


@pytest.fixture
def llama_target() -> dict:
    return dict(LLAMA_TARGET)


@pytest.fixture
def qwen3_target() -> dict:
    return dict(QWEN3_TARGET)


@pytest.fixture
def make_target_tensors() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    return target_tensors
