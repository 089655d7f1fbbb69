"""End to end on the tiny target: both drafters train, land on disk in the public layouts, load
back with `load_drafter` unchanged, and an interrupted run resumes to the same weights."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil
from dataclasses import replace

import pytest
import torch

from sglang_tts.drafters import DFlashDrafter, Eagle3Drafter, load_drafter
from sglang_tts.drafters.loading import load_checkpoint_tensors
from sglang_tts.drafters.shipped import write_compact
from sglang_tts.training import TrainRequest, tiny_request, train_drafters
from sglang_tts.training.pipeline import default_out, output_dir
from sglang_tts.training.target import collate

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def request_for(tiny_llama, data_config, data_cache):
    def make(out: pathlib.Path, **overrides) -> TrainRequest:
        defaults = {"target": tiny_llama, "out": out, "data": data_config, "cache_dir": data_cache, "progress": False}
        return tiny_request(**{**defaults, **overrides})

    return make


@pytest.fixture(scope="module")
def tiny_run(request_for, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-run")
    return out, train_drafters(request_for(out))


def _state(path: pathlib.Path) -> dict[str, torch.Tensor]:
    return torch.load(path / "train" / "state.pt", map_location="cpu", weights_only=True)["model"]


def test_tiny_configuration_trains_both_drafters(tiny_run):
    out, results = tiny_run
    assert set(results) == {"eagle3", "dflash"}
    for kind, result in results.items():
        assert result.path == out / f"tiny-llama-{kind}-tiny"
        assert result.finished and result.step == 30 and result.start_step == 0
        for name in ("config.json", "model.safetensors", "train/state.pt", "train/metrics.jsonl", "train/summary.json"):
            assert (result.path / name).is_file(), name
        summary = json.loads((result.path / "train" / "summary.json").read_text())
        assert summary["steps"]["done"] == 30 and summary["eval_after"]["loss"] == result.eval_after["loss"]


def test_training_loss_decreases(tiny_run):
    _, results = tiny_run
    for kind, result in results.items():
        losses = [r["loss"] for r in result.history]
        assert sum(losses[-5:]) / 5 < 0.95 * sum(losses[:5]) / 5, (kind, losses)
        # Measured on held-out sequences too: the drafter learnt something that carries over.
        assert result.eval_after["loss"] < result.eval_before["loss"], kind


def test_checkpoints_load_with_load_drafter_and_match_training(tiny_run, tiny_target, sequences, features):
    _, results = tiny_run
    weights = tiny_target.weights

    eagle_path = results["eagle3"].path
    raw = load_checkpoint_tensors(eagle_path)
    assert any(k.startswith("midlayer.") for k in raw) and {"d2t", "t2d", "lm_head.weight"} <= set(raw)
    config = json.loads((eagle_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    eagle = load_drafter(eagle_path, target_embedding=weights.embedding, target_config=weights.config)
    assert isinstance(eagle, Eagle3Drafter)
    trained = _state(eagle_path)
    assert set(eagle.state_dict()) == set(trained)
    assert all(torch.equal(eagle.state_dict()[k], v) for k, v in trained.items())
    # Draft vocabulary maps survive the round trip consistently.
    assert bool(eagle.t2d[eagle.draft_to_target_ids()].all()) and int(eagle.t2d.sum()) == config["draft_vocab_size"]

    dflash_path = results["dflash"].path
    raw = load_checkpoint_tensors(dflash_path)
    assert not any("embed" in k or "lm_head" in k for k in raw)
    dflash = load_drafter(
        dflash_path, target_embedding=weights.embedding, target_lm_head=weights.lm_head, target_config=weights.config
    )
    assert isinstance(dflash, DFlashDrafter)
    trained = _state(dflash_path)
    assert set(dflash.state_dict()) == set(trained)
    assert all(torch.equal(dflash.state_dict()[k], v) for k, v in trained.items())

    # The loaded drafter computes what the trained one did (same held-out numbers).
    from sglang_tts.training.eagle3 import Eagle3Objective, evaluate_eagle3

    request = tiny_request()
    objective = Eagle3Objective(eagle, request.eagle3, sequences, features, weights, seed=0)
    held = sequences.subset(sequences.split_indices(request.eval_sequences, 0)[1])
    held_feats = features.subset(sequences.split_indices(request.eval_sequences, 0)[1])
    again = evaluate_eagle3(objective, held, held_feats)
    assert again["loss"] == pytest.approx(results["eagle3"].eval_after["loss"], rel=1e-5)
    assert again["acc"] == results["eagle3"].eval_after["acc"]
    assert collate(held, held_feats, [0]).ids.shape[0] == 1


def test_interrupted_run_resumes_from_the_saved_step(request_for, tiny_run, tmp_path):
    _, straight = tiny_run
    first = train_drafters(request_for(tmp_path, stop_after=12))
    assert all(r.step == 12 and not r.finished for r in first.values())
    resumed = train_drafters(request_for(tmp_path, resume=True))
    for kind, result in resumed.items():
        assert (result.start_step, result.step, result.finished) == (12, 30, True)
        assert result.eval_before is None  # nothing re-evaluated from scratch
        ref, got = _state(straight[kind].path), _state(result.path)
        for name, tensor in ref.items():
            assert torch.allclose(got[name].float(), tensor.float(), atol=1e-6), (kind, name)


def test_output_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_TTS_CACHE", str(tmp_path))
    assert (
        default_out("SmolLM2-135M-Instruct", "eagle3", "len256")
        == tmp_path / "drafters" / "SmolLM2-135M-Instruct-eagle3-len256"
    )
    request = TrainRequest()
    assert output_dir(request, "M", "dflash") == tmp_path / "drafters" / "M-dflash-len256"
    assert output_dir(replace(request, out=tmp_path / "x", kinds=("eagle3",)), "M", "eagle3") == tmp_path / "x"
    assert output_dir(replace(request, out=tmp_path / "x"), "M", "eagle3") == tmp_path / "x" / "M-eagle3-len256"


def test_cli(tiny_llama, prompts_file, data_cache, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("train_drafter", REPO / "scripts" / "train_drafter.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    out = tmp_path / "cli"
    argv = [
        "--tiny", "--target", str(tiny_llama), "--kind", "eagle3", "--out", str(out), "--source", str(prompts_file),
        "--num-prompts", "8", "--max-len", "24", "--steps", "3", "--cache-dir", str(data_cache), "--lr", "5e-4", "-q",
    ]  # fmt: skip
    args = cli.build_parser().parse_args(argv)
    request = cli.request_from_args(args)
    assert request.kinds == ("eagle3",) and request.steps == 3 and request.optim.lr == 5e-4
    assert request.dflash.target_layer_ids is None
    layered = cli.request_from_args(cli.build_parser().parse_args([*argv, "--dflash-target-layers", "0", "2"]))
    assert layered.dflash.target_layer_ids == [0, 2]
    assert request.eagle3.draft_vocab_size == tiny_request().eagle3.draft_vocab_size  # --tiny defaults kept
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_resuming_on_a_grown_data_set_keeps_the_draft_vocabulary_and_the_held_out_prompts(
    request_for, data_config, data_cache, prompts_file, tmp_path
):
    cache = tmp_path / "cache"  # the grown set's files stay out of the shared cache
    shutil.copytree(data_cache, cache)
    first = train_drafters(request_for(tmp_path, kinds=("eagle3",), stop_after=6, cache_dir=cache))
    saved_vocab = _state(first["eagle3"].path)["d2t"]
    held_out = (first["eagle3"].path / "train" / "held_out.jsonl").read_text()
    grown = replace(data_config, extra_source=str(prompts_file), extra_prompts=12)
    resumed = train_drafters(
        request_for(tmp_path, kinds=("eagle3",), data=grown, resume=True, stop_after=9, cache_dir=cache)
    )
    result = resumed["eagle3"]
    assert (result.start_step, result.step) == (6, 9)
    # The weights were trained over the saved vocabulary, whatever the grown set's frequencies would pick.
    assert torch.equal(_state(result.path)["d2t"], saved_vocab)
    assert torch.equal(load_checkpoint_tensors(result.path)["d2t"].to(saved_vocab.dtype), saved_vocab)
    # The extra prompts only train: the held-out prompts are the same, the held-in ones grew by the 4 new ones.
    assert (result.path / "train" / "held_out.jsonl").read_text() == held_out
    held_in = (result.path / "train" / "held_in.jsonl").read_text().splitlines()
    assert len(held_in) == 12 - len(held_out.splitlines())


def test_resumed_dflash_keeps_its_mask_token_and_target_layers(request_for, tmp_path):
    first = train_drafters(request_for(tmp_path, kinds=("dflash",), stop_after=4))
    saved = json.loads((first["dflash"].path / "config.json").read_text())["dflash_config"]
    # A resumed run that does not name them takes the saved choices, whatever the data would pick now.
    resumed = train_drafters(request_for(tmp_path, kinds=("dflash",), resume=True, stop_after=6))
    assert (resumed["dflash"].start_step, resumed["dflash"].step) == (4, 6)
    assert json.loads((resumed["dflash"].path / "config.json").read_text())["dflash_config"] == saved
    # One that names other layers is refused, naming both.
    other = replace(tiny_request().dflash, target_layer_ids=[0])
    assert saved["target_layer_ids"] != [0]
    with pytest.raises(ValueError, match=r"trained with target_layer_ids .* not \[0\]"):
        train_drafters(request_for(tmp_path, kinds=("dflash",), resume=True, dflash=other))


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_init_from_a_shipped_copy_starts_where_the_trained_drafter_ended(kind, request_for, tiny_run, tmp_path):
    _, straight = tiny_run
    trained = straight[kind]
    compact = write_compact(trained.path, tmp_path / "shipped")  # as ship_drafter.py stores it: fp16
    result = train_drafters(request_for(tmp_path / "again", kinds=(kind,), init_from=compact, stop_after=1))[kind]
    # Measured before its first step, its held-out loss is the trained drafter's (to fp16 rounding), well below a
    # random start's; the choices its weights mean something for came with it.
    assert result.eval_before["loss"] == pytest.approx(trained.eval_after["loss"], rel=1e-3)
    assert trained.eval_after["loss"] < 0.95 * trained.eval_before["loss"]
    saved, got = load_checkpoint_tensors(trained.path), load_checkpoint_tensors(result.path)
    if kind == "eagle3":
        assert torch.equal(got["d2t"], saved["d2t"])
    else:
        config = json.loads((result.path / "config.json").read_text())["dflash_config"]
        assert config == json.loads((trained.path / "config.json").read_text())["dflash_config"]
    summary = json.loads((result.path / "train" / "summary.json").read_text())
    assert summary["init_from"] == "shipped"


def test_init_from_is_refused_for_another_kind_or_a_target_nothing_ships_for(request_for, tiny_run, tmp_path):
    _, straight = tiny_run
    with pytest.raises(ValueError, match="holds a eagle3 drafter: train --kind eagle3 alone"):
        train_drafters(request_for(tmp_path, kinds=("dflash",), init_from=straight["eagle3"].path))
    with pytest.raises(ValueError, match="--init-from shipped: no eagle3 drafter ships for"):
        train_drafters(request_for(tmp_path, kinds=("eagle3",), init_from="shipped"))
    other = replace(tiny_request().dflash, target_layer_ids=[0])
    with pytest.raises(ValueError, match=r"--init-from: the DFlash drafter .* not \[0\]"):
        train_drafters(request_for(tmp_path, kinds=("dflash",), init_from=straight["dflash"].path, dflash=other))
