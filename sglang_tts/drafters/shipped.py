"""The drafters that ship with the package, and the compact copy that ships them.

A shipped drafter is a folder under ``sglang_tts/drafters/shipped/<target>-<kind>/`` in the public
layout SGLang loads (``config.json`` + ``model.safetensors``), its floating-point tensors stored in
fp16 to halve the download; SGLang's loader and :func:`sglang_tts.drafters.loading.load_drafter` cast
them to the server's dtype (fp32 on CPU) when they load. Beside them, ``training.json`` records the
commands that trained and shipped the folder and the training summary (held-out acceptance, timings),
and ``answers.safetensors``, the target's greedy answers the drafter was trained on (answer ids only), so
that training again on a fresh machine does not generate them again (hours on a 2-core CPU).

    python scripts/train_drafter.py --kind eagle3 ...          # writes the fp32 checkpoint to the cache
    python scripts/ship_drafter.py --kind eagle3               # the compact copy, into this folder
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from sglang_tts.drafters.checkpoints import save_checkpoint
from sglang_tts.drafters.loading import load_checkpoint_tensors, read_config

SHIPPED_ROOT = Path(__file__).resolve().parent / "shipped"
TRAINING_RECORD = "training.json"
ANSWERS = "answers.safetensors"  # the target's answers a drafter was trained on (training.data.export_answers)


def shipped_drafter(target_name: str, kind: str = "eagle3") -> Path | None:
    """The shipped drafter folder for the target model named `target_name` (its folder name), or None."""
    folder = SHIPPED_ROOT / f"{target_name}-{kind}"
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    return None


def shipped_answers(target_name: str) -> list[Path]:
    """The answer files shipped with the drafters of `target_name`: the target's greedy answers they were
    trained on, which training on a fresh machine then reuses instead of generating them again."""
    return sorted(SHIPPED_ROOT.glob(f"{target_name}-*/{ANSWERS}"))


def write_compact(
    src: Path, dst: Path, record: dict[str, Any] | None = None, dtype: torch.dtype = torch.float16
) -> Path:
    """Copy the checkpoint folder `src` to `dst` with its floating-point tensors cast to `dtype`
    (integer and bool tensors, e.g. EAGLE-3's `d2t` / `t2d`, are kept as they are). `record` is
    written beside it as training.json. Refuses a tensor that `dtype` cannot hold (overflow to inf)."""
    src, dst = Path(src), Path(dst)
    tensors = {}
    for name, tensor in load_checkpoint_tensors(src).items():
        if tensor.is_floating_point():
            cast = tensor.to(dtype)
            if not torch.isfinite(cast).all():
                raise ValueError(f"{src}: tensor {name} does not fit {dtype} (|max| {tensor.abs().max():.3g})")
            tensor = cast
        tensors[name] = tensor
    if dst.exists():
        shutil.rmtree(dst)
    save_checkpoint(dst, tensors, read_config(src), "safetensors")
    if record is not None:
        (dst / TRAINING_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return dst
