"""scripts/gpu_check.py on CPU: what CPU can run passes, the GPU-only checks skip with a reason, and the checks
are not vacuous (a torn or leaked publish, or a kernel that disagrees with its reference, fails them)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scripts_testing import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.py"
GPU_ONLY = {"graph_replay_publish", "adapter_kernel_capture", "sync_free_round", "sampled_verify_ops"}
KERNELS = {"kernel_linear_kl", "kernel_gather_draft", "kernel_lowrank_delta"}


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_check")


def _run(args: list[str], code: str | None = None) -> subprocess.CompletedProcess:
    """The script in a fresh process (it sets TRITON_INTERPRET itself before anything imports Triton)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(SCRIPT), *args] if code is None else [sys.executable, "-c", code, *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_cpu_run_passes_what_cpu_can_and_skips_the_rest(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = _run(["--device", "cpu", "--json", str(out)])
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["ok"] and report["triton_interpret"] == "1"
    results = {c["name"]: c for c in report["checks"]}
    triton = importlib.util.find_spec("triton") is not None
    for name, check in results.items():
        if name in GPU_ONLY:
            assert check["result"] == "skip" and "CUDA" in check["detail"], check
        elif name in KERNELS and not triton:
            assert check["result"] == "skip" and "triton" in check["detail"], check
        else:
            assert check["result"] == "pass", check
            assert check["detail"]
    assert set(results) == GPU_ONLY | KERNELS | {
        "executor_barrier",
        "publish_all_or_nothing",
        "update_at_scale",
        "no_sglang_import",
    }
    assert report["scale"] == "tiny" and results["update_at_scale"]["detail"].startswith("tiny (rehearsal")
    if triton:
        assert all(results[k]["detail"].startswith("interpreted") for k in KERNELS)
    assert "check" in proc.stdout and "PASS" in proc.stdout and "SKIP" in proc.stdout
    assert sum(c["seconds"] for c in report["checks"]) < 60


def test_a_half_published_state_fails_the_publish_check(gpu_check, monkeypatch):
    from sglang_tts.core.distiller import Distiller

    def write_half(self, tensors):  # a publish that stops half-way and reports success
        half = len(self._serving_params) // 2
        with torch.no_grad():
            for dst, src in zip(self._serving_params[:half], tensors[:half]):
                dst.copy_(src)

    monkeypatch.setattr(Distiller, "_write_serving", write_half)
    [result] = gpu_check.run_checks("cpu", ["publish_all_or_nothing"])
    assert result.result == "fail" and "torn or leaked" in result.detail, result


def test_an_update_leaking_into_the_serving_weights_fails_the_publish_check(gpu_check, monkeypatch):
    import sglang_tts.core.distiller as distiller

    # Train the serving copy itself: the update's steps reach drafts before any barrier publishes them.
    monkeypatch.setattr(distiller, "_training_copy", lambda drafter, names: drafter)
    [result] = gpu_check.run_checks("cpu", ["publish_all_or_nothing"])
    assert result.result == "fail" and "expected [0]" in result.detail, result


def test_a_kernel_that_disagrees_with_its_reference_fails(tmp_path):
    out = tmp_path / "broken.json"
    code = (
        "import importlib.util, os, sys\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        f"spec = importlib.util.spec_from_file_location('gpu_check', {str(SCRIPT)!r})\n"
        "gc = importlib.util.module_from_spec(spec); sys.modules['gpu_check'] = gc; spec.loader.exec_module(gc)\n"
        "from sglang_tts.kernels import lowrank\n"
        "reference = lowrank.lowrank_delta_torch\n"
        "lowrank.lowrank_delta_torch = lambda *args: reference(*args) * 1.001\n"
        "sys.exit(gc.main(sys.argv[1:]))\n"
    )
    proc = _run(["--device", "cpu", "--only", "kernel_lowrank_delta", "--json", str(out)], code=code)
    assert proc.returncode == 1, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    [check] = json.loads(out.read_text())["checks"]
    assert check["result"] == "fail" and "off by" in check["detail"], check


def test_list_and_a_missing_cuda_device(gpu_check, capsys):
    assert gpu_check.main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert all(c.name in listed for c in gpu_check.CHECKS)
    if not torch.cuda.is_available():
        assert gpu_check.main(["--device", "cuda"]) == 2
    with pytest.raises(ValueError, match="unknown checks"):
        gpu_check.run_checks("cpu", ["no_such_check"])


def test_side_stream_executor_pins_the_device_index(monkeypatch):
    """SGLang hands the workers device "cuda" (no index); the executor's worker calls torch.cuda.set_device,
    which refuses a device without one, so every update failed on GPU. The executor_barrier check catches
    that on CUDA; this is the CPU half, with a stand-in stream."""
    from torch.cuda._utils import _get_device_index

    from sglang_tts.core.executor import SideStreamExecutor

    class FakeStream:
        def __init__(self, device=None):
            self.device = torch.device("cuda", 3)  # what torch.cuda.Stream reports: the resolved device

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    executor = SideStreamExecutor("cuda")
    try:
        assert executor.device == torch.device("cuda", 3)
        assert _get_device_index(executor.device) == 3  # what set_device() in the worker needs
    finally:
        executor.close()


# --- update_at_scale: the CPU rehearsal of the 8B-scale measurement ---------------------------


@pytest.fixture(scope="module")
def rehearsal(gpu_check):
    [result] = gpu_check.run_checks("cpu", ["update_at_scale"], scale="tiny")
    return result


def test_the_rehearsal_measures_every_drafter_at_every_stride(gpu_check, rehearsal):
    """The same code the GPU runs at 8B scale, at tiny sizes: every number the GPU run reports is there and
    finite (their values on a shared CPU mean nothing), and the targets are not judged."""
    import math

    assert rehearsal.result == "pass", rehearsal.detail
    metrics = rehearsal.metrics
    spec = gpu_check.SCALES["tiny"]
    assert metrics["scale"] == "tiny" and metrics["trained_dtype"] == "float32"
    assert metrics["verify"]["layers"] >= 1 and metrics["verify"]["round_ms"] > 0
    assert set(metrics["drafters"]) == {"eagle3-128", "eagle3-512", "dflash"}
    for name, drafter in metrics["drafters"].items():
        assert drafter["updates"] == 1 + spec.alone + len(spec.strides) * (spec.cycles + 1), name
        assert drafter["update_ms"] > 0 and drafter["round_ms"] > 0 and drafter["trained_params"] > 0
        assert set(drafter["strides"]) == {str(s) for s in spec.strides}
        for stride in drafter["strides"].values():
            assert all(math.isfinite(v) for v in stride.values()), stride
        assert drafter["round_slowdown"] is None or math.isfinite(drafter["round_slowdown"])
        assert "targets_met" not in drafter
    # the 32K-like and the 128K-like draft vocabularies: the larger LM head trains more weights
    assert metrics["drafters"]["eagle3-512"]["trained_params"] > metrics["drafters"]["eagle3-128"]["trained_params"]
    table = gpu_check.format_scale_table(metrics)
    assert "| eagle3-128 |" in table and "hidden S=5" in table and "round slowdown" in table
    markdown = gpu_check.format_markdown("header", [rehearsal])
    assert markdown.startswith("# gpu_check") and "| update_at_scale | pass |" in markdown and table in markdown
    assert rehearsal.seconds < 30


def test_a_failing_update_fails_the_scale_check(gpu_check, monkeypatch):
    from sglang_tts.core.distiller import Distiller

    def broken(self, canvas, fault):
        raise RuntimeError("injected")

    monkeypatch.setattr(Distiller, "_train", broken)
    [result] = gpu_check.run_checks("cpu", ["update_at_scale"], scale="tiny")
    assert result.result == "fail" and "failed or skipped" in result.detail and "injected" in result.detail, result


def test_the_8b_scale_skips_on_cpu_and_scales_are_checked(gpu_check):
    [result] = gpu_check.run_checks("cpu", ["update_at_scale"], scale="8b")
    assert result.result == "skip" and "--scale tiny" in result.detail
    with pytest.raises(ValueError, match="unknown scale"):
        gpu_check.run_checks("cpu", ["update_at_scale"], scale="70b")
    eight = gpu_check.SCALES["8b"]
    assert (eight.hidden, eight.intermediate, eight.heads, eight.kv_heads) == (4096, 14336, 32, 8)
    assert eight.draft_vocabs == (32000, 128256) and eight.serving_dtype == torch.bfloat16
    assert 15 < gpu_check._decode_gb(eight) < 17  # Llama-3.1-8B's weights in bf16: 16 GB per decode step


def test_the_sampled_verify_check_runs_as_it_will_on_cuda(gpu_check, monkeypatch):
    """sampled_verify_ops only runs on CUDA; here its body runs with the CPU as the "device" (no sync-debug mode
    to arm), so that a lent GPU never meets a broken check."""
    import contextlib

    class PretendCuda(gpu_check.Context):
        @property
        def cuda(self) -> bool:
            return True

    monkeypatch.setattr(gpu_check, "sync_debug_error", contextlib.nullcontext)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(gpu_check, "SAMPLED_VERIFY_SHAPE", (32, 6, 500, 4))
    detail = gpu_check.check_sampled_verify_ops(PretendCuda(torch.device("cpu")))
    assert "32 of 32 rows equal to CPU" in detail, detail


def test_the_scale_check_trains_the_subset_it_is_given(gpu_check, rehearsal):
    """--trainable (as --tts-trainable) on the 8B-scale update: only the named parameters train and publish."""
    [fc] = gpu_check.run_checks("cpu", ["update_at_scale"], scale="tiny", trainable=["fc"])
    assert fc.result == "pass", fc.detail
    assert fc.metrics["trainable"] == ["fc"] and rehearsal.metrics["trainable"] == "all"
    for name, drafter in fc.metrics["drafters"].items():
        assert 0 < drafter["trained_params"] < rehearsal.metrics["drafters"][name]["trained_params"], name
    spec = gpu_check.SCALES["tiny"]
    assert fc.metrics["drafters"]["eagle3-128"]["trained_params"] == spec.hidden * 3 * spec.hidden  # fc: 3H -> H
    [none] = gpu_check.run_checks("cpu", ["update_at_scale"], scale="tiny", trainable=["no_such_layer"])
    assert none.result == "fail" and "selects none" in none.detail


def test_the_scale_runs_summary_and_plot(gpu_check, rehearsal, tmp_path):
    plot = load_script("plot_update_at_scale", "plot_update_at_scale")
    report = {"device_name": "cpu", "checks": [{"name": "update_at_scale", "metrics": rehearsal.metrics}]}
    (tmp_path / "all.json").write_text(json.dumps(report))
    assert plot.main([str(tmp_path / "all.json"), "--out", str(tmp_path / "out")]) == 0
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert summary.count("| all | all |") == 3 and "hidden S=5" in summary and "cost S=10" in summary
    assert (tmp_path / "out" / "cost_by_stride.png").read_bytes()[:4] == b"\x89PNG"
