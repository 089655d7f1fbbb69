"""The GPU serving run (scripts/gpu_serve/), rehearsed on CPU: so that a lent GPU is never spent on a broken script.

One test runs `run.sh --cpu` as a GPU session runs `run.sh`: the repacked SGLang wheel (built here from the wheel
scripts/setup_env.sh keeps) installed into a scratch folder; SGLang's serving modules imported from it under
faked CUDA with the sgl_kernel / flash_mla stand-ins and both plugins (TTS registered, SGLang's internals checked,
the gpu_serve plugin's routes run through SGLang's own bindings); then check.py's mechanics served on CPU: tiny
models built on the spot, no speculation and TTS with EAGLE-3 (DFlash by its flags), greedy ids compared, sampled
requests, meta_info / Prometheus / log read, the fallback ladder (a first attempt made to fail at launch), results.
What only a GPU shows (CUDA graphs, the overlap scheduler with TTS, the side stream, nvcc-compiled tree kernels)
is not rehearsed; the rest is asserted here, and the helpers below are tested on made-up inputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from scripts_testing import REPO, load_script

build = load_script("gpu_serve/build", "gpu_serve_build")
check = load_script("gpu_serve/check", "gpu_serve_check")
RUN = REPO / "scripts" / "gpu_serve" / "run.sh"
STANDIN = REPO / "scripts" / "gpu_serve" / "standin"


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Path:
    """A wheelhouse holding SGLang repacked without its compiled parts (the dependency wheels need PyPI)."""
    wheels = sorted((REPO / ".cache" / "wheels").glob(f"sglang-{build.SGLANG_VERSION}-*.whl"))
    assert wheels, "scripts/setup_env.sh keeps SGLang's wheel in .cache/wheels; run it first"
    kit = tmp_path_factory.mktemp("gpukit")
    report = build.strip_sglang_wheel(wheels[0], kit / "whl" / build.STRIPPED_NAME, compresslevel=1)
    assert report.dropped_compiled and all(name.endswith(".so") for name in report.dropped_compiled)
    return kit


@pytest.fixture(scope="module")
def rehearsal(kit, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("out")
    scratch = tmp_path_factory.mktemp("scratch")
    env = {
        **os.environ,
        "OUT": str(out),
        "GPU_SERVE_KIT": str(kit),
        "GPU_SERVE_SITE": str(scratch / "site"),
        "GPU_SERVE_WORK": str(scratch / "work"),
        "GPU_SERVE_BUDGET_S": "500",
        "PYTHON": sys.executable,
    }
    env.pop("TRITON_INTERPRET", None)
    env.pop("SGLANG_TTS_FORKSERVER", None)  # a GPU session's servers are fresh processes (no zygote there)
    # EAGLE-3 only: DFlash's server differs by its flags alone (test_server_flags_per_server_and_rung), and every
    # server costs this run half a minute of its two cores.
    args = ["--greedy-tokens", "16", "--sampled-tokens", "6", "--drafters", "eagle3", "--rehearse-fallback"]
    proc = subprocess.run(["bash", str(RUN), "--cpu", *args], env=env, capture_output=True, text=True, timeout=600)
    return proc, out


def test_the_run_passes_on_cpu_and_leaves_its_results(rehearsal) -> None:
    proc, out = rehearsal
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["gpu_serve.json", "gpu_serve.md", "imports.json", "run.log", "server_logs.tar.gz"]
    assert len(files) <= 8 and all(p.is_file() for p in out.iterdir())  # what the device tool brings back
    assert "GPU serving check (cpu rehearsal): PASS" in (out / "gpu_serve.md").read_text()


def test_sglang_imports_from_the_repacked_wheel_under_faked_cuda(rehearsal) -> None:
    _, out = rehearsal
    report = json.loads((out / "imports.json").read_text())
    assert report["ok"], report["error"]
    assert report["fake_cuda"] and report["is_cuda"]  # SGLang took its CUDA branches at import
    assert report["sglang"].startswith("0.5.23 at ") and "/site/sglang" in report["sglang"]
    assert report["sglang_compiled_files"] == 0  # no Rust extension was needed
    assert report["sgl_kernel"] == "stand-in" and report["sgl_kernel_names_bound"]
    assert report["tts_registered"] and report["compat_ok"] and report["cpu_layer_active"] is False
    assert "sglang_tts_gpu_serve = sglang_tts_gpu_serve:register" in report["plugins"]
    # the CuTe-DSL dual GEMM stand-in, sampled verify, top-k and top-p renorm, Triton tree build and verify
    assert len(report["routed"]) == 6
    # what a server imports while it builds the model on CUDA (Llama's MLP: the dual GEMM, which needs cutlass)
    assert report["model_build_modules"] == {"sglang.kernels.ops.gemm.cutedsl_dual_gemm": "stand-in"}
    # Every installed package the imports used is in the GPU image's list, the wheelhouse, or known optional.
    assert "torch" in report["distributions"] and "fastapi" in report["distributions"]
    assert report["not_on_gpu_machine"] == []
    assert report["routed_ops_ran"] == {
        "top_k/top_p renorm": "ok",
        "tree_speculative_sampling_target_only": "ok",
        "verify_tree_greedy (Triton)": "ok",
    }


def test_tts_serves_as_no_speculation_does_and_reports_its_work(rehearsal) -> None:
    _, out = rehearsal
    report = json.loads((out / "gpu_serve.json").read_text())
    assert report["ok"] and report["mode"] == "cpu rehearsal"
    assert set(report["servers"]) == {"base", "eagle3"}
    assert all(v["passed"] for v in report["servers"].values())
    served = {a["server"]: a for a in report["attempts"] if a["ok"]}
    for drafter in ("eagle3",):
        attempt = served[drafter]
        assert attempt["checks"] == {
            "sampled_answered": True,
            "no_tts_failures": True,
            "updates_applied": True,
            "fallback_checked": True,
            "fallback_no_mismatch": True,
            "greedy_identical": True,
        }
        assert [g["first_divergence"] for g in attempt["greedy"]] == [None, None, None]
        assert attempt["metrics"]["updates_total"] > 0 and attempt["metrics"]["failures_total"] == 0
        assert attempt["timing"]["update_ms"] > 0 and attempt["timing"]["client_ms_per_round"] > 0
        assert len(attempt["sampled"]) == 3 and all(s["tokens"] == 6 for s in attempt["sampled"])
    assert served["base"]["greedy"][0]["output_ids"] == served["eagle3"]["greedy"][0]["output_ids"]


def test_a_failed_attempt_is_recorded_and_the_ladder_goes_on(rehearsal) -> None:
    _, out = rehearsal
    report = json.loads((out / "gpu_serve.json").read_text())
    eagle3 = [a for a in report["attempts"] if a["server"] == "eagle3"]
    assert [a["attempt"] for a in eagle3] == ["rehearsal", "a"]
    assert not eagle3[0]["ok"] and not eagle3[0]["served"]
    assert "--tts-update-stride: must be an integer >= 1" in eagle3[0]["reason"]  # the log's line, not a guess
    assert report["servers"]["eagle3"]["first_attempt_ok"]  # the made-up failure does not count


def test_the_import_check_fails_without_the_kernel_stand_ins(kit, tmp_path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": f"{STANDIN / 'plugins'}:{REPO}",
        "SGLANG_TTS_CPU_SUPPORT": "0",
        "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python",
    }
    script = REPO / "scripts" / "gpu_serve" / "imports.py"
    cmd = [sys.executable, str(script), "--fake-cuda", "--json", str(tmp_path / "imports.json")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    report = json.loads((tmp_path / "imports.json").read_text())
    assert proc.returncode == 1 and not report["ok"]
    assert "sgl_kernel" in report["error"]


def test_strip_drops_compiled_parts_and_writes_a_consistent_record(tmp_path) -> None:
    src = tmp_path / "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl"
    with zipfile.ZipFile(src, "w") as z:
        z.writestr("sglang/__init__.py", "__version__ = '0.5.23'\n")
        z.writestr("sglang/srt/rust_extensions/_server.cpython-311-x86_64-linux-gnu.so", b"\0" * 100)
        z.writestr("sglang/multimodal_gen/big.py", "x = 1\n")
        z.writestr("sglang-0.5.23.dist-info/WHEEL", "Tag: cp311-cp311-manylinux_2_34_x86_64\n")
        z.writestr("sglang-0.5.23.dist-info/RECORD", "stale\n")
    dst = tmp_path / "out" / build.STRIPPED_NAME
    report = build.strip_sglang_wheel(src, dst)
    assert report.dropped_files == 2 and report.kept_files == 2
    with zipfile.ZipFile(dst) as z:
        names = z.namelist()
        assert "sglang/__init__.py" in names and not any(n.endswith(".so") or "multimodal_gen" in n for n in names)
        assert "Tag: py3-none-any" in z.read("sglang-0.5.23.dist-info/WHEEL").decode()
        record = z.read("sglang-0.5.23.dist-info/RECORD").decode().splitlines()
        hashed = {line.split(",")[0]: line.split(",")[1] for line in record}
        assert hashed["sglang/__init__.py"] == build._record_hash(z.read("sglang/__init__.py"))
        assert set(hashed) == set(names)


def test_the_wheel_list_pins_one_version_of_each_and_prune_keeps_only_those(tmp_path) -> None:
    wanted = build.read_wheel_list()
    assert len(wanted) == 32 and all("==" in r for r in wanted)
    assert len({build._normalise(r.split("==")[0]) for r in wanted}) == len(wanted)
    whl = tmp_path / "whl"
    whl.mkdir()
    kept = "pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_x86_64.whl"
    stale = (
        "pydantic_core-2.40.0-cp312-x.whl",
        "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl",
        "stray-1.0-py3-none-any.whl",
    )
    for name in (kept, build.STRIPPED_NAME, *stale):
        (whl / name).write_bytes(b"")
    assert sorted(build.prune(whl, wanted)) == sorted(stale)
    assert sorted(p.name for p in whl.iterdir()) == sorted([kept, build.STRIPPED_NAME])
    args = build.target_platform_args()
    assert args[args.index("--python-version") + 1] == "3.12" and "manylinux2014_x86_64" in args


def test_metrics_budget_and_divergence_helpers() -> None:
    text = (
        "# HELP sglang_tts:updates_total Drafter updates applied\n"
        'sglang_tts:updates_total{model_name="m"} 7.0\n'
        'sglang_tts:updates_total{model_name="n"} 2.0\n'
        "sglang_tts:updates_totalx 100.0\n"
        "sglang_tts:update_seconds_sum 0.5\n"
    )
    assert check.prometheus_sum(text, "sglang_tts:updates_total") == 9.0
    assert check.prometheus_sum(text, "sglang_tts:update_seconds_sum") == 0.5
    log = (
        "x TTS update budget: BudgetState(budget=0.1, share=0.2, cost_ms=3.0, base_round_ms=10.0, gain=nan, "
        "gain_bound=nan, stride=3, trend=0.0)\n"
        "y TTS update budget: BudgetState(budget=0.1, share=0.2, cost_ms=2.0, base_round_ms=8.0, gain=nan, "
        "gain_bound=nan, stride=3, trend=0.0)\n"
    )
    assert check.parse_budget(log)["cost_ms"] == 2.0 and check.parse_budget(log)["base_round_ms"] == 8.0
    assert check.parse_budget("nothing") == {}
    assert check.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert check.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert check.first_divergence([1, 2], [1, 2, 3]) == 2


def test_timing_derives_the_hidden_share_and_the_round_in_flight() -> None:
    result = check.AttemptResult("eagle3", "a", "as configured")
    result.metrics = {"update_seconds_sum": 0.4, "update_seconds_count": 4, "barrier_wait_seconds_total": 0.02}
    result.budget = {"base_round_ms": 10.0, "cost_ms": 20.0}
    result.greedy = [{"spec_verify_ct": 50, "e2e_latency": 1.0}] * 3
    t = check.timing(result)
    assert t["update_ms"] == 100.0 and t["barrier_wait_ms_per_update"] == 5.0
    assert t["hidden_share"] == 0.8  # 20 ms of the update's 100 ms showed in the rounds it overlapped
    assert t["round_ms_update_in_flight"] == 12.5  # 100 ms of rounds: 8 rounds instead of 10
    assert t["client_ms_per_round"] == 20.0


def test_judge_fails_an_attempt_on_any_tts_check() -> None:
    settings = check.Settings(cpu=True, out=Path("."), work=Path("."), deadline=0.0, sampled_tokens=8)
    ok_meta = {"tts_failures": 0, "tts_num_updates": 3, "tts_fallback_checked": 9, "tts_fallback_mismatches": 0}

    def attempt(**changes) -> check.AttemptResult:
        result = check.AttemptResult("eagle3", "a", "as configured", served=True)
        result.greedy = [{**ok_meta, **changes}] * 3
        result.sampled = [{"tokens": 8, "finish_reason": {"type": "length"}, **ok_meta}] * 3
        result.metrics = {"updates_total": 9.0, "failures_total": 0.0}
        check.judge(result, settings)
        return result

    assert attempt().ok
    bad = attempt(tts_fallback_mismatches=1)
    assert not bad.ok and bad.reason == "failed: fallback_no_mismatch"
    assert not attempt(tts_failures=2).ok
    gpu = check.Settings(cpu=False, out=Path("."), work=Path("."), deadline=0.0, sampled_tokens=8)
    result = check.AttemptResult("eagle3", "a", "as configured", served=True, greedy=[ok_meta], graphs_expected=True)
    result.server_info = {"disable_cuda_graph": False}
    check.judge(result, gpu)
    assert result.checks["cuda_graphs_captured"] is False  # no capture line in the log


def test_the_ladder_stops_for_a_missing_package_but_not_for_a_model_sglang_skips(tmp_path, monkeypatch) -> None:
    """Found on the H200: a server still capturing CUDA graphs at its start timeout left SGLang's routine
    "Ignore import error when loading sglang.srt.models.inkling: No module named 'cutlass'" as its last error
    line, and the ladder stopped as if the wheelhouse lacked a package."""
    skipped = "[t] Ignore import error when loading sglang.srt.models.inkling: No module named 'cutlass'"
    lacking = "ModuleNotFoundError: No module named 'orjson'"
    for line, rungs in ((skipped, ["a", "b", "d"]), (lacking, ["a"])):
        tried: list[str] = []

        def attempt(settings, models, server, rung, line=line, tried=tried):
            tried.append(rung.name)
            return check.AttemptResult(server, rung.name, rung.what, reason="ServerStartError", error_lines=[line])

        monkeypatch.setattr(check, "run_attempt", attempt)
        settings = check.Settings(cpu=False, out=tmp_path, work=tmp_path, deadline=time.monotonic() + 3600)
        results = check.serve_ladder(settings, {}, "hybrid")
        assert tried == rungs, line
        assert ("add the package to wheels.txt" in results[-1].reason) == (line == lacking)


def test_the_hybrid_must_verify_both_proposers() -> None:
    gpu = check.Settings(cpu=False, out=Path("."), work=Path("."), deadline=0.0)
    meta = {"tts_failures": 0, "tts_num_updates": 3, "tts_fallback_checked": 5, "tts_fallback_mismatches": 0}
    both = check.AttemptResult("hybrid", "a", "as configured", served=True)
    both.greedy = [{**meta, "tts_suffix_rounds": 4, "tts_drafter_rounds": 7}]
    check.judge(both, gpu)
    assert both.ok and both.checks["both_proposers"]
    drafter_only = check.AttemptResult("hybrid", "a", "as configured", served=True)
    drafter_only.greedy = [{**meta, "tts_suffix_rounds": 0, "tts_drafter_rounds": 11}]
    check.judge(drafter_only, gpu)
    assert not drafter_only.ok and "both_proposers" in drafter_only.reason
    plain = check.AttemptResult("eagle3", "a", "as configured", served=True, greedy=[meta])
    check.judge(plain, gpu)
    assert plain.ok and "both_proposers" not in plain.checks


def test_the_gpu_path_serves_every_server_at_once_and_compares_with_no_speculation(tmp_path, monkeypatch) -> None:
    """check.py's GPU orchestration (a thread per server, verdicts, results) with the serving stubbed out."""
    started: dict[str, float] = {}

    def ladder(settings, models, server):
        started[server] = time.monotonic()
        time.sleep(0.5)  # every server is still serving when the last one starts
        result = check.AttemptResult(server, "a", "as configured", ok=True, served=True)
        ids = [1, 9, 3] if server == "dflash" else [1, 2, 3]
        result.greedy = [{"prompt": p, "output_ids": ids} for p in check.PROMPTS]
        return [result]

    monkeypatch.setattr(check, "build_models", lambda work: {})
    monkeypatch.setattr(check, "serve_ladder", ladder)
    monkeypatch.setattr(check, "STAGGER_S", 0.0)
    monkeypatch.setattr(check.signal, "signal", lambda *args: None)  # leave pytest's SIGTERM handler alone
    out = tmp_path / "out"
    assert check.main(["--out", str(out), "--work", str(tmp_path / "work"), "--budget-s", "60"]) == 1
    assert max(started.values()) - min(started.values()) < 0.5
    report = json.loads((out / "gpu_serve.json").read_text())
    assert report["mode"] == "gpu" and not report["ok"]
    assert report["servers"]["eagle3"]["passed"] and report["servers"]["base"]["passed"]
    assert report["servers"]["dflash"] == {
        "passed": False,
        "attempt": None,
        "first_attempt_ok": False,
        "reasons": {"a": "greedy output differs from no speculation"},
    }
    dflash = next(a for a in report["attempts"] if a["server"] == "dflash")
    assert [g["first_divergence"] for g in dflash["greedy"]] == [1, 1, 1]
    assert "| dflash | False | None | False |" in (out / "gpu_serve.md").read_text()


def test_server_flags_per_server_and_rung(tmp_path) -> None:
    models = {"target": tmp_path / "target", "eagle3": tmp_path / "eagle3", "dflash": tmp_path / "dflash"}
    gpu = check.Settings(cpu=False, out=tmp_path, work=tmp_path, deadline=0.0)
    base = check.server_args(gpu, models, None, check.LADDER[0])
    assert "--speculative-algorithm" not in base and "--disable-cuda-graph" not in base
    assert base[base.index("--attention-backend") + 1] == "triton" and base[base.index("--dtype") + 1] == "float32"
    assert base[base.index("--sampling-backend") + 1] == "pytorch"
    assert base[base.index("--cuda-graph-backend-prefill") + 1] == "disabled"
    eagle3 = check.server_args(gpu, models, "eagle3", check.LADDER[2])
    assert eagle3[eagle3.index("--speculative-draft-model-path") + 1] == str(models["eagle3"])
    assert eagle3[eagle3.index("--speculative-eagle-topk") + 1] == "1" and eagle3[-1] == "--disable-overlap-schedule"
    dflash = check.server_args(gpu, models, "dflash", check.LADDER[3])
    assert dflash[dflash.index("--speculative-algorithm") + 1] == "TTS" and "--speculative-num-steps" not in dflash
    assert dflash[-2:] == ["--disable-overlap-schedule", "--disable-cuda-graph"]
    assert [a.name for a in check.LADDER if a.name in check.RUNGS["dflash"]] == ["a", "c", "d"]
    hybrid = check.server_args(gpu, models, "hybrid", check.LADDER[0])  # the EAGLE-3 chain, suffix chains beside
    assert hybrid[hybrid.index("--speculative-draft-model-path") + 1] == str(models["eagle3"])
    assert hybrid[hybrid.index("--tts-hybrid") + 1] == "on" and "--speculative-num-steps" in hybrid
    assert "--tts-hybrid" not in eagle3
    assert [a.name for a in check.LADDER if a.name in check.RUNGS["hybrid"]] == ["a", "b", "d"]
    assert dict(check.LADDER[1].env) == {check.TREE_ENV: "triton"}
    cpu = check.Settings(cpu=True, out=tmp_path, work=tmp_path, deadline=0.0)
    on_cpu = check.server_args(cpu, models, "dflash", check.LADDER[0])
    assert on_cpu[on_cpu.index("--device") + 1] == "cpu" and "--enable-metrics" in on_cpu


def test_the_dual_gemm_stand_in_never_applies_and_keeps_the_real_modes(monkeypatch) -> None:
    """Found on the first H200 run: Llama's MLP constructor imports SGLang's CuTe-DSL dual GEMM on CUDA, which
    imports cutlass (not on the GPU machine), and every server died at model load. The gpu_serve plugin's
    stand-in answers "never applies" with the real module's names; the real module is left alone where cutlass
    exists."""
    sys.path.insert(0, str(STANDIN / "plugins"))
    try:
        import sglang_tts_gpu_serve as plugin
    finally:
        sys.path.remove(str(STANDIN / "plugins"))
    monkeypatch.setattr(plugin, "ROUTED", [])
    monkeypatch.delitem(sys.modules, plugin.DUAL_GEMM_MODULE, raising=False)
    find_spec = plugin.importlib.util.find_spec
    no_cutlass = lambda name, *args: None if name == "cutlass" else find_spec(name, *args)  # noqa: E731
    monkeypatch.setattr(plugin.importlib.util, "find_spec", no_cutlass)
    assert plugin.stand_in_dual_gemm() and plugin.ROUTED == [plugin.DUAL_GEMM_MODULE]
    module = sys.modules[plugin.DUAL_GEMM_MODULE]
    real = REPO / ".venv" / "lib"  # the real module's modes, read from its source (importing it needs cutlass)
    source = next(real.glob("python3*/site-packages/sglang/kernels/ops/gemm/cutedsl_dual_gemm.py")).read_text()
    for mode in module.DualGemmQuantMode:
        assert f"    {mode.name} = {mode.value}\n" in source
    assert "MAX_DUAL_GEMM_DECODE_TOKENS = 16" in source and module.MAX_DUAL_GEMM_DECODE_TOKENS == 16
    assert module.can_use_dual_gemm(16, 4096, 14336, module.DualGemmQuantMode.UNQUANT) is False
    assert not module.DualGemmQuantMode.UNQUANT.is_quantized and module.DualGemmQuantMode.STATIC_PER_TENSOR.is_quantized
    with pytest.raises(NotImplementedError, match="cutlass"):
        module.dual_gemm_swiglu(None, None)
    assert not plugin.stand_in_dual_gemm()  # once: an installed module (real or stand-in) is never replaced

    # SGLang's own caller, as the model's constructor runs it, picks no dual GEMM mode
    from sglang.srt.layers import dual_gemm

    monkeypatch.setattr(dual_gemm, "is_cuda", lambda: True)

    class Proj:
        quant_method = None
        params_dtype = None
        output_partition_sizes = [14336]

    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    proj = Proj()
    proj.quant_method = UnquantizedLinearMethod()
    proj.params_dtype = __import__("torch").bfloat16
    assert dual_gemm.DualGemm._select_mode(object.__new__(dual_gemm.DualGemm), proj, 4096) is None
