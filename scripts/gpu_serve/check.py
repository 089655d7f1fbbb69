#!/usr/bin/env python
"""The GPU serving check: SGLang with --speculative-algorithm TTS against no speculation, tiny models.

run.sh calls it on the GPU machine after installing the wheelhouse; `--cpu` runs the same mechanics on a
CPU (the project's CPU layer, one server at a time) so that the script is tested before a GPU is spent.

1. Builds a tiny "loopy" Llama target (head_dim 64) and random EAGLE-3 and DFlash drafters with the
   project's own builders (sglang_tts.bench.tiny_models, sglang_tts.drafters.checkpoints).
2. Serves no speculation, TTS with the EAGLE-3 chain and TTS with DFlash; on the GPU all at once, with CUDA
   graphs and the overlap scheduler on (SGLang's defaults), Triton attention and PyTorch sampling.
3. Sends the same greedy requests to each (concurrently) and compares token ids with no speculation (the
   first divergence is recorded), then sampled requests (temperature, top_p, top_k) that must be answered.
4. Reads meta_info, Prometheus and the server log: tts_failures == 0, updates > 0, the fallback
   re-prediction check (SGLANG_TTS_CHECK_FALLBACK=1) at 0 mismatches, CUDA-graph captures, the update's
   time and what it cost serving (the update budget's measured round time without an update in flight,
   and the excess of the rounds it overlapped).
5. A server that fails to start, to answer, or a TTS check is retried down a ladder while time is left:
   (a) as configured, (b) SGLang's Triton tree kernels instead of its nvcc-compiled ones (EAGLE-3 only),
   (c) b + --disable-overlap-schedule, (d) c + --disable-cuda-graph (no speculation: a, d). Each failure's
   reason is recorded; a sampled request that fails ends the ladder (every rung samples alike).
Writes $OUT/gpu_serve.json, $OUT/gpu_serve.md and $OUT/server_logs.tar.gz; exit status 0 when every server
passed on some attempt.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import re
import signal
import sys
import tarfile
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # a bare checkout on the GPU machine: sglang_tts is not installed there

from sglang_tts.bench.runner import _post_json  # noqa: E402
from sglang_tts.bench.server import ServerStartError, cpu_default_args, start_server, stop_server  # noqa: E402

PROMPTS = (
    "Count from one to twenty.",
    "Tell a very long story about a loop.",
    "List the days of the week.",
)
SAMPLING = (
    {"temperature": 0.8, "top_p": 0.9},
    {"temperature": 1.0, "top_k": 20},
    {"temperature": 0.7, "top_p": 0.95, "top_k": 50},
)
EAGLE3_CHAIN = ("--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4")
# What keeps SGLang on torch and Triton on CUDA without sglang-kernel or flashinfer (run.sh sets the
# environment half: SGLANG_FORCE_FUSED_OP_BACKEND=torch and the rest).
GPU_ARGS = (
    "--attention-backend", "triton",
    "--sampling-backend", "pytorch",
    "--cuda-graph-backend-prefill", "disabled",
    "--cuda-graph-max-bs-decode", "8",
    "--mem-fraction-static", "0.15",
    "--max-total-tokens", "16384",
)  # fmt: skip
SERVER_INFO_KEYS = ("disable_cuda_graph", "disable_overlap_schedule", "dtype", "attention_backend", "sampling_backend")
TREE_ENV, SAMPLING_ENV = "SGLANG_TTS_GPU_TREE", "SGLANG_TTS_GPU_SAMPLING"  # read by the gpu_serve plugin
STAGGER_S = 2.0  # between server starts on the GPU
BUDGET_LINE = re.compile(r"TTS update budget: BudgetState\((.*)\)")
# Why SGLang turned the overlap scheduler or CUDA graphs off, if it did; TTS's and gpu_serve's start-up lines.
NOTE_LINE = re.compile(r"sglang-tts|overlap|graph is disabled|disable_cuda_graph", re.IGNORECASE)
GRAPH_LINE = re.compile(r"captur\w* .*graph|graph .*captur", re.IGNORECASE)
ERROR_LINE = re.compile(r"\b(traceback|error|exception)\b|not in the GPU serving stand-in", re.IGNORECASE)


@dataclass
class Settings:
    cpu: bool
    out: Path
    work: Path
    deadline: float  # time.monotonic() by which everything must be written
    dtype: str = "float32"
    greedy_tokens: int = 256
    sampled_tokens: int = 128
    stride: int = 3
    start_timeout_s: float = 240.0
    drafters: tuple[str, ...] = ("eagle3", "hybrid", "dflash")
    rehearse_fallback: bool = False  # the first TTS server's first attempt is made to fail at launch

    def left(self) -> float:
        return self.deadline - time.monotonic()


@dataclass(frozen=True)
class Attempt:
    name: str
    what: str
    env: tuple[tuple[str, str], ...] = ()
    args: tuple[str, ...] = ()


TRITON_TREE = ((TREE_ENV, "triton"),)
NO_OVERLAP, NO_GRAPHS = ("--disable-overlap-schedule",), ("--disable-cuda-graph",)
LADDER = (
    Attempt("a", "as configured"),  # on the GPU: SGLang's nvcc-compiled tree kernels, CUDA graphs, overlap
    Attempt("b", "SGLang's Triton tree kernels", TRITON_TREE),
    Attempt("c", "Triton tree kernels, --disable-overlap-schedule", TRITON_TREE, NO_OVERLAP),
    Attempt("d", "Triton tree kernels, no overlap, --disable-cuda-graph", TRITON_TREE, NO_OVERLAP + NO_GRAPHS),
)
# The rungs each server takes: b only where EAGLE's tree kernels run; no speculation only needs d's graphs off.
# hybrid: TTS with the EAGLE-3 chain and --tts-hybrid on (suffix chains beside the drafter's; it turns the overlap
# scheduler off itself, so its rung c is b).
RUNGS = {"base": ("a", "d"), "eagle3": ("a", "b", "c", "d"), "hybrid": ("a", "b", "d"), "dflash": ("a", "c", "d")}
DRAFTER_MODEL = {"eagle3": "eagle3", "hybrid": "eagle3", "dflash": "dflash"}  # server -> the drafter it loads
# An attempt that fails at launch for --rehearse-fallback: SGLang's parser refuses the stride.
BROKEN = Attempt("rehearsal", "made to fail at launch (--rehearse-fallback)", args=("--tts-update-stride", "0"))


@dataclass
class AttemptResult:
    server: str
    attempt: str
    what: str
    ok: bool = False
    served: bool = False  # started and answered the greedy requests
    graphs_expected: bool = False  # on the GPU unless the attempt turns CUDA graphs off
    reason: str = ""  # why the attempt failed (a failed check, a launch error with its log line)
    sampled_error: str = ""  # why the sampled requests failed, if they did
    seconds: float = 0.0
    startup_s: float = 0.0
    server_info: dict[str, Any] = field(default_factory=dict)
    greedy: list[dict[str, Any]] = field(default_factory=list)
    sampled: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    budget: dict[str, float] = field(default_factory=dict)  # the last "TTS update budget" log line
    timing: dict[str, float] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)
    graph_lines: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # log lines on TTS, gpu_serve's routes, overlap and graphs
    error_lines: list[str] = field(default_factory=list)
    log: str = ""


# --- models, requests, metrics -------------------------------------------------------------------


def build_models(work: Path) -> dict[str, Path]:
    from sglang_tts.bench.tiny_models import TinyTargetSpec, write_tiny_target
    from sglang_tts.drafters.checkpoints import write_tiny_dflash, write_tiny_eagle3

    # Nearly bigram (small layer weights): greedy output falls into a short loop that a drafter learns
    # within a request, so updates change what is drafted. head_dim 64 for SGLang's Triton attention.
    spec = TinyTargetSpec(
        hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
        layer_std=0.02, init_std=0.6, seed=3,
    )  # fmt: skip
    target = write_tiny_target(work / "models" / "target", spec)
    config = json.loads((target / "config.json").read_text())
    return {
        "target": target,
        "eagle3": write_tiny_eagle3(work / "models" / "eagle3", config, layout="layers.0", draft_vocab_size=1024),
        "dflash": write_tiny_dflash(work / "models" / "dflash", config, block_size=4),
    }


def get_text(base_url: str, path: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(base_url + path, timeout=timeout) as r:
        return r.read().decode()


def generate(base_url: str, prompt: str, max_new_tokens: int, timeout: float, **sampling: Any) -> dict[str, Any]:
    params = {
        "temperature": 0.0,
        "max_new_tokens": max_new_tokens,
        "ignore_eos": True,
        "custom_params": {"tts_return_accept_lengths": True},
        **sampling,
    }
    return _post_json(
        base_url + "/generate", {"text": f"<|user|>{prompt}<|end|><|assistant|>", "sampling_params": params}, timeout
    )


def all_at_once(fn: Callable[[Any], dict[str, Any]], items: Sequence[Any]) -> list[dict[str, Any]]:
    """fn over items concurrently (one batch on the server); a failed request raises here."""
    with concurrent.futures.ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def prometheus_sum(text: str, name: str) -> float:
    """Sum of every sample of metric `name` (all label sets) in Prometheus text format."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


TTS_METRICS = (
    "sglang_tts:rounds_total",
    "sglang_tts:updates_total",
    "sglang_tts:skipped_updates_total",
    "sglang_tts:failures_total",
    "sglang_tts:update_seconds_sum",
    "sglang_tts:update_seconds_count",
    "sglang_tts:barrier_wait_seconds_total",
    "sglang_tts:update_cost_seconds",
)


def read_metrics(base_url: str) -> dict[str, float]:
    text = get_text(base_url, "/metrics")
    return {name.split(":", 1)[1]: prometheus_sum(text, name) for name in TTS_METRICS}


def parse_budget(log: str) -> dict[str, float]:
    """The last update-budget state the server logged (every 10 updates): base round and cost in ms."""
    found = BUDGET_LINE.findall(log)
    if not found:
        return {}
    return {k: float(v) for k, v in re.findall(r"(\w+)=([-+\w.]+)", found[-1]) if _is_number(v)}


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# --- one server, one attempt ---------------------------------------------------------------------


def server_args(settings: Settings, models: dict[str, Path], drafter: str | None, attempt: Attempt) -> list[str]:
    args = [*cpu_default_args()] if settings.cpu else [*GPU_ARGS, "--dtype", settings.dtype]
    args += ["--enable-metrics", "--skip-server-warmup"]
    if drafter is not None:
        model = DRAFTER_MODEL[drafter]
        args += ["--speculative-algorithm", "TTS", "--speculative-draft-model-path", str(models[model])]
        args += [*EAGLE3_CHAIN] if model == "eagle3" else []
        args += ["--tts-hybrid", "on"] if drafter == "hybrid" else []
        args += ["--tts-update-stride", str(settings.stride), "--tts-lr", "1e-2"]
    return args + list(attempt.args)


def summarise_meta(result: dict[str, Any]) -> dict[str, Any]:
    meta = result.get("meta_info", {})
    keep = {k: v for k, v in meta.items() if k.startswith(("tts_", "spec_")) and k != "tts_accept_lengths"}
    accepts = meta.get("tts_accept_lengths") or []
    keep["rounds"] = len(accepts)
    keep["e2e_latency"] = meta.get("e2e_latency")
    keep["finish_reason"] = meta.get("finish_reason")
    return keep


SERVING_ERRORS = (ServerStartError, TimeoutError, urllib.error.URLError, OSError, RuntimeError, KeyError, ValueError)


def _reason(exc: BaseException) -> str:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"[:400]


def run_attempt(settings: Settings, models: dict[str, Path], server: str, attempt: Attempt) -> AttemptResult:
    """Start `server` ("base" or a drafter) under `attempt`, send the requests, read what it reports.

    A failure to start or to answer the greedy requests fails the attempt (`served` False: the next rung of
    the ladder may get further). Once the greedy requests are answered the attempt has served; a sampled
    request that fails is then a failed check, which another rung would not change."""
    drafter = None if server == "base" else server
    result = AttemptResult(server, attempt.name, attempt.what)
    result.graphs_expected = not settings.cpu and "--disable-cuda-graph" not in attempt.args
    env = dict(attempt.env)
    if drafter is not None:
        env["SGLANG_TTS_CHECK_FALLBACK"] = "1"
    started = time.monotonic()
    proc = None
    try:
        timeout = min(settings.start_timeout_s, settings.left() - 30)
        if timeout < 30:
            raise TimeoutError(f"{settings.left():.0f} s left: not started")
        logs = settings.work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        args = server_args(settings, models, drafter, attempt)
        proc = start_server(
            str(models["target"]), args, cpu_defaults=False, timeout_s=timeout, env=env, log_dir=str(logs),
            die_with_parent=True,
        )  # fmt: skip
        result.log = str(proc.log_path)
        result.startup_s = round(time.monotonic() - started, 1)
        info = proc.server_info()
        result.server_info = {k: info.get(k) for k in SERVER_INFO_KEYS}
        request_timeout = max(10.0, settings.left() - 20)
        greedy = all_at_once(
            lambda p: generate(proc.base_url, p, settings.greedy_tokens, request_timeout), list(PROMPTS)
        )
        result.greedy = [
            {"prompt": p, "output_ids": g["output_ids"], **summarise_meta(g)} for p, g in zip(PROMPTS, greedy)
        ]
        result.served = True
        result.metrics = read_metrics(proc.base_url)  # kept should a sampled request bring the server down
        try:
            sampled = all_at_once(
                lambda s: generate(proc.base_url, PROMPTS[1], settings.sampled_tokens, request_timeout, **s),
                list(SAMPLING),
            )
            result.sampled = [
                {"sampling": s, "tokens": len(r["output_ids"]), **summarise_meta(r)} for s, r in zip(SAMPLING, sampled)
            ]
        except SERVING_ERRORS as exc:
            result.sampled_error = _reason(exc)
        if proc.healthy():
            result.metrics = read_metrics(proc.base_url)
        else:
            result.sampled_error += " | the server stopped answering /health"
    except SERVING_ERRORS as exc:
        result.reason = _reason(exc)
    finally:
        if proc is not None:
            stop_server(proc, timeout_s=20)
        log_path = Path(result.log) if result.log else _newest_log(settings.work / "logs", started)
        if log_path is not None:
            result.log = str(log_path)
            read_log(result, log_path.read_text(errors="replace"))
        result.seconds = round(time.monotonic() - started, 1)
    if result.served:
        judge(result, settings)
    elif result.error_lines:
        result.reason += f" | log: {result.error_lines[-1]}"
    return result


def _newest_log(logs: Path, since: float) -> Path | None:
    """A server that failed to start leaves its log behind: the newest one written since `since`."""
    wall_since = time.time() - (time.monotonic() - since)
    found = [p for p in logs.glob("sglang-*.log") if p.stat().st_mtime >= wall_since - 1]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def read_log(result: AttemptResult, log: str) -> None:
    lines = log.splitlines()
    result.graph_lines = [line[-200:] for line in lines if GRAPH_LINE.search(line)][:6]
    logged = [line for line in lines if line.startswith("[") and "server_args=" not in line]  # SGLang's log lines
    result.notes = [line[-300:] for line in logged if NOTE_LINE.search(line)][:12]
    result.error_lines = [line[-300:] for line in lines if ERROR_LINE.search(line)][-6:]
    result.budget = parse_budget(log)


def judge(result: AttemptResult, settings: Settings) -> None:
    """The checks of one attempt that served (the greedy comparison with no speculation comes later)."""
    checks = result.checks
    checks["sampled_answered"] = not result.sampled_error and all(
        s["tokens"] == settings.sampled_tokens and s.get("finish_reason") is not None for s in result.sampled
    )
    if result.server == "base":
        result.ok = checks["sampled_answered"]
        result.reason = "" if result.ok else f"sampled requests: {result.sampled_error or 'an answer came back short'}"
        return
    metas = result.greedy + result.sampled
    # Prometheus is read only while the server is healthy; meta_info of every answered request always.
    prom_failures = result.metrics.get("failures_total", 0.0)
    checks["no_tts_failures"] = all(m.get("tts_failures", 1) == 0 for m in metas) and prom_failures == 0
    updates = max(result.metrics.get("updates_total", 0.0), *(m.get("tts_num_updates", 0) for m in result.greedy))
    checks["updates_applied"] = updates > 0
    checked = sum(m.get("tts_fallback_checked", 0) for m in result.greedy)
    checks["fallback_checked"] = checked > 0
    checks["fallback_no_mismatch"] = all(m.get("tts_fallback_mismatches", 1) == 0 for m in metas)
    if result.server == "hybrid":  # both proposers verified: suffix chains (no drafter forward) and the drafter's
        suffix = sum(m.get("tts_suffix_rounds") or 0 for m in result.greedy)
        drafted = sum(m.get("tts_drafter_rounds") or 0 for m in result.greedy)
        checks["both_proposers"] = suffix > 0 and drafted > 0
    if result.graphs_expected:  # SGLang may turn graphs off by itself: its server_info says so
        checks["cuda_graphs_captured"] = bool(result.graph_lines) and not result.server_info.get("disable_cuda_graph")
    result.timing = timing(result)
    failed = [name for name, passed in checks.items() if not passed]
    result.ok = not failed
    result.reason = f"failed: {', '.join(failed)}" if failed else ""
    if result.sampled_error:
        result.reason += f" ({result.sampled_error})"


def timing(result: AttemptResult) -> dict[str, float]:
    """What one update took and what it cost serving. The update budget (sglang_tts/core/budget.py) times
    every decode round: base_round_ms is a round with no update in flight; cost_ms is the excess over it
    of the rounds an update overlapped, summed per update (an inline update's whole run). From those,
    hidden share = 1 - cost / update time, and the mean round while an update is in flight (assuming the
    update spans the rounds it overlaps) = base x update / (update - cost)."""
    m, b = result.metrics, result.budget
    out: dict[str, float] = {}
    if m.get("update_seconds_count", 0) > 0:
        out["update_ms"] = 1e3 * m["update_seconds_sum"] / m["update_seconds_count"]
        out["barrier_wait_ms_per_update"] = 1e3 * m.get("barrier_wait_seconds_total", 0.0) / m["update_seconds_count"]
    base, cost = b.get("base_round_ms", math.nan), b.get("cost_ms", math.nan)
    if math.isfinite(base) and math.isfinite(cost):
        out["round_ms_no_update"] = base
        out["update_cost_ms"] = cost
        update = out.get("update_ms", math.nan)
        if math.isfinite(update) and update > cost:
            out["hidden_share"] = 1.0 - cost / update
            out["round_ms_update_in_flight"] = base * update / (update - cost)
    rounds = sum(g.get("spec_verify_ct") or 0 for g in result.greedy)
    latency = max((g.get("e2e_latency") or 0.0 for g in result.greedy), default=0.0)
    if rounds:  # the greedy batch ran all three requests together: its wall time over one request's rounds
        out["client_ms_per_round"] = 1e3 * latency / (rounds / len(result.greedy))
    return {k: round(v, 4) for k, v in out.items()}


def serve_ladder(settings: Settings, models: dict[str, Path], server: str) -> list[AttemptResult]:
    """The attempts of one server, down the ladder until one passes (its greedy outputs are compared with no
    speculation's afterwards) or time runs out."""
    ladder = [a for a in LADDER if a.name in RUNGS[server]]
    if settings.rehearse_fallback and server == settings.drafters[0]:
        ladder.insert(0, BROKEN)
    results: list[AttemptResult] = []
    for attempt in ladder:
        if results and settings.left() < 90:
            results[-1].reason += f" | no time left for attempt {attempt.name}"
            break
        print(f"[{time.strftime('%X')}] {server}: attempt {attempt.name} ({attempt.what})", flush=True)
        results.append(run_attempt(settings, models, server, attempt))
        last = results[-1]
        print(f"[{time.strftime('%X')}] {server}: attempt {attempt.name} {'ok' if last.ok else 'FAILED'} "
              f"{last.reason}".rstrip(), flush=True)  # fmt: skip
        # The rungs address launching, serving and TTS under the overlap scheduler; sampled requests fail the
        # same way on every rung (the sampling ops are the same).
        if last.ok or (last.served and all(v or k == "sampled_answered" for k, v in last.checks.items())):
            break
        # A package the server needed and lacked; SGLang's "Ignore import error when loading <model>" lines name
        # packages of models it skips (deep_gemm, cutlass) on every start, failed or not.
        missing = [line for line in last.error_lines if "No module named" in line and "Ignore import error" not in line]
        if missing and not last.served:  # a package the wheelhouse lacks: no rung brings it
            last.reason += f" | ladder stopped, add the package to wheels.txt: {missing[-1]}"
            break
    return results


def compare_greedy(base: AttemptResult | None, results: list[AttemptResult]) -> None:
    """Greedy ids of each TTS attempt that served against no speculation; a mismatch fails the attempt."""
    for result in results:
        if result.server == "base" or not result.greedy:
            continue
        if base is None or not base.greedy:
            result.checks["greedy_identical"] = False
            result.reason = (result.reason + " | no baseline outputs").lstrip(" |")
            result.ok = False
            continue
        same = True
        for mine, theirs in zip(result.greedy, base.greedy):
            mine["first_divergence"] = first_divergence(mine["output_ids"], theirs["output_ids"])
            same &= mine["first_divergence"] is None
        result.checks["greedy_identical"] = same
        if not same:
            result.ok = False
            result.reason = (result.reason + " | greedy output differs from no speculation").lstrip(" |")


# --- the run --------------------------------------------------------------------------------------


@dataclass
class Report:
    ok: bool
    mode: str
    settings: dict[str, Any]
    device: str
    seconds: float
    servers: dict[str, dict[str, Any]]  # server -> verdict: passed, on which attempt, first attempt ok
    attempts: list[dict[str, Any]]


def verdicts(attempts: list[AttemptResult], servers: Sequence[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for server in servers:
        mine = [a for a in attempts if a.server == server and a.attempt != BROKEN.name]
        passed = next((a for a in mine if a.ok), None)
        out[server] = {
            "passed": passed is not None,
            "attempt": passed.attempt if passed else None,
            "first_attempt_ok": bool(mine) and mine[0].ok,
            "reasons": {a.attempt: a.reason for a in attempts if a.server == server and a.reason},
        }
    return out


def _cell(text: str, limit: int = 300) -> str:
    return text[:limit].replace("|", "/")


def markdown(report: Report, attempts: list[AttemptResult]) -> str:
    run = report.settings
    lines = [
        f"# GPU serving check ({report.mode}): {'PASS' if report.ok else 'FAIL'}",
        "",
        f"{report.device}; {report.seconds:.0f} s; dtype {run['dtype']}, {run['greedy_tokens']} greedy tokens x "
        f"{len(PROMPTS)} prompts, {run['sampled_tokens']} sampled x {len(SAMPLING)}, stride {run['stride']}",
        "",
        "| server | passed | attempt | first attempt | reasons |",
        "|---|---|---|---|---|",
    ]
    for server, v in report.servers.items():
        reasons = "; ".join(f"{k}: {r}" for k, r in v["reasons"].items()) or "-"
        lines.append(f"| {server} | {v['passed']} | {v['attempt']} | {v['first_attempt_ok']} | {_cell(reasons)} |")
    lines += [
        "",
        "| server/attempt | ok | start s | graphs | overlap | checks | timing |",
        "|---|---|---|---|---|---|---|",
    ]
    for a in attempts:
        info = a.server_info
        graphs = "-" if not info else ("off" if info.get("disable_cuda_graph") else f"on ({len(a.graph_lines)} lines)")
        overlap = "-" if not info else ("off" if info.get("disable_overlap_schedule") else "on")
        checks = ", ".join(f"{k}={'ok' if v else 'NO'}" for k, v in a.checks.items()) or _cell(a.reason, 160)
        times = ", ".join(f"{k} {v:g}" for k, v in a.timing.items()) or "-"
        lines.append(f"| {a.server}/{a.attempt} | {a.ok} | {a.startup_s} | {graphs} | {overlap} | {checks} | {times} |")
    lines += [
        "",
        "Per greedy request (TTS): accepted tokens per round, updates, fallback checked/mismatches, first divergence:",
        "",
    ]
    for a in attempts:
        for g in a.greedy if a.server != "base" else []:
            lines.append(
                f"- {a.server}/{a.attempt} `{g['prompt'][:24]}`: accept {g.get('spec_accept_length')}, "
                f"updates {g.get('tts_num_updates')}, fallback {g.get('tts_fallback_checked')}/"
                f"{g.get('tts_fallback_mismatches')}, divergence {g.get('first_divergence')}"
                + (
                    f", suffix/drafter rounds {g.get('tts_suffix_rounds')}/{g.get('tts_drafter_rounds')}"
                    if a.server == "hybrid"
                    else ""
                )
            )
    lines += ["", "Log notes (TTS, gpu_serve's routes, overlap scheduler, CUDA graphs):", ""]
    for a in attempts:
        lines += [f"- {a.server}/{a.attempt}: `{note[-160:]}`" for note in a.notes[:5]]
    return "\n".join(lines) + "\n"


def write_results(settings: Settings, report: Report, attempts: list[AttemptResult]) -> None:
    settings.out.mkdir(parents=True, exist_ok=True)
    (settings.out / "gpu_serve.json").write_text(json.dumps(asdict(report), indent=1))
    (settings.out / "gpu_serve.md").write_text(markdown(report, attempts))
    logs = [Path(a.log) for a in attempts if a.log and Path(a.log).exists()]
    with tarfile.open(settings.out / "server_logs.tar.gz", "w:gz") as tar:
        for a, path in zip([a for a in attempts if a.log and Path(a.log).exists()], logs):
            tar.add(path, arcname=f"{a.server}-{a.attempt}.log")


def device_name(cpu: bool) -> str:
    import torch

    if cpu or not torch.cuda.is_available():
        return f"cpu; torch {torch.__version__}"
    return f"{torch.cuda.get_device_name()}; torch {torch.__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="rehearse on CPU: the CPU layer, one server at a time")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu_serve_out")))
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu_serve_work"), help="models and server logs")
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall time for this script, results included")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--greedy-tokens", type=int, default=256)
    ap.add_argument("--sampled-tokens", type=int, default=128)
    ap.add_argument(
        "--stride", type=int, default=3, help="TTS update stride (> 1 leaves rounds for the fallback check)"
    )
    ap.add_argument("--start-timeout-s", type=float, default=240.0)
    ap.add_argument(
        "--drafters", nargs="+", default=["eagle3", "hybrid", "dflash"], choices=["eagle3", "hybrid", "dflash"]
    )
    ap.add_argument("--rehearse-fallback", action="store_true", help="make the first TTS server's first attempt fail")
    args = ap.parse_args(argv)
    started = time.monotonic()
    settings = Settings(
        cpu=args.cpu, out=args.out, work=args.work, deadline=started + args.budget_s - 15, dtype=args.dtype,
        greedy_tokens=args.greedy_tokens, sampled_tokens=args.sampled_tokens, stride=args.stride,
        start_timeout_s=args.start_timeout_s, drafters=tuple(args.drafters), rehearse_fallback=args.rehearse_fallback,
    )  # fmt: skip
    # run.sh's watchdog sends SIGTERM first: leave through `finally`, which writes what was measured.
    signal.signal(
        signal.SIGTERM, lambda *_: sys.exit(f"check.py: stopped by SIGTERM after {time.monotonic() - started:.0f} s")
    )
    servers = ["base", *settings.drafters]
    attempts: list[AttemptResult] = []
    device = device_name(settings.cpu)
    print(f"[{time.strftime('%X')}] gpu_serve check on {device}; {args.budget_s:.0f} s budget", flush=True)
    try:
        models = build_models(settings.work)
        if settings.cpu:  # two cores: one server at a time
            for server in servers:
                attempts += serve_ladder(settings, models, server)
        else:  # one GPU: every server at once, each down its own ladder
            lock = threading.Lock()

            def ladder(server: str) -> None:
                found = serve_ladder(settings, models, server)
                with lock:
                    attempts.extend(found)

            threads = [threading.Thread(target=ladder, args=(s,), daemon=True) for s in servers]
            for thread in threads:
                thread.start()
                time.sleep(STAGGER_S)  # each server picks its ports before the next starts
            for thread in threads:
                thread.join(timeout=max(1.0, settings.left()))
    except BaseException:
        traceback.print_exc()
    finally:
        base = next((a for a in attempts if a.server == "base" and a.ok), None)
        compare_greedy(base, attempts)
        table = verdicts(attempts, servers)
        report = Report(
            ok=all(v["passed"] for v in table.values()),
            mode="cpu rehearsal" if settings.cpu else "gpu",
            settings={k: v for k, v in asdict(settings).items() if k not in ("out", "work", "deadline")},
            device=device,
            seconds=round(time.monotonic() - started, 1),
            servers=table,
            attempts=[{k: v for k, v in asdict(a).items() if k != "log"} for a in attempts],
        )
        write_results(settings, report, attempts)
        print(markdown(report, attempts), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
