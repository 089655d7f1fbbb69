"""Drafter weights: seeded initialisation, and export in the public checkpoint layouts.

The exported folders are what ``sglang_tts.drafters.checkpoints`` writes for random
drafters (same config builders, same ``save_checkpoint``): EAGLE-3 with layer 0 under
``midlayer.*`` (SafeAILab / SpecForge layout) plus ``d2t``/``t2d``, DFlash with ``layers.*``,
``fc``, ``hidden_norm``, ``norm`` and no embedding or LM head.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from sglang_tts.drafters.checkpoints import save_checkpoint
from sglang_tts.drafters.common import RMSNorm
from sglang_tts.drafters.dflash import DFlashDrafter
from sglang_tts.drafters.eagle3 import Eagle3Drafter


@torch.no_grad()
def init_weights_(module: nn.Module, seed: int, std: float = 0.02) -> None:
    """Linear weights N(0, std) (HF initializer_range), biases 0, RMSNorm weights 1; seeded."""
    gen = torch.Generator().manual_seed(seed)
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            sub.weight.copy_(torch.randn(sub.weight.shape, generator=gen) * std)
            if sub.bias is not None:
                sub.bias.zero_()
        elif isinstance(sub, RMSNorm):
            sub.weight.fill_(1.0)


def eagle3_tensors(drafter: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """The drafter's checkpoint tensors, layer 0 renamed to `midlayer`. Layers > 0 get the
    `input_layernorm` SGLang's layer class owns but never calls (ones), as the random writer does."""
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in drafter.state_dict().items():
        if name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        tensors[name] = tensor.detach().clone()
    for i in range(1, drafter.cfg.num_hidden_layers):
        tensors[f"layers.{i}.input_layernorm.weight"] = torch.ones(drafter.cfg.hidden_size)
    return tensors


def dflash_tensors(drafter: DFlashDrafter) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in drafter.state_dict().items()}


def write_drafter(out: Path, drafter: Eagle3Drafter | DFlashDrafter, config: dict[str, Any]) -> Path:
    """config.json + model.safetensors for a trained drafter (fp32)."""
    tensors = eagle3_tensors(drafter) if isinstance(drafter, Eagle3Drafter) else dflash_tensors(drafter)
    tensors = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
    return save_checkpoint(Path(out), tensors, config, "safetensors")
