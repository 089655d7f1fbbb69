"""One benchmark run from a plan: schedule, run, save raw data as it comes, aggregate, report.

``results/<run>/results.json`` is rewritten after every slot (raw records so far), so an interrupted
long run keeps what it measured; ``rerender`` rebuilds the aggregates, report.md and plots from it.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sglang_tts.bench.configs import BenchConfig, resolve_reference
from sglang_tts.bench.metrics import aggregate_by_sampling
from sglang_tts.bench.report import machine_info, render_markdown, write_json, write_plots
from sglang_tts.bench.runner import RequestRecord, Runner, RunnerSettings, plan_schedule
from sglang_tts.bench.workload import BenchPrompt

RESULTS = "results.json"
REPORT = "report.md"


@dataclass
class BenchPlan:
    """Everything a run needs; ``settings`` is the human-readable summary shown in report.md."""

    run_dir: Path
    argv: list[str]
    configs: list[BenchConfig]
    prompts: list[BenchPrompt]
    runner: RunnerSettings
    rounds: int
    bucket: int
    settings: dict[str, Any] = field(default_factory=dict)
    server_info: dict[str, Any] | None = None  # --base-url: what the running server says about itself
    progress: bool = True


@dataclass
class SuiteResult:
    run_dir: Path
    results: Path
    report: Path
    plots: list[str]
    failures: list[str]


def _payload(plan: BenchPlan, runner: Runner, machine: dict[str, Any], started: str) -> dict[str, Any]:
    runner_settings = asdict(plan.runner)
    return {
        "run": plan.run_dir.name,
        "started": started,
        "command": shlex.join(plan.argv),
        "argv": plan.argv,
        "machine": machine,
        "settings": {**plan.settings, "rounds": plan.rounds, "bucket": plan.bucket},
        "runner": runner_settings,
        "server_info": plan.server_info,
        "configs": [c.to_json() for c in plan.configs],
        "prompts": [p.to_json() for p in plan.prompts],
        "schedule": [asdict(log) for log in runner.slot_logs],
        "requests": [r.to_json() for r in runner.records],
        "aggregates": None,
    }


def finish(run_dir: Path, payload: dict[str, Any]) -> SuiteResult:
    """Aggregate ``payload['requests']``, then write results.json, report.md and the plots."""
    configs = [BenchConfig.from_json(c) for c in payload["configs"]]
    records = [RequestRecord.from_json(r) for r in payload["requests"]]
    bucket = int(payload["settings"]["bucket"])
    by_sampling = aggregate_by_sampling(records, configs, bucket)
    payload["aggregates"] = {label: a.to_json() for label, a in by_sampling.items()}
    plots = [p for label, a in by_sampling.items() for p in write_plots(a, run_dir, label)]
    markdown = render_markdown(
        by_sampling,
        run=payload["run"],
        command=payload["command"],
        machine=payload["machine"],
        settings=payload["settings"],
        configs=configs,
        slot_logs=payload["schedule"],
        plots=plots,
    )
    report = run_dir / REPORT
    report.write_text(markdown)
    results = write_json(run_dir / RESULTS, payload)
    failures = [f"{log['config']} (round {log['round']})" for log in payload["schedule"] if log.get("error")]
    return SuiteResult(run_dir, results, report, plots, failures)


def run_suite(plan: BenchPlan) -> SuiteResult:
    """Run every configuration on every prompt in the interleaved schedule and write all outputs."""
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    if plan.runner.log_dir is None and plan.runner.base_url is None:
        # Server logs next to the results: a failed start is then diagnosable afterwards.
        (plan.run_dir / "server_logs").mkdir(exist_ok=True)
        plan.runner.log_dir = str(plan.run_dir / "server_logs")
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    machine = machine_info()
    schedule = plan_schedule(plan.configs, plan.prompts, plan.rounds)
    runner = Runner(plan.runner)

    def save(current: Runner) -> None:
        write_json(plan.run_dir / RESULTS, _payload(plan, current, machine, started))

    runner.run(schedule, on_slot=save, progress=plan.progress)
    payload = _payload(plan, runner, machine, started)
    if hasattr(os, "getloadavg"):
        payload["machine"]["load_average_end"] = list(os.getloadavg())
    return finish(plan.run_dir, payload)


def rerender(results_json: Path, bucket: int | None = None, reference: str | None = None) -> SuiteResult:
    """Recompute aggregates, report.md and plots from a results.json (optionally with another bucket or
    reference configuration)."""
    payload = json.loads(Path(results_json).read_text())
    if bucket is not None:
        payload["settings"]["bucket"] = bucket
    if reference is not None:
        names = [BenchConfig.from_json(c).name for c in payload["configs"]]
        payload["settings"]["reference"] = resolve_reference(reference, names)
    return finish(Path(results_json).parent, payload)


def summary_lines(result: SuiteResult) -> list[str]:
    """What the CLI prints at the end: where the outputs are and whether anything failed."""
    lines = [f"results: {result.results}", f"report:  {result.report}", *(f"plot:    {p}" for p in result.plots)]
    if result.failures:
        lines.append("FAILED: " + ", ".join(result.failures))
    return lines
