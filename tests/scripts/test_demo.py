"""scripts/demo.py picks the newest trained EAGLE-3 drafter for the model, never its own untrained one."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _demo():
    spec = importlib.util.spec_from_file_location("demo_script", REPO / "scripts" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _checkpoint(folder: Path, mtime: float) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x")
    os.utime(folder / "model.safetensors", (mtime, mtime))


def test_the_newest_trained_drafter_wins_and_the_untrained_one_is_never_picked(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_TTS_CACHE", str(tmp_path))
    demo = _demo()
    model = Path("/models/SmolLM2-135M-Instruct")
    drafters = tmp_path / "drafters"
    _checkpoint(drafters / "untrained-SmolLM2-135M-Instruct-eagle3-v2", time.time())
    assert demo.trained_drafter(model) is None
    _checkpoint(drafters / "SmolLM2-135M-Instruct-eagle3-len256", time.time() - 100)
    _checkpoint(drafters / "SmolLM2-135M-Instruct-eagle3-len512", time.time() - 10)
    _checkpoint(drafters / "SmolLM2-135M-Instruct-dflash-len256", time.time())
    (drafters / "SmolLM2-135M-Instruct-eagle3-len128").mkdir()  # interrupted: no weights yet
    assert demo.trained_drafter(model) == drafters / "SmolLM2-135M-Instruct-eagle3-len512"
