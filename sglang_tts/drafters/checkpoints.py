"""EAGLE-3 and DFlash drafter checkpoints in the public layouts: config builders, the writer, and
random drafters (the tests', the smoke benchmark's and the demo's untrained path).

The training pipeline exports trained drafters with the same config builders and `save_checkpoint`.
The random folders are what stock SGLang 0.5.23 loads with `--speculative-algorithm EAGLE3` /
`DFLASH` next to a tiny target (sglang_tts/bench/tiny_models.py):

- EAGLE-3: `LlamaForCausalLMEagle3`, model_type llama, one decoder layer under `midlayer.*`
  (SafeAILab / SpecForge) or `layers.0.*` (speculators-style), `fc`, `norm`, `lm_head` over a
  random draft vocabulary with consistent `d2t` / `t2d`, as `model.safetensors` or
  `pytorch_model.bin`. Fields SGLang reads (models/llama_eagle3.py, model_runner_components/
  spec_aux_hidden_state.py): draft_vocab_size, target_hidden_size, eagle_config
  {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state}, plus the Llama fields.
- DFlash: `DFlashDraftModel`, model_type qwen3, `layers.*` (with q_norm / k_norm), `fc`,
  `hidden_norm`, `norm`, no embedding or LM head. Fields SGLang reads
  (speculative/dflash_utils.py:parse_dflash_draft_config, models/dflash.py): block_size,
  num_target_layers, dflash_config {mask_token_id, target_layer_ids}, layer_types.

Layer ids are output-of-layer ids that SGLang can actually capture on an N-layer target: it
captures the input of layer id + 1, so ids must lie in [-1, N - 2] (DFlash: [0, N - 2]).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch

_TARGET_PASSTHROUGH = ("rope_theta", "rope_scaling", "rope_parameters", "bos_token_id", "eos_token_id", "pad_token_id")


def default_eagle3_aux_layer_ids(num_target_layers: int) -> list[int]:
    """Three distinct capturable output-of-layer ids (two on a 2-layer target).

    SGLang's own default (inputs of layers 2, N // 2, N - 3) collapses on tiny targets, so the
    tiny checkpoints always list their ids explicitly.
    """
    n = num_target_layers
    if n >= 4:
        return [0, (n - 2) // 2, n - 2]
    return list(range(-1, n - 1))[:3]


def default_dflash_target_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """`count` (at most N - 1) distinct ids spread over [0, N - 2]."""
    last = num_target_layers - 2
    count = max(1, min(count, last + 1))
    if count == 1:
        return [(num_target_layers - 1) // 2]
    return sorted({round(i * last / (count - 1)) for i in range(count)})


def draft_vocab_maps(used_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """d2t (draft id -> target id offset) and t2d (target id in the draft vocab) for the target ids
    `used_ids`, laid out the way EAGLE-3's scandata builds them: draft id i is the i-th smallest
    used target id, d2t[i] = used[i] - i."""
    used = torch.unique(used_ids.to(torch.int64))  # sorted, distinct
    if used.numel() != used_ids.numel():
        raise ValueError("draft vocabulary ids must be distinct")
    if used.numel() and not 0 <= int(used[0]) <= int(used[-1]) < vocab_size:
        raise ValueError(f"draft vocabulary ids must lie in [0, {vocab_size})")
    d2t = used - torch.arange(used.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def _draft_vocab(vocab_size: int, draft_vocab_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """d2t and t2d for a random subset of the target vocabulary."""
    return draft_vocab_maps(torch.randperm(vocab_size, generator=gen)[:draft_vocab_size], vocab_size)


def save_checkpoint(
    out: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any], fmt: str = "safetensors"
) -> Path:
    """Write `config.json` and the tensors (`model.safetensors` or `pytorch_model.bin`) into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, str(out / "model.safetensors"))
    elif fmt == "bin":
        torch.save(tensors, out / "pytorch_model.bin")
    else:
        raise ValueError(f"fmt must be 'safetensors' or 'bin', got {fmt!r}")
    return out


class _Init:
    """Deterministic random tensors: linear weights N(0, std), norm weights near 1."""

    def __init__(self, seed: int, std: float) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.std = std

    def linear(self, out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=self.gen) * self.std

    def norm(self, size: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(size, generator=self.gen)


def _dims(target_config: dict[str, Any]) -> dict[str, int]:
    """The Llama-style shape fields a drafter copies from its target."""
    h = int(target_config["hidden_size"])
    heads = int(target_config["num_attention_heads"])
    return {
        "hidden_size": h,
        "intermediate_size": int(target_config["intermediate_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(target_config.get("num_key_value_heads") or heads),
        "head_dim": int(target_config.get("head_dim") or h // heads),
    }


def eagle3_config(
    target_config: dict[str, Any],
    *,
    draft_vocab_size: int,
    aux_layer_ids: list[int],
    num_layers: int = 1,
) -> dict[str, Any]:
    """The config.json of an EAGLE-3 drafter for `target_config` (`LlamaForCausalLMEagle3`, the
    target's shapes, explicit output-of-layer `eagle_aux_hidden_state_layer_ids`)."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **_dims(target_config),
        "num_hidden_layers": int(num_layers),
        "max_position_embeddings": int(target_config.get("max_position_embeddings", 4096)),
        "rms_norm_eps": float(target_config.get("rms_norm_eps", 1e-6)),
        "vocab_size": int(target_config["vocab_size"]),
        "draft_vocab_size": int(draft_vocab_size),
        "target_hidden_size": int(target_config["hidden_size"]),
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True},
    }
    config.update({k: target_config[k] for k in _TARGET_PASSTHROUGH if target_config.get(k) is not None})
    return config


def dflash_config(
    target_config: dict[str, Any],
    *,
    block_size: int,
    num_layers: int,
    target_layer_ids: list[int],
    mask_token_id: int,
) -> dict[str, Any]:
    """The config.json of a DFlash drafter for `target_config` (`DFlashDraftModel`, the target's
    shapes, explicit `dflash_config.mask_token_id` and output-of-layer `target_layer_ids`)."""
    config: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **_dims(target_config),
        "num_hidden_layers": int(num_layers),
        "num_target_layers": int(target_config["num_hidden_layers"]),
        "block_size": int(block_size),
        "dflash_config": {"mask_token_id": int(mask_token_id), "target_layer_ids": list(target_layer_ids)},
        "layer_types": ["full_attention"] * int(num_layers),
        "max_position_embeddings": int(target_config.get("max_position_embeddings", 4096)),
        "rms_norm_eps": float(target_config.get("rms_norm_eps", 1e-6)),
        "vocab_size": int(target_config["vocab_size"]),
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    config.update({k: target_config[k] for k in _TARGET_PASSTHROUGH if target_config.get(k) is not None})
    return config


def write_tiny_eagle3(
    out_dir: str | Path,
    target_config: dict[str, Any],
    layout: Literal["midlayer", "layers.0"] = "midlayer",
    draft_vocab_size: int | None = None,
    seed: int = 0,
    fmt: Literal["safetensors", "bin"] = "safetensors",
    num_layers: int = 1,
    aux_layer_ids: list[int] | None = None,
    init_std: float = 0.05,
    draft_vocab: Literal["random", "first"] = "random",
) -> Path:
    """A random EAGLE-3 drafter for `target_config` (HF Llama/Qwen3 dict); returns its folder.

    `draft_vocab_size` defaults to half the target vocabulary: a random subset of ids, or with
    draft_vocab="first" the lowest ids (for BPE vocabularies a rough frequency order, since merges
    are numbered as they are learnt). Layer 0 is stored under `layout`; extra layers
    (num_layers > 1) always as `layers.N.*`.
    """
    vocab = int(target_config["vocab_size"])
    n_target = int(target_config["num_hidden_layers"])
    draft_vocab_size = int(draft_vocab_size) if draft_vocab_size is not None else vocab // 2
    aux_ids = list(aux_layer_ids) if aux_layer_ids is not None else default_eagle3_aux_layer_ids(n_target)
    config = eagle3_config(
        target_config, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_ids, num_layers=num_layers
    )
    h, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    init = _Init(seed, init_std)
    tensors: dict[str, torch.Tensor] = {"fc.weight": init.linear(h, len(aux_ids) * h)}
    for i in range(num_layers):
        prefix = layout if i == 0 else f"layers.{i}"
        attn_in = 2 * h if i == 0 else h
        tensors.update(
            {
                f"{prefix}.self_attn.q_proj.weight": init.linear(heads * head_dim, attn_in),
                f"{prefix}.self_attn.k_proj.weight": init.linear(kv_heads * head_dim, attn_in),
                f"{prefix}.self_attn.v_proj.weight": init.linear(kv_heads * head_dim, attn_in),
                f"{prefix}.self_attn.o_proj.weight": init.linear(h, heads * head_dim),
                f"{prefix}.mlp.gate_proj.weight": init.linear(inter, h),
                f"{prefix}.mlp.up_proj.weight": init.linear(inter, h),
                f"{prefix}.mlp.down_proj.weight": init.linear(h, inter),
                f"{prefix}.hidden_norm.weight": init.norm(h),
                f"{prefix}.input_layernorm.weight": init.norm(h),
                f"{prefix}.post_attention_layernorm.weight": init.norm(h),
            }
        )
    if draft_vocab == "first":
        d2t = torch.zeros(draft_vocab_size, dtype=torch.int64)
        t2d = torch.arange(vocab) < draft_vocab_size
    else:
        d2t, t2d = _draft_vocab(vocab, draft_vocab_size, init.gen)
    tensors.update(
        {"norm.weight": init.norm(h), "lm_head.weight": init.linear(draft_vocab_size, h), "d2t": d2t, "t2d": t2d}
    )
    return save_checkpoint(Path(out_dir), tensors, config, fmt)


def write_tiny_dflash(
    out_dir: str | Path,
    target_config: dict[str, Any],
    block_size: int = 4,
    num_layers: int = 1,
    target_layer_ids: list[int] | None = None,
    seed: int = 0,
    mask_token_id: int | None = None,
    fmt: Literal["safetensors", "bin"] = "safetensors",
    init_std: float = 0.05,
) -> Path:
    """A random DFlash drafter for `target_config`; returns its folder.

    `mask_token_id` defaults to the last target id (SGLang needs an explicit id inside the target
    vocabulary when the tokenizer has no `<|MASK|>`). `target_layer_ids` default: one per draft
    layer, spread over the capturable range.
    """
    vocab = int(target_config["vocab_size"])
    n_target = int(target_config["num_hidden_layers"])
    if target_layer_ids is None:
        target_layer_ids = default_dflash_target_layer_ids(n_target, num_layers)
    layer_ids = list(target_layer_ids)
    mask_id = int(mask_token_id) if mask_token_id is not None else vocab - 1
    config = dflash_config(
        target_config, block_size=block_size, num_layers=num_layers, target_layer_ids=layer_ids, mask_token_id=mask_id
    )
    h, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    init = _Init(seed, init_std)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(num_layers):
        p = f"layers.{i}"
        tensors.update(
            {
                f"{p}.self_attn.q_proj.weight": init.linear(heads * head_dim, h),
                f"{p}.self_attn.k_proj.weight": init.linear(kv_heads * head_dim, h),
                f"{p}.self_attn.v_proj.weight": init.linear(kv_heads * head_dim, h),
                f"{p}.self_attn.o_proj.weight": init.linear(h, heads * head_dim),
                f"{p}.self_attn.q_norm.weight": init.norm(head_dim),
                f"{p}.self_attn.k_norm.weight": init.norm(head_dim),
                f"{p}.mlp.gate_proj.weight": init.linear(inter, h),
                f"{p}.mlp.up_proj.weight": init.linear(inter, h),
                f"{p}.mlp.down_proj.weight": init.linear(h, inter),
                f"{p}.input_layernorm.weight": init.norm(h),
                f"{p}.post_attention_layernorm.weight": init.norm(h),
            }
        )
    tensors.update(
        {
            "fc.weight": init.linear(h, len(layer_ids) * h),
            "hidden_norm.weight": init.norm(h),
            "norm.weight": init.norm(h),
        }
    )
    return save_checkpoint(Path(out_dir), tensors, config, fmt)
