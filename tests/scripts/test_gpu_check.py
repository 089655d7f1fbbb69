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
GPU_ONLY = {"graph_replay_publish", "adapter_kernel_capture", "sync_free_round"}
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
    assert set(results) == GPU_ONLY | KERNELS | {"executor_barrier", "publish_all_or_nothing", "no_sglang_import"}
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
