"""scripts/ship_drafter.py: the newest finished drafter in the cache, copied compactly with its record."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors import safe_open
from scripts_testing import load_script


def _script():
    return load_script("ship_drafter", "ship_drafter_script")


def test_ships_the_trained_drafter_in_fp16_with_both_commands(tmp_path, monkeypatch, tiny_eagle3):
    monkeypatch.setenv("SGLANG_TTS_CACHE", str(tmp_path / "cache"))
    ship = _script()
    trained = tmp_path / "cache" / "drafters" / "T-eagle3-len256"
    with pytest.raises(SystemExit, match="no trained eagle3 drafter for T"):
        ship.main(["--target", "T", "--train-command", "x", "--dst", str(tmp_path / "out")])
    shutil.copytree(tiny_eagle3, trained)
    with pytest.raises(SystemExit, match="no train/summary.json"):
        ship.main(["--target", "T", "--train-command", "x", "--dst", str(tmp_path / "out")])
    (trained / "train").mkdir()
    (trained / "train" / "summary.json").write_text(json.dumps({"checkpoint": "/elsewhere", "steps": 3}))

    argv = ["--target", "T", "--train-command", "scripts/train_drafter.py --tiny", "--dst", str(tmp_path / "out")]
    assert ship.main(argv) == 0
    record = json.loads((tmp_path / "out" / "training.json").read_text())
    assert record["train_command"] == "scripts/train_drafter.py --tiny"
    assert record["ship_command"].startswith("scripts/ship_drafter.py --target T --train-command")
    assert record["summary"] == {"steps": 3}  # the training machine's checkpoint path is dropped
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert "F16" in {f.get_slice(k).get_dtype() for k in f.keys()}
