"""Tiny random target models (Llama, Qwen2 and Qwen3 layouts) with a real tokenizer, for the smoke benchmark
and the tests.

They are saved exactly as a Hugging Face checkpoint folder (config.json, model.safetensors,
tokenizer files with a chat template), so SGLang serves them and transformers loads them.
Weights are random but drawn with a larger scale than HF's default so next-token distributions
are peaked: greedy decoding is then robust to fp32 summation-order noise between engines.
"""

from __future__ import annotations

import json
import pathlib
import sysconfig
from dataclasses import dataclass

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]


@dataclass
class TinyTargetSpec:
    arch: str = "llama"  # "llama" | "qwen2" | "qwen3"
    vocab_size: int = 1024
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096
    init_std: float = 0.25
    # Std of the transformer layers' weights; None: init_std. A small value makes the model nearly
    # a bigram model whose greedy output settles into a short cycle: repetitive long outputs, the
    # regime where test-time adaptation pays off quickly (used by the TTS serving tests).
    layer_std: float | None = None
    seed: int = 0


def _training_text(limit_files: int = 120) -> list[str]:
    """Deterministic text for the tokenizer: the Python standard library's own sources."""
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py"))[:limit_files]
    return [p.read_text(errors="ignore") for p in files]


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer with chat special tokens, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def hf_config(spec: TinyTargetSpec, tokenizer) -> dict:
    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.hidden_size // spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        hidden_act="silu",
        initializer_range=spec.init_std,
    )
    if spec.arch == "llama":
        return dict(common, architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False)
    if spec.arch == "qwen2":  # q/k/v projections with bias, as Qwen2.5
        return dict(common, architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    if spec.arch == "qwen3":
        return dict(common, architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False)
    raise ValueError(f"unknown tiny target arch {spec.arch!r} (llama | qwen2 | qwen3)")


def write_tiny_target(out_dir: str | pathlib.Path, spec: TinyTargetSpec | None = None) -> pathlib.Path:
    """Write a tiny random target model folder; returns its path. Deterministic in `spec.seed`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = spec or TinyTargetSpec()
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size)
    cfg_dict = hf_config(spec, tokenizer)
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    config = AutoConfig.from_pretrained(out)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name or "norm" in name.split(".")[-2]:
                p.fill_(1.0)
            elif name.startswith("model.layers.") and spec.layer_std is not None:
                p.normal_(0.0, spec.layer_std)
            else:
                p.normal_(0.0, spec.init_std)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
