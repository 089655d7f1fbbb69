"""scripts/profile_update.py on a tiny target and tiny drafters: every phase of an update is timed, the serving
stand-in is measured, a subset equal to another is not measured twice, and a rerun skips what is done.
(The timings themselves are not a test.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from scripts_testing import load_script

from sglang_tts.bench.tiny_models import TinyTargetSpec, write_tiny_target
from sglang_tts.drafters.checkpoints import write_tiny_eagle3


@pytest.fixture(scope="module")
def script():
    return load_script("profile_update")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("profile_update")
    target = write_tiny_target(root / "tiny-target", TinyTargetSpec(vocab_size=512, num_hidden_layers=4))
    config = json.loads((target / "config.json").read_text())
    return target, write_tiny_eagle3(root / "tiny-eagle3", config)


def test_profiles_every_phase_and_a_rerun_skips_finished_configurations(script, tiny, tmp_path, monkeypatch):
    target, eagle3 = tiny
    out = tmp_path / "profile"
    argv = [
        "--models", str(target), "--eagle3-drafter", str(eagle3),
        "--batch-sizes", "2", "--trainable", "all", "decoder", "--threads", "1",
        "--updates", "2", "--warmup", "1", "--canvases", "1", "--context", "16",
        "--serving-rounds", "2", "--dflash-block-size", "4", "--dflash-layers", "1",
        "--out", str(out),
    ]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        payload = script.main(argv)
    finally:
        torch.set_num_threads(threads)  # --threads is process-wide: leave the other tests theirs

    saved = json.loads((out / "profile.json").read_text())
    assert saved["results"].keys() == payload["results"].keys()
    name = target.name
    assert set(saved["results"]) == {
        f"{name}/eagle3/batch/b2/all",
        f"{name}/eagle3/batch/b2/decoder",
        f"{name}/eagle3/request/b2/r8",
        f"{name}/dflash/batch/b2/all",
        f"{name}/dflash/request/b2/r8",
    }
    # DFlash has no LM head of its own: "decoder" trains what "all" does.
    assert saved["skipped"] == {f"{name}/dflash/batch/b2/decoder": "same parameters as all"}
    assert saved["meta"]["cpu_count"] and saved["meta"]["command"].startswith("scripts/profile_update.py")

    for key, record in saved["results"].items():
        phases = record["phases_ms"]
        assert record["outcomes"] == {"ok": 2}, key
        if record["scope"] == "request":  # adapters always take the rollback copy
            assert set(phases) == set(script.ALL_PHASES), key
            assert record["rollback_copy_if_taken_ms"] is None
            assert record["numel_per_request"] * 16 == record["numel_trained"]
        else:  # one step of the shared drafter from published weights: no copy on the path, timed apart
            assert set(phases) == set(script.ALL_PHASES) - {"rollback_copy"}, key
            assert record["rollback_copy_if_taken_ms"] > 0
        assert all(ms > 0 for ms in phases.values()), (key, phases)
        assert record["total_ms"] >= sum(phases.values()) * 0.999 and record["numel_trained"] > 0
        serving = record["serving"]
        if record["trainable"] in ("all", "r8"):
            assert serving["round_alone_ms"] > 0 and serving["round_with_worker_ms"] > 0
            assert serving["update_on_worker_ms"] > 0 and serving["updates_on_worker"] >= 2
            assert serving["round_inline_ms"] > serving["update_inline_ms"] > 0
        else:
            assert serving is None
    results = saved["results"]
    decoder, everything = results[f"{name}/eagle3/batch/b2/decoder"], results[f"{name}/eagle3/batch/b2/all"]
    assert decoder["prefixes"] == ["fc.", "layers.", "norm."] and everything["prefixes"] is None
    assert decoder["numel_trained"] < everything["numel_trained"]  # all of it but the LM head

    report = (out / "profile.md").read_text()
    assert f"## {name} · eagle3 · shared drafter (scope batch)" in report
    assert f"## {name} · dflash · per-request adapters (scope request)" in report
    assert "| B=2 decoder |" in report and "b2/decoder: not measured (same parameters as all)" in report
    assert "| config | round alone | round + worker | slowdown |" in report

    def no_measuring(*args, **kwargs):
        raise AssertionError("a finished configuration was measured again")

    monkeypatch.setattr(script, "profile", no_measuring)
    monkeypatch.setattr(script, "load_target", no_measuring)
    try:
        again = script.main(argv)
    finally:
        torch.set_num_threads(threads)
    assert again["results"] == saved["results"]
    assert again["runs"][-1]["configurations"] == [] and len(again["runs"]) == 2


def test_window_canvases_are_rounds_of_their_requests_reading_one_kv_entry_each(script, tiny):
    """--one-request / --requests: the rows of an update window (core/canvas.py stack_rounds): one K/V
    entry per request and each earlier row of a request reading 2 positions fewer than the next."""
    from sglang_tts.drafters.loading import load_drafter
    from sglang_tts.training.target import load_target

    target_path, eagle3 = tiny
    _, _, target = load_target(target_path)
    base = load_drafter(eagle3, target_embedding=target.embedding.float(), target_config=target.config)
    canvas = script.eagle3_canvas(base, 4, 4, 16, torch.Generator().manual_seed(0), requests=1)
    assert canvas.batch_size == 4 and all(k.shape[0] == 1 == v.shape[0] for k, v in canvas.past_kv)
    assert canvas.past_mask.sum(1).tolist() == [10, 12, 14, 16]
    assert canvas.positions[:, 0].tolist() == [10, 12, 14, 16]
    assert canvas.context_rows is None
    with torch.no_grad():
        assert torch.isfinite(base.canvas_logits(canvas)).all()
    assert script.parse_args(["--one-request"]).requests == 1 and script.parse_args([]).requests == 0
    # --requests 2: rows 0, 2, 4 are request 0's rounds, 1, 3, 5 request 1's; one K/V entry per request.
    canvas = script.eagle3_canvas(base, 6, 4, 16, torch.Generator().manual_seed(0), requests=2)
    assert all(k.shape[0] == 2 == v.shape[0] for k, v in canvas.past_kv)
    assert canvas.context_rows == [0, 1, 0, 1, 0, 1]
    assert canvas.past_mask.sum(1).tolist() == [12, 12, 14, 14, 16, 16]
    with torch.no_grad():
        assert torch.isfinite(base.canvas_logits(canvas)).all()


def test_valid_lengths_set_the_rows_valid_positions_in_turn(script):
    """--valid-lengths: the rows' valid canvas lengths cycle through the pattern, clamped to 1..c (the
    stacked rounds of a stride are mostly short: about 2 valid positions of 4 one at a time)."""
    assert script._valid_lengths(5, 4, (1, 2, 9)).tolist() == [1, 2, 4, 1, 2]
    assert script._valid_lengths(3, 4, (0,)).tolist() == [1, 1, 1]
    assert script._valid_lengths(4, 4).tolist() == [4, 2, 4, 2]
    assert script.parse_args(["--valid-lengths", "1", "2"]).valid_lengths == (1, 2)
    assert script.parse_args([]).valid_lengths is None
