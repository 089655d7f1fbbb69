"""Launch-time validation of `--speculative-algorithm TTS` (sglang_tts/sglang/algorithm.py), in process."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from sglang_tts.drafters.checkpoints import write_tiny_dflash, write_tiny_eagle3
from sglang_tts.sglang.algorithm import KIND_ENV, TTSLaunchError, resolve_drafter, validate_server_args
from sglang_tts.sglang.flags import ENV_VAR


def _target_config(path):
    return json.loads((path / "config.json").read_text())


def test_the_drafter_kind_comes_from_its_config(tiny_llama, tmp_path):
    config = _target_config(tiny_llama)
    assert resolve_drafter(str(write_tiny_eagle3(tmp_path / "e3", config)), str(tiny_llama)) == "eagle3"
    assert resolve_drafter(str(write_tiny_dflash(tmp_path / "df", config)), str(tiny_llama)) == "dflash"


def test_validation_passes_the_kind_to_the_workers(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv(KIND_ENV, "eagle3")  # restored after the test
    drafter = write_tiny_dflash(tmp_path / "df", _target_config(tiny_llama))
    args = SimpleNamespace(speculative_draft_model_path=str(drafter), model_path=str(tiny_llama))
    validate_server_args(args)
    assert os.environ[KIND_ENV] == "dflash"


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("selector_rank", 4, "candidate selector"),
        ("conv_kernel_size", 3, "convolutions"),
    ],
)
def test_dflash_options_tts_cannot_train_are_refused(tiny_llama, tmp_path, option, value, message):
    drafter = write_tiny_dflash(tmp_path / "df", _target_config(tiny_llama))
    cfg = json.loads((drafter / "config.json").read_text())
    cfg["dflash_config"][option] = value
    (drafter / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TTSLaunchError, match=message):
        resolve_drafter(str(drafter), str(tiny_llama))


def test_a_sliding_window_draft_cache_is_refused_with_dflash(tiny_llama, tmp_path):
    drafter = write_tiny_dflash(tmp_path / "df", _target_config(tiny_llama))
    args = SimpleNamespace(
        speculative_draft_model_path=str(drafter), model_path=str(tiny_llama), speculative_draft_window_size=64
    )
    with pytest.raises(TTSLaunchError, match="window"):
        validate_server_args(args)


def test_a_missing_drafter_is_refused(tiny_llama, tmp_path):
    with pytest.raises(TTSLaunchError, match="needs --speculative-draft-model-path"):
        resolve_drafter(None, str(tiny_llama))
    with pytest.raises(TTSLaunchError, match="no config.json"):
        resolve_drafter(str(tmp_path), str(tiny_llama))


def test_dense_per_request_adapters_refuse_cuda_graphs_at_launch(tiny_llama, tmp_path, monkeypatch):
    # Dense deltas loop over the requests present, which a captured CUDA graph cannot replay.
    monkeypatch.setenv(KIND_ENV, "eagle3")
    monkeypatch.setenv(ENV_VAR, json.dumps({"scope": "request", "adapter_rank": "full"}))
    drafter = str(write_tiny_eagle3(tmp_path / "e3", _target_config(tiny_llama)))

    def args(**kw):
        return SimpleNamespace(speculative_draft_model_path=drafter, model_path=str(tiny_llama), **kw)

    with pytest.raises(TTSLaunchError, match="--disable-cuda-graph"):
        validate_server_args(args(device="cuda", disable_cuda_graph=False))
    validate_server_args(args(device="cuda", disable_cuda_graph=True))
    validate_server_args(args(device="cpu"))


def _rewrite_weights(drafter, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(drafter / "model.safetensors"))
    save_file(edit(tensors), str(drafter / "model.safetensors"))


@pytest.mark.parametrize("write", [write_tiny_eagle3, write_tiny_dflash])
def test_a_checkpoint_missing_a_tensor_is_a_launch_error_naming_file_and_tensor(tiny_llama, tmp_path, write):
    drafter = write(tmp_path / "d", _target_config(tiny_llama))
    _rewrite_weights(drafter, lambda t: {k: v for k, v in t.items() if not k.endswith("fc.weight")})
    with pytest.raises(TTSLaunchError, match=r"model\.safetensors: .*checkpoint is missing \[.*fc\.weight"):
        resolve_drafter(str(drafter), str(tiny_llama))


@pytest.mark.parametrize("write", [write_tiny_eagle3, write_tiny_dflash])
def test_a_wrongly_shaped_tensor_is_a_launch_error_naming_file_and_tensor(tiny_llama, tmp_path, write):
    drafter = write(tmp_path / "d", _target_config(tiny_llama))
    name = None

    def shrink(tensors):
        nonlocal name
        name = next(k for k in tensors if k.endswith("fc.weight"))
        return {**tensors, name: tensors[name][:, :-1].contiguous()}

    _rewrite_weights(drafter, shrink)
    with pytest.raises(TTSLaunchError, match=rf"model\.safetensors: {name}: checkpoint shape"):
        resolve_drafter(str(drafter), str(tiny_llama))


def test_a_truncated_weight_file_is_a_launch_error_naming_it(tiny_llama, tmp_path):
    drafter = write_tiny_eagle3(tmp_path / "d", _target_config(tiny_llama))
    weights = drafter / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(TTSLaunchError, match=r"model\.safetensors cannot be read \(truncated or corrupt"):
        resolve_drafter(str(drafter), str(tiny_llama))


@pytest.mark.parametrize(
    ("scope", "parallel", "message"),
    [
        ("batch", {"tp_size": 2}, "supports --tp-size 1 only, got 2 .*tensor-parallel publishing is not implemented"),
        ("global", {"tp_size": 2}, "supports --tp-size 1 only"),
        ("request", {"tp_size": 4}, "supports --tp-size 1 only, got 4"),
        ("batch", {"pp_size": 2}, "supports --pp-size 1 only, got 2"),
    ],
)
def test_tensor_and_pipeline_parallelism_are_refused_at_launch(
    tiny_llama, tmp_path, monkeypatch, scope, parallel, message
):
    # The update is published into one unsharded copy of the drafter: a TP/PP rank would hold a shard.
    monkeypatch.setenv(KIND_ENV, "eagle3")
    monkeypatch.setenv(ENV_VAR, json.dumps({"scope": scope}))
    drafter = str(write_tiny_eagle3(tmp_path / "e3", _target_config(tiny_llama)))
    with pytest.raises(TTSLaunchError, match=f"--speculative-algorithm TTS {message}"):
        validate_server_args(
            SimpleNamespace(speculative_draft_model_path=drafter, model_path=str(tiny_llama), **parallel)
        )


def test_a_single_rank_launch_passes_the_parallelism_check(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv(KIND_ENV, "eagle3")
    monkeypatch.delenv(ENV_VAR, raising=False)  # default flags: scope batch
    drafter = str(write_tiny_eagle3(tmp_path / "e3", _target_config(tiny_llama)))
    # dp_size > 1 without attention DP: independent single-rank replicas, each with its own drafter copy.
    for parallel in ({}, {"tp_size": 1, "pp_size": 1}, {"tp_size": None}, {"dp_size": 2}):
        validate_server_args(
            SimpleNamespace(speculative_draft_model_path=drafter, model_path=str(tiny_llama), **parallel)
        )
