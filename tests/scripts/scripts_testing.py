"""Test helpers for tests/scripts (a uniquely named module, so `import` cannot pick up another test
directory's helpers)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def load_script(name: str, module_name: str | None = None) -> ModuleType:
    """Execute scripts/<name>.py afresh as a module (registered in sys.modules, where dataclasses
    resolve their module's annotations)."""
    spec = importlib.util.spec_from_file_location(module_name or name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def tiny_target_and_eagle3(root: Path) -> tuple[Any, Any, Any]:
    """A tiny nearly-bigram target (small layer weights: a greedy answer falls into a loop that a random
    drafter partly predicts) as `load_target` gives it, and a tiny EAGLE-3 drafter for it, under `root`:
    (the transformers model, its TargetWeights, the drafter in eval mode)."""
    from sglang_tts.bench.tiny_models import TinyTargetSpec, write_tiny_target
    from sglang_tts.drafters.checkpoints import write_tiny_eagle3
    from sglang_tts.drafters.loading import load_drafter
    from sglang_tts.training.target import load_target

    spec = TinyTargetSpec(vocab_size=512, num_hidden_layers=4, layer_std=0.02, init_std=0.6, seed=3)
    target_path = write_tiny_target(root / "tiny-target", spec)
    config = json.loads((target_path / "config.json").read_text())
    model, _, target = load_target(target_path)
    drafter_path = write_tiny_eagle3(root / "tiny-eagle3", config)
    drafter = load_drafter(drafter_path, target_embedding=target.embedding.float(), target_config=target.config)
    return model, target, drafter.eval()
