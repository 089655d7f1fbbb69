"""One benchmark run from a plan: schedule, run, save raw data as it comes, aggregate, report; resume.

What ``results/<run>/`` holds while a run goes on:

- ``plan.json``, written before the first request: the plan (model, configurations with their launch
  flags, prompts, sampling, rounds, concurrency, settings) and the command; a resume appends to its
  ``sessions``.
- ``requests.jsonl``: one line per finished unit (a request, or a whole wave at concurrency > 1: its wall
  time needs every request of it) holding the unit and its records, appended, flushed and fsync'd the
  moment it finishes. A kill (even ``kill -9``) loses at most the units in flight; if it struck mid-write,
  the torn last line is dropped on resume and that unit runs again.
- ``results.json``: every record so far, rewritten atomically after each unit and each slot (so
  ``rerender`` works mid-run); at the end with the aggregates, beside report.md and the plots.

``run_suite(plan, resume=True)`` continues an interrupted run: it refuses a plan other than the saved
one, keeps every finished unit of ``requests.jsonl``, sends only the missing ones (a slot with nothing
missing starts no server) and aggregates the records in schedule order, exactly as an uninterrupted run
of the same records would. Without ``resume`` a run folder that already holds a plan is refused.

``run_suite(plan, resume=True, extend=True)`` grows a run instead (hours-long runs are planned small and
extended): the plan may add prompts after the saved ones and change the rounds (and, with them, the KV pool
sized for them), provided every finished unit is still in the new schedule; anything else is refused as
above. plan.json then holds the grown plan and its command, so a later plain resume continues it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sglang_tts.bench.configs import BenchConfig, ConfigError, resolve_reference
from sglang_tts.bench.metrics import aggregate_by_sampling
from sglang_tts.bench.report import machine_info, render_markdown, write_json, write_plots
from sglang_tts.bench.runner import RequestRecord, Runner, RunnerSettings, Unit, plan_schedule
from sglang_tts.bench.workload import BenchPrompt
from sglang_tts.drafters.shipped import SHIPPED_ROOT

RESULTS = "results.json"
REPORT = "report.md"
PLAN = "plan.json"
REQUESTS = "requests.jsonl"
PLAN_FORMAT = 1
# Settings that only shape the report: a resume may change them.
REPORT_ONLY_SETTINGS = ("reference",)
# What an extended run may change besides adding prompts (plan_identity's keys; settings'), all following
# from the prompts and rounds.
EXTENDABLE = ("rounds", "kv_tokens")
EXTENDABLE_SETTINGS = ("prompts", "prompts per dataset", "kv_pool_tokens")
# A drafter shipped in the package is the same drafter in any checkout: a run stopped in one checkout (or
# on one machine) resumes in another, so plans compare its path from the package on.
_SHIPPED_IN_PACKAGE = re.escape("/".join(SHIPPED_ROOT.parts[-3:]))  # sglang_tts/drafters/shipped
_SHIPPED_PATH = re.compile(rf"(?:/[^/\s=]+)*/(?={_SHIPPED_IN_PACKAGE}/)")


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


def plan_identity(plan: BenchPlan) -> dict[str, Any]:
    """What a run measures, as plan.json holds it: a resume must ask for exactly this."""
    r = plan.runner
    identity = {
        "model": r.model,
        "configs": [c.to_json() for c in plan.configs],
        "prompts": [p.to_json() for p in plan.prompts],
        "rounds": plan.rounds,
        "sampling": asdict(r.sampling),
        "temperatures": list(r.temperatures),
        "concurrencies": list(r.concurrencies),
        "api": r.api,
        "stream": r.stream,
        "warmup_tokens": r.warmup_tokens,
        "cpu_defaults": r.cpu_defaults,
        "kv_tokens": r.kv_tokens,
        "server_env": dict(r.server_env),
        "external_server": r.base_url is not None,
        "served_model": r.served_model,
        "settings": {k: v for k, v in plan.settings.items() if k not in REPORT_ONLY_SETTINGS},
    }
    if any(c > 1 for c in r.concurrencies):  # waves only; plans saved before the setting resume unchanged
        identity["warm_prompts"] = r.warm_prompts
    return json.loads(json.dumps(identity))


def _portable(value: Any) -> Any:
    """``value`` (plan.json data) with every shipped drafter's path cut to its path in the package."""
    if isinstance(value, str):
        return _SHIPPED_PATH.sub("<checkout>/", value)
    if isinstance(value, list):
        return [_portable(v) for v in value]
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    return value


def plan_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """How ``current`` (a plan_identity) differs from ``saved``, one line per difference; a shipped
    drafter's checkout folder is not one (_SHIPPED_PATH)."""
    saved, current = _portable(saved), _portable(current)
    out: list[str] = []
    for key in sorted(saved.keys() | current.keys()):
        old, new = saved.get(key), current.get(key)
        if old == new:
            continue
        if key in ("configs", "prompts") and isinstance(old, list) and isinstance(new, list):
            name = "name" if key == "configs" else "id"
            old_names, new_names = [x.get(name) for x in old], [x.get(name) for x in new]
            if old_names != new_names:
                out.append(f"{key}: {' '.join(map(str, new_names))} (saved: {' '.join(map(str, old_names))})")
            else:
                what = "launch flags or drafter" if key == "configs" else "text or token ids"
                changed = [str(a.get(name)) for a, b in zip(old, new) if a != b]
                out.append(f"{key}: the {what} of {', '.join(changed)} changed")
        elif isinstance(old, dict) and isinstance(new, dict):
            for sub in sorted(old.keys() | new.keys()):
                if old.get(sub) != new.get(sub):
                    out.append(f"{key}.{sub}: {new.get(sub)!r} (saved: {old.get(sub)!r})")
        else:
            out.append(f"{key}: {new!r} (saved: {old!r})")
    return out


def extension_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """How ``current`` differs from ``saved`` beyond what an extension may change (more prompts after the
    saved ones, the rounds, what follows from both), one line per difference."""
    old_prompts, new_prompts = saved.get("prompts") or [], current.get("prompts") or []
    out = []
    if new_prompts[: len(old_prompts)] != old_prompts:
        ids = " ".join(str(p.get("id")) for p in old_prompts)
        out.append(f"prompts: an extension keeps the saved prompts first ({ids}) and adds after them")
    settings = {k: v for k, v in (current.get("settings") or {}).items() if k not in EXTENDABLE_SETTINGS}
    keep = {k: v for k, v in (saved.get("settings") or {}).items() if k in EXTENDABLE_SETTINGS}
    grown = {**current, "prompts": old_prompts, "settings": {**settings, **keep}}
    grown.update({k: saved.get(k) for k in EXTENDABLE})
    return out + plan_differences(saved, grown)


def load_saved_plan(run_dir: Path) -> dict[str, Any]:
    """``run_dir``'s plan.json; a ConfigError when there is none to resume."""
    path = Path(run_dir) / PLAN
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--resume: {run_dir} holds no run to continue (no {PLAN})") from None
    except ValueError as error:
        raise ConfigError(f"--resume: {path} is unreadable ({error})") from None
    if saved.get("format") != PLAN_FORMAT or "plan" not in saved:
        raise ConfigError(f"--resume: {path} is not a plan this version can continue (format {saved.get('format')})")
    return saved


@dataclass
class Journal:
    """``requests.jsonl``: one JSON line per finished unit, ``{"unit": ..., "records": [...]}``."""

    path: Path

    def append(self, unit: Unit, records: list[RequestRecord]) -> None:
        """Append the unit's line and make it durable (flushed and fsync'd) before returning."""
        line = json.dumps({"unit": unit.to_json(), "records": [r.to_json() for r in records]}) + "\n"
        with open(self.path, "ab") as out:
            out.write(line.encode())
            out.flush()
            os.fsync(out.fileno())

    def load(self) -> tuple[dict[Unit, list[RequestRecord]], list[str]]:
        """The finished units, and a note for each line dropped. A torn last line (no newline: the process
        died mid-write) is also cut off the file, so that the next append starts on a line of its own."""
        if not self.path.exists():
            return {}, []
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        notes: list[str] = []
        if end < len(data):
            notes.append(f"{self.path.name}: dropped a torn last line ({len(data) - end} bytes); its unit runs again")
            with open(self.path, "r+b") as out:
                out.truncate(end)
                os.fsync(out.fileno())
        done: dict[Unit, list[RequestRecord]] = {}
        for number, line in enumerate(data[:end].split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                unit = Unit.from_json(entry["unit"])
                records = [RequestRecord.from_json(r) for r in entry["records"]]
            except (ValueError, KeyError, TypeError) as error:
                notes.append(f"{self.path.name} line {number}: unreadable ({error}); its unit runs again")
                continue
            if len(records) != unit.requests:
                notes.append(f"{self.path.name} line {number}: {len(records)} of {unit.requests} records; runs again")
            elif unit in done:
                notes.append(f"{self.path.name} line {number}: a unit already finished above; the first is kept")
            else:
                done[unit] = records
        return done, notes


def _earlier_slot_logs(results: Path) -> list[dict[str, Any]]:
    """The slot logs of a run's earlier sessions (its last results.json). Their errors become
    ``error_before_resume``: the units they left are sent again, and fail again (as ``error``) or not."""
    try:
        logs = json.loads(results.read_text()).get("schedule") or []
    except (OSError, ValueError):
        return []
    for log in logs:
        log.setdefault("session", 0)
        if log.get("error"):
            log["error_before_resume"] = log.pop("error")
    return logs


def _payload(
    plan: BenchPlan,
    runner: Runner,
    machine: dict[str, Any],
    saved: dict[str, Any],
    earlier_logs: list[dict[str, Any]],
) -> dict[str, Any]:
    session = len(saved["sessions"]) - 1
    return {
        "run": plan.run_dir.name,
        "started": saved["created"],
        "command": shlex.join(saved["argv"]),
        "argv": saved["argv"],
        "sessions": saved["sessions"],
        "machine": machine,
        "settings": {**plan.settings, "rounds": plan.rounds, "bucket": plan.bucket},
        "runner": asdict(plan.runner),
        "server_info": plan.server_info,
        "configs": [c.to_json() for c in plan.configs],
        "prompts": [p.to_json() for p in plan.prompts],
        "schedule": earlier_logs + [{**asdict(log), "session": session} for log in runner.slot_logs],
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


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def run_suite(
    plan: BenchPlan,
    resume: bool = False,
    on_record: Callable[[Unit, list[RequestRecord]], None] | None = None,
    extend: bool = False,
) -> SuiteResult:
    """Run every configuration on every prompt in the interleaved schedule and write all outputs; with
    ``resume``, continue the run in ``plan.run_dir``; with ``extend`` as well, grow it to ``plan`` (module
    docstring). ``on_record`` is called after each unit is saved."""
    if extend and not resume:
        raise ConfigError("extending a run continues it: extend needs resume")
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    if plan.runner.log_dir is None and plan.runner.base_url is None:
        # Server logs next to the results: a failed start is then diagnosable afterwards.
        (plan.run_dir / "server_logs").mkdir(exist_ok=True)
        plan.runner.log_dir = str(plan.run_dir / "server_logs")
    now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    identity = plan_identity(plan)
    journal = Journal(plan.run_dir / REQUESTS)
    done: dict[Unit, list[RequestRecord]] = {}
    earlier_logs: list[dict[str, Any]] = []
    if resume:
        saved = load_saved_plan(plan.run_dir)
        differences = (extension_differences if extend else plan_differences)(saved["plan"], identity)
        if differences:
            asks = "more than more prompts and rounds over" if extend else "another plan than"
            raise ConfigError(
                f"--resume{' --extend' if extend else ''}: the command line asks for {asks} {plan.run_dir / PLAN}:\n  "
                + "\n  ".join(differences)
                + f"\nContinue with the run's own plan (--resume --run {plan.run_dir.name}, no other plan flags) "
                "or start a new run under another --run"
            )
        done, notes = journal.load()
        for note in notes:
            _log(note)
        earlier_logs = _earlier_slot_logs(plan.run_dir / RESULTS)
    else:
        if (plan.run_dir / PLAN).exists() or journal.path.exists():
            raise ConfigError(
                f"{plan.run_dir} already holds a run: continue it with --resume --run {plan.run_dir.name}, "
                "or choose another --run"
            )
        saved = {"format": PLAN_FORMAT, "run": plan.run_dir.name, "created": now, "argv": plan.argv}
        saved.update(plan=identity, sessions=[])
    schedule = plan_schedule(plan.configs, plan.prompts, plan.rounds)
    runner = Runner(plan.runner)
    units = [p.unit for slot in schedule for p in runner.units(slot)]
    kept = {unit: done[unit] for unit in units if unit in done}
    if extend:
        if len(kept) < len(done):
            raise ConfigError(
                f"--resume --extend: {len(done) - len(kept)} finished units of {plan.run_dir.name} would not be in "
                "the grown schedule (a prompt's round moved): keep each saved prompt in its round (--rounds: one "
                "more per chunk of new prompts), or start a new run"
            )
        saved.update(plan=identity, argv=plan.argv)
    if len(kept) < len(done):
        _log(f"{REQUESTS}: {len(done) - len(kept)} finished units are not in the plan's schedule; ignored")
    finished = sum(unit.requests for unit in kept)
    if resume:
        _log(f"resuming {plan.run_dir.name}: {finished} of {sum(u.requests for u in units)} requests done")
    saved["sessions"].append({"started": now, "argv": plan.argv, "requests_done": finished})
    write_json(plan.run_dir / PLAN, saved)
    machine = machine_info()

    def save(current: Runner) -> None:
        write_json(plan.run_dir / RESULTS, _payload(plan, current, machine, saved, earlier_logs))

    def record(unit: Unit, records: list[RequestRecord]) -> None:
        journal.append(unit, records)  # first: what a resume keeps
        save(runner)
        if on_record is not None:
            on_record(unit, records)

    runner.run(schedule, on_slot=save, progress=plan.progress, on_record=record, done=kept)
    payload = _payload(plan, runner, machine, saved, earlier_logs)
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
