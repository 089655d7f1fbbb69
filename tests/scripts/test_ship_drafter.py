"""scripts/ship_drafter.py: the newest finished drafter in the cache, copied compactly with its record."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from scripts_testing import load_script

from sglang_tts.training.data import read_answer_set


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
    # Its training data is not in this cache: the answers cannot ship, and nothing is written.
    with pytest.raises(SystemExit, match="pass --no-answers"):
        ship.main(["--target", "T", "--train-command", "x", "--dst", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()

    argv = ["--target", "T", "--train-command", "scripts/train_drafter.py --tiny", "--dst", str(tmp_path / "out")]
    assert ship.main([*argv, "--no-answers"]) == 0
    record = json.loads((tmp_path / "out" / "training.json").read_text())
    assert record["train_command"] == "scripts/train_drafter.py --tiny"
    assert record["ship_command"].startswith("scripts/ship_drafter.py --target T --train-command")
    assert record["summary"] == {"steps": 3}  # the training machine's checkpoint path is dropped
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert "F16" in {f.get_slice(k).get_dtype() for k in f.keys()}


def test_ships_the_answers_it_was_trained_on_and_no_training_machine_paths(tmp_path, tiny_eagle3):
    ship = _script()
    cache = tmp_path / "T-seqs-0123.pt"  # a cached training set, as training/data.py writes it
    ids = [torch.tensor([5, 6, 7, 1, 2]), torch.tensor([8, 9, 3, 4, 4, 0])]
    meta = {"format": 1, "target": {"name": "T"}, "max_new_tokens": 4, "instruction": None}
    torch.save({"meta": meta, "keys": ["a", "b"], "ids": ids, "prompt_lens": [3, 2]}, cache)
    trained = tmp_path / "T-eagle3-len256"
    shutil.copytree(tiny_eagle3, trained)
    (trained / "train").mkdir()
    summary = {"checkpoint": "/elsewhere", "target": "/machine/models/T", "data": {"cache": str(cache), "n": 2}}
    (trained / "train" / "summary.json").write_text(json.dumps(summary))

    out = tmp_path / "out"
    assert ship.main(["--src", str(trained), "--train-command", "x", "--dst", str(out)]) == 0
    record = json.loads((out / "training.json").read_text())
    assert record["summary"] == {"target": "T", "data": {"n": 2}}  # no path of the training machine
    assert record["answers"] == {"file": "answers.safetensors", "sequences": 2, "answer_tokens": 6}
    got = read_answer_set(out / "answers.safetensors")
    assert got.keys == ["a", "b"] and got.prompt_lens == [3, 2]
    assert [a.tolist() for a in got.answers] == [[1, 2], [3, 4, 4, 0]]
    assert got.shaping == read_answer_set(cache).shaping
