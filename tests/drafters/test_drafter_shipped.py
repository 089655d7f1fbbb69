"""The drafters that ship: stored in fp16, loaded in fp32, with the commands that made them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from sglang_tts.assets import DEFAULT_MODEL
from sglang_tts.drafters.loading import kind_from_config, load_checkpoint_tensors, load_drafter
from sglang_tts.drafters.shipped import ANSWERS, SHIPPED_ROOT, shipped_drafter, write_compact
from sglang_tts.training.data import read_answer_set


def test_compact_copy_halves_floats_keeps_integers_and_loads_back_in_fp32(tmp_path, tiny_eagle3, tiny_llama):
    original = load_checkpoint_tensors(tiny_eagle3)
    compact = write_compact(tiny_eagle3, tmp_path / "compact", {"train_command": "x"})
    stored = load_checkpoint_tensors(compact)
    assert stored.keys() == original.keys()
    for name, tensor in original.items():
        if tensor.is_floating_point():
            assert stored[name].dtype == torch.float16, name
        else:
            assert torch.equal(stored[name], tensor), name  # d2t / t2d untouched
    assert json.loads((compact / "training.json").read_text()) == {"train_command": "x"}

    drafter = load_drafter(compact, target_path=tiny_llama)
    fp32 = load_drafter(tiny_eagle3, target_path=tiny_llama)
    for (name, got), (_, want) in zip(drafter.state_dict().items(), fp32.state_dict().items()):
        if want.is_floating_point():
            assert got.dtype == torch.float32, name
            torch.testing.assert_close(got, want.half().float(), rtol=0, atol=0)


def test_compact_copy_refuses_a_tensor_fp16_cannot_hold(tmp_path, tiny_eagle3):
    from safetensors.torch import save_file

    src = tmp_path / "big"
    src.mkdir()
    (src / "config.json").write_text((tiny_eagle3 / "config.json").read_text())
    tensors = load_checkpoint_tensors(tiny_eagle3)
    name = next(k for k, v in tensors.items() if v.is_floating_point())
    tensors[name] = tensors[name] * 1e6
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match=name):
        write_compact(src, tmp_path / "out")


def test_the_default_models_eagle3_drafter_ships_in_fp16_with_its_training_record():
    folder = shipped_drafter(DEFAULT_MODEL.name, "eagle3")
    assert folder is not None, "the default model's EAGLE-3 drafter must ship (scripts/ship_drafter.py)"
    config = json.loads((folder / "config.json").read_text())
    assert kind_from_config(config) == "eagle3"
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert "F16" in dtypes and "F32" not in dtypes
    record = json.loads((folder / "training.json").read_text())
    assert record["train_command"].startswith("scripts/train_drafter.py --kind eagle3")
    assert record["summary"]["eval_after"]["accept_len"] > record["summary"]["eval_before"]["accept_len"]


@pytest.mark.parametrize("folder", sorted(p for p in SHIPPED_ROOT.iterdir() if p.is_dir()), ids=lambda p: p.name)
def test_every_shipped_drafter_is_fp16_trained_and_its_answers_match_its_record(folder):
    config = json.loads((folder / "config.json").read_text())
    assert folder.name.endswith("-" + kind_from_config(config))
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert "F32" not in {f.get_slice(k).get_dtype() for k in f.keys()}
    record = json.loads((folder / "training.json").read_text())
    assert record["train_command"].startswith("scripts/train_drafter.py")
    summary = record["summary"]
    assert summary["eval_after"]["accept_len"] > (summary["eval_before"] or {"accept_len": 0.0})["accept_len"]
    assert "/" not in summary.get("target", "")  # no path of the training machine
    if "answers" not in record:
        assert not (folder / ANSWERS).exists()
        return
    answers = read_answer_set(folder / record["answers"]["file"])
    data = summary["data"]
    assert len(answers.keys) == record["answers"]["sequences"] == data["train_sequences"] + data["held_out"]
    assert sum(len(a) for a in answers.answers) == record["answers"]["answer_tokens"]
    assert all(1 <= len(a) <= data["max_new_tokens"] for a in answers.answers)
