"""The ``--smoke`` setup: tiny offline models on which TTS measurably helps within a few hundred tokens.

The target is the "loopy" tiny Llama of the serving tests (nearly a bigram model: its greedy output
falls into a short cycle), the drafters are random EAGLE-3 (chain of 3) and DFlash (block 4)
drafters. The frozen drafters accept almost nothing; TTS at stride 1 and lr 1e-2 learns the cycle.
Defaults: frozen and tts-s1 for both kinds, two chat prompts (two one-prompt "datasets"), 256 greedy
tokens each with ``ignore_eos``; every ``scripts/bench_long.py`` flag still overrides them.
Nothing is downloaded; the models are written once into a cache folder (about 15 s).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from sglang_tts.assets import cache_root, file_lock
from sglang_tts.data.prompts import Prompt

# Version of what this module writes: bump it when the models change, so stale caches are rebuilt.
SMOKE_FORMAT = 1
READY = ".bench_smoke_ready.json"
# Two tiny "datasets" of chat prompts (sent through the OpenAI client like any other run). Whatever the
# prompt, the loopy target's greedy output falls into a short cycle within a few dozen tokens.
PROMPTS: tuple[Prompt, ...] = (
    Prompt("count-0", "smoke-count", "Count from one to twenty."),
    Prompt("story-0", "smoke-story", "Tell a very long story about a loop."),
)
KINDS = ("eagle3", "dflash")
# Unqualified names run for both kinds: 4 server starts (each costs 30-60 s on a 2-core CPU).
CONFIGS = ("frozen", "tts-s1")
MAX_NEW_TOKENS = 256
TTS_LR = 1e-2
WARMUP_TOKENS = 8
BUCKET = 32


@dataclass(frozen=True)
class SmokeModels:
    target: Path
    drafters: dict[str, Path]


def default_dir() -> Path:
    return cache_root() / "bench_smoke" / f"v{SMOKE_FORMAT}"


def prepare_smoke_models(out_dir: Path | None = None) -> SmokeModels:
    """Write (or reuse) the loopy target and its random EAGLE-3 and DFlash drafters."""
    from sglang_tts.bench.tiny_models import TinyTargetSpec, write_tiny_target
    from sglang_tts.drafters.checkpoints import write_tiny_dflash, write_tiny_eagle3

    out = Path(out_dir) if out_dir is not None else default_dir()
    models = SmokeModels(out / "loopy-llama", {"eagle3": out / "loopy-eagle3", "dflash": out / "loopy-dflash"})
    with file_lock(out.parent / f".{out.name}.lock"):
        if (out / READY).is_file():
            return models
        shutil.rmtree(out, ignore_errors=True)  # no marker: an interrupted attempt, start over
        out.mkdir(parents=True)
        write_tiny_target(models.target, TinyTargetSpec(layer_std=0.02, init_std=0.6, seed=3))
        target_config = json.loads((models.target / "config.json").read_text())
        write_tiny_eagle3(models.drafters["eagle3"], target_config, layout="layers.0", draft_vocab_size=1024)
        write_tiny_dflash(models.drafters["dflash"], target_config, block_size=4)
        (out / READY).write_text(json.dumps({"format": SMOKE_FORMAT}) + "\n")  # written last
    return models
