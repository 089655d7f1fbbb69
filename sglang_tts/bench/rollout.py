"""The RL rollout benchmark behind ``scripts/bench_rollout.py``: GRPO-style steps, one server per configuration.

A **step** is what an RL framework sends per optimizer step: ``P`` prompts x ``n`` samples each (temperature 1,
top_p 1 by default), all ``P*n`` requests at once (one thread each) to SGLang's native ``/generate`` with token
ids (the chat template applied here). Every request carries ``custom_params={"tts_group": "<step>-<prompt id>"}``
(the samples of one prompt form a group; a server that knows no group scope ignores the key) and, on
speculative servers, ``tts_return_accept_lengths``. Each step uses different prompts (``steps x P`` held-out
prompts, sampled as ``scripts/bench_long.py`` samples them, in order).

Schedule: one server per configuration at a time; after its start one short unrecorded warm-up request, then all
its steps. At the start of every step the server's prefix cache and server-wide corpus (NGRAM, ``+hybrid``) are
emptied (``/flush_cache``) on every configuration alike; the samples of a step are never flushed between them:
siblings share that corpus, as in a real rollout.

**Policy drift** (``drift``): step 0 runs on the launch weights; before a step ``k >= 1`` whose weights differ
from the server's, ``/update_weights_from_disk {"model_path": CKPT_k, "weight_version": LABEL}`` (SGLang 0.5.23;
on a TTS server it updates the target only, ``--tts-on-target-update`` decides what the drafter does: docs/rl.md).
The answer must be a success; every response then reports the weights that served it (``meta_info.weight_version``)
and one greedy probe request (the first prompt, a few tokens) shows the output changed.

Measured per (configuration, step): makespan (first request sent -> last response), per-sample latency
percentiles, tokens/s (completion tokens / makespan), tokens per verify round (pooled: the per-round accept
lengths where the server returns them, else SGLang's ``spec_accept_length`` x ``spec_verify_ct``), acceptance by
output position, TTS counters, the distinct word 4-gram share per quarter (looping samples) and, in drift mode,
each step's tokens per round as a ratio to the step before a weight change.

Outputs in ``results/<run>/``: results.json (rewritten after every step: every sample, the step log, aggregates),
report.md and PNG plots. A run is resumable: the same command with ``--run NAME`` keeps the finished
(configuration, step) pairs and reruns the rest (a step is the unit: its makespan needs all of it).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from sglang_tts.bench import smoke
from sglang_tts.bench.configs import (
    BenchConfig,
    ConfigError,
    build_configs,
    check_context,
    external_config,
    kinds_needed,
    parse_config_name,
    parse_drafter_args,
    parse_eagle3_shape,
    parse_variants,
    resolve_drafters,
    split_server_args,
)
from sglang_tts.bench.metrics import Bucket, bucket_accept, loops, pooled_accept, sum_opt
from sglang_tts.bench.repetition import REPETITIVE_BELOW
from sglang_tts.bench.report import fmt, machine_info, pyplot, table, write_json
from sglang_tts.bench.runner import (
    DETAILS,
    RequestRecord,
    Response,
    SamplingSettings,
    _digest,
    _post_json,
    flush_cache,
    get_json,
    record_from_response,
    request_timeout,
)
from sglang_tts.bench.server import cpu_launch, waves_kv_tokens
from sglang_tts.bench.workload import BenchPrompt, chat_prompts, prompt_token_counts, sample_prompts
from sglang_tts.data.prompts import Prompt, PromptSourceError

RESULTS = "results.json"
REPORT = "report.md"
MAKESPAN_PLOT = "makespan.png"
POSITION_PLOT = "tokens_per_round_by_position.png"
DRIFT_PLOT = "tokens_per_round_by_step.png"

GROUP_KEY = "tts_group"  # custom_params key naming a request's group (the prompt's samples in one step)
LAUNCH = "launch"  # the weights label of the steps served by the launch weights
NO_SPEC = "no-spec"

DEFAULT_CONFIGS = ("no-spec", "ngram", "stock", "tts-s5-request", "tts-s5-group", "tts-s5-request+hybrid")
# Drift mode: `frozen` is the stale drafter (stock EAGLE3 cannot take a target update: module docstring of
# sglang_tts.sglang.weight_sync), then per-request adaptation and one shared drafter kept or reset at each update.
DRIFT_CONFIGS = ("frozen", "tts-s5-request", "tts-s5-global+keep", "tts-s5-global+reset")
# Tags every rollout run knows (on top of configs.BUILTIN_VARIANTS' +hybrid): what the drafter does at a
# target update.
ROLLOUT_VARIANTS: dict[str, tuple[str, ...]] = {
    "keep": ("--tts-on-target-update", "keep"),
    "reset": ("--tts-on-target-update", "reset"),
}
DEFAULT_DATASETS = ("long-gen", "reasoning")  # the workloads with long answers (docs/workloads.md)
DEFAULT_STEPS = 3
DEFAULT_PROMPTS_PER_STEP = 4
DEFAULT_SAMPLES = 4
DEFAULT_MAX_NEW_TOKENS = 1024
DEFAULT_BUCKET = 128
DEFAULT_WARMUP_TOKENS = 32
DEFAULT_PROBE_TOKENS = 16
DEFAULT_DRIFT_COPIES = 3
DEFAULT_DRIFT_SCALE = 0.02  # generated drift copies: noise of this share of each tensor's std, per step
SGLANG_SPEC_MAX_RUNNING = 48  # SGLang 0.5.23's max_running_requests of speculative servers when unset

# --smoke: the tiny offline models of sglang_tts.bench.smoke (EAGLE-3 only), stride 1 at lr 1e-2.
SMOKE_CONFIGS = ("no-spec", "ngram", "tts-s1-request", "tts-s1-request+hybrid")
SMOKE_DRIFT_CONFIGS = ("no-spec", "frozen", "tts-s1-global+keep", "tts-s1-global+reset")
SMOKE_STEPS = 2
SMOKE_PROMPTS_PER_STEP = 2
SMOKE_SAMPLES = 2
SMOKE_MAX_NEW_TOKENS = 48
SMOKE_BUCKET = 16
SMOKE_DRIFT_COPIES = 1
SMOKE_DRIFT_SCALE = 0.5  # the loopy target's greedy output changes (tests/sglang/test_weight_sync.py's step)
SMOKE_PROMPTS: tuple[Prompt, ...] = (
    *smoke.PROMPTS,
    Prompt("letters-0", "smoke-count", "Recite the alphabet twice."),
    Prompt("poem-0", "smoke-story", "Write a poem that never ends."),
    Prompt("numbers-0", "smoke-count", "List every even number below fifty."),
    Prompt("tale-0", "smoke-story", "Tell the tale of a river that flows in a circle."),
)


# ----------------------------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepPlan:
    """One step: its prompts and the weights that serve it (``weights_path`` None: the launch weights)."""

    index: int
    prompts: tuple[BenchPrompt, ...]
    weights: str = LAUNCH
    weights_path: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.index,
            "weights": self.weights,
            "weights_path": self.weights_path,
            "prompt_ids": [p.id for p in self.prompts],
        }


def weight_labels(drift: Sequence[str]) -> list[str]:
    """A label per drift checkpoint: its folder name, prefixed with its step where two names collide."""
    names = [Path(path).name or str(path) for path in drift]
    return [name if names.count(name) == 1 and name != LAUNCH else f"{k + 1}:{name}" for k, name in enumerate(names)]


def plan_steps(
    prompts: Sequence[BenchPrompt],
    steps: int,
    per_step: int,
    drift: Sequence[str] | None = None,
    same_prompts: bool = False,
) -> list[StepPlan]:
    """``steps`` steps of ``per_step`` consecutive prompts each (different prompts every step; with
    ``same_prompts`` every step takes the first ``per_step``, so a change between steps is the weights',
    not the prompts'). With ``drift``, step 0 runs on the launch weights and step k on ``drift[k - 1]``
    (steps past the last checkpoint stay on it)."""
    if steps < 1 or per_step < 1:
        raise ConfigError(f"steps and prompts per step must be >= 1, got {steps} and {per_step}")
    needed = per_step if same_prompts else steps * per_step
    if len(prompts) < needed:
        raise ConfigError(f"{steps} steps x {per_step} prompts need {needed} prompts, got {len(prompts)}")
    drift = list(drift or [])
    labels = weight_labels(drift)
    out = []
    for k in range(steps):
        first = 0 if same_prompts else k * per_step
        chunk = tuple(prompts[first : first + per_step])
        if k == 0 or not drift:
            out.append(StepPlan(k, chunk))
        else:
            j = min(k, len(drift)) - 1
            out.append(StepPlan(k, chunk, labels[j], str(drift[j])))
    return out


@dataclass
class RolloutSettings:
    """How servers are launched and requests sent (shared by every configuration)."""

    model: str
    sampling: SamplingSettings
    samples: int  # n: samples per prompt
    warmup_tokens: int = DEFAULT_WARMUP_TOKENS  # 0: no warm-up request
    probe_tokens: int = DEFAULT_PROBE_TOKENS  # drift mode: a greedy probe per step (0: none)
    request_timeout_s: float | None = None  # None: sized for max_new_tokens (runner.request_timeout)
    server_timeout_s: float = 900.0
    cpu_defaults: bool = True
    kv_tokens: int | None = None
    base_url: str | None = None  # target this running server instead of launching any
    log_dir: str | None = None
    bucket: int = DEFAULT_BUCKET


@dataclass
class RolloutPlan:
    """Everything a run needs; ``summary`` is the human-readable settings line of report.md."""

    run_dir: Path
    argv: list[str]
    configs: list[BenchConfig]
    steps: list[StepPlan]
    settings: RolloutSettings
    drift: bool = False
    summary: dict[str, Any] = field(default_factory=dict)
    server_info: dict[str, Any] | None = None
    progress: bool = True

    @property
    def prompts(self) -> list[BenchPrompt]:
        return [p for step in self.steps for p in step.prompts]

    def identity(self) -> dict[str, Any]:
        """What a resumed run must share with the results it continues."""
        return {
            "model": self.settings.model,
            "samples": self.settings.samples,
            "prompts_per_step": len(self.steps[0].prompts) if self.steps else 0,
            "sampling": asdict(self.settings.sampling),
            "steps": [s.to_json() for s in self.steps],
        }


# ----------------------------------------------------------------------------------------------------------
# Records
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One rollout sample: a benchmark request record plus where it sits in the run."""

    record: RequestRecord  # record.round is the step; concurrency P*n, wave_wall_s the step's makespan
    step: int
    sample: int  # 0..n-1 within its prompt's group
    group: str  # the custom_params tts_group it was sent with
    weights: str  # the weights label of its step
    weight_version: str | None = None  # what the server said served it (meta_info.weight_version)

    @property
    def config(self) -> str:
        return self.record.config

    def to_json(self) -> dict[str, Any]:
        extra = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "record"}
        return {**self.record.to_json(), **extra}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Sample:
        known = {f.name for f in fields(cls)} - {"record"}
        return cls(RequestRecord.from_json(dict(data)), **{k: data[k] for k in known if k in data})


@dataclass
class StepLog:
    """What happened in one (configuration, step): the server, the update, the probe, any error."""

    config: str
    step: int
    weights: str
    finished: bool = False
    makespan_s: float | None = None
    server_start_s: float | None = None  # set on the step that started the server
    warmup_s: float | None = None
    resumed: bool = False  # a fresh server started here although earlier steps ran in a previous session
    update: dict[str, Any] | None = None  # {"model_path", "weight_version", "success", "message", "seconds"}
    probe: dict[str, Any] | None = None  # {"output_ids", "digest", "weight_version"}
    error: str | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepLog:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


# ----------------------------------------------------------------------------------------------------------
# Aggregates (pure functions)
# ----------------------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


@dataclass
class Counts:
    """What a set of samples adds up to (one step, or a configuration over its steps)."""

    samples: int
    completion_tokens: int
    latency_p50_s: float | None
    latency_p90_s: float | None
    latency_max_s: float | None
    tokens_per_round: float | None  # pooled over verify rounds; None without speculation
    verify_rounds: int | None  # SGLang's spec_verify_ct, summed
    updates_per_sample: float | None  # tts_num_updates (a shared drafter's updates count once per sample)
    ms_per_update: float | None
    skipped_updates: int | None
    looping: int  # samples with a quarter under REPETITIVE_BELOW distinct word 4-grams
    distinct_last_quarter: float | None  # mean share of distinct word 4-grams in the last quarter
    hit_max_tokens: int  # finish_reason "length"


def count(samples: Sequence[Sample]) -> Counts:
    records = [s.record for s in samples]
    latencies = [r.wall_s for r in records]
    updates = sum_opt(r.tts_num_updates for r in records)
    update_ms = sum_opt(r.tts_update_ms for r in records)
    skipped = sum_opt(r.tts_num_skipped_updates for r in records)
    verify = sum_opt(r.spec_verify_ct for r in records)
    last = [r.distinct_ngrams[-1] for r in records if r.distinct_ngrams and r.distinct_ngrams[-1] is not None]
    return Counts(
        samples=len(records),
        completion_tokens=sum(r.completion_tokens for r in records),
        latency_p50_s=percentile(latencies, 50),
        latency_p90_s=percentile(latencies, 90),
        latency_max_s=max(latencies) if latencies else None,
        tokens_per_round=pooled_accept(records),
        verify_rounds=None if verify is None else int(verify),
        updates_per_sample=_ratio(updates, len(records)),
        ms_per_update=_ratio(update_ms, updates),
        skipped_updates=None if skipped is None else int(skipped),
        looping=sum(loops(r) for r in records),
        distinct_last_quarter=sum(last) / len(last) if last else None,
        hit_max_tokens=sum(r.finish_reason == "length" for r in records),
    )


@dataclass
class StepSummary:
    """One configuration's step."""

    config: str
    step: int
    weights: str
    makespan_s: float
    tokens_per_s: float | None  # completion tokens / makespan
    counts: Counts
    speedup_vs_no_spec: float | None = None  # no-spec's makespan of this step / this makespan
    change_ratio: float | None = None  # tokens per round / the previous step's, where the weights changed here


@dataclass
class ConfigSummary:
    """One configuration over its finished steps."""

    config: str
    steps: int
    makespan_s: float  # summed over steps
    tokens_per_s: float | None  # completion tokens / summed makespan
    counts: Counts
    speedup_vs_no_spec: float | None = None  # over the steps both finished: summed makespans, no-spec / this


@dataclass
class RolloutAggregates:
    steps: list[StepSummary]
    configs: list[ConfigSummary]
    buckets: dict[str, list[Bucket]]  # per configuration, pooled over steps (per-round lengths only)
    bucket: int

    def step(self, config: str, step: int) -> StepSummary | None:
        return next((s for s in self.steps if s.config == config and s.step == step), None)

    def config(self, name: str) -> ConfigSummary | None:
        return next((c for c in self.configs if c.config == name), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "bucket": self.bucket,
            "steps": [asdict(s) for s in self.steps],
            "configs": [asdict(c) for c in self.configs],
            "buckets": {name: [asdict(b) for b in buckets] for name, buckets in self.buckets.items()},
        }


def change_ratios(tokens_per_round: Mapping[int, float | None], weights: Mapping[int, str]) -> dict[int, float]:
    """Per step k whose weights differ from step k-1's (both ran): tokens per round at k / at k-1."""
    out = {}
    for k, value in tokens_per_round.items():
        before = tokens_per_round.get(k - 1)
        if k - 1 in weights and weights[k] != weights[k - 1] and value is not None and before:
            out[k] = value / before
    return out


def aggregate(
    samples: Sequence[Sample], logs: Sequence[StepLog], config_names: Sequence[str], bucket: int
) -> RolloutAggregates:
    """Per-step and per-configuration summaries of the finished steps, in configuration then step order."""
    finished = {(log.config, log.step): log for log in logs if log.finished and log.makespan_s is not None}
    by_pair: dict[tuple[str, int], list[Sample]] = {}
    for s in samples:
        if (s.config, s.step) in finished:
            by_pair.setdefault((s.config, s.step), []).append(s)
    names = list(dict.fromkeys([*config_names, *(c for c, _ in finished)]))
    no_spec = {step: log.makespan_s for (c, step), log in finished.items() if c == NO_SPEC}
    step_rows: list[StepSummary] = []
    config_rows: list[ConfigSummary] = []
    buckets: dict[str, list[Bucket]] = {}
    for name in names:
        steps = sorted(step for c, step in finished if c == name)
        if not steps:
            continue
        rows = []
        for step in steps:
            log = finished[(name, step)]
            mine = by_pair.get((name, step), [])
            counts = count(mine)
            makespan = float(log.makespan_s or 0.0)
            rows.append(
                StepSummary(
                    name,
                    step,
                    log.weights,
                    makespan,
                    _ratio(counts.completion_tokens, makespan),
                    counts,
                    _ratio(no_spec.get(step), makespan) if name != NO_SPEC else None,
                )
            )
        ratios = change_ratios({r.step: r.counts.tokens_per_round for r in rows}, {r.step: r.weights for r in rows})
        for r in rows:
            r.change_ratio = ratios.get(r.step)
        step_rows += rows
        mine = [s for step in steps for s in by_pair.get((name, step), [])]
        total = sum(r.makespan_s for r in rows)
        common = [r for r in rows if r.step in no_spec]
        speedup = None
        if name != NO_SPEC and common:
            speedup = _ratio(sum(no_spec[r.step] or 0.0 for r in common), sum(r.makespan_s for r in common))
        counts = count(mine)
        config_rows.append(
            ConfigSummary(name, len(rows), total, _ratio(counts.completion_tokens, total), counts, speedup)
        )
        lengths = bucket_accept([s.record for s in mine], bucket)
        if lengths:
            buckets[name] = lengths
    return RolloutAggregates(step_rows, config_rows, buckets, bucket)


# ----------------------------------------------------------------------------------------------------------
# Resuming
# ----------------------------------------------------------------------------------------------------------


def finished_pairs(logs: Iterable[StepLog]) -> set[tuple[str, int]]:
    return {(log.config, log.step) for log in logs if log.finished}


def check_resumable(previous: Mapping[str, Any], plan: RolloutPlan) -> None:
    """Refuse to continue results that another plan made (other prompts, weights, sampling, or a configuration
    with finished steps whose launch flags differ)."""
    if previous.get("benchmark") != "rollout":
        raise ConfigError(f"{plan.run_dir / RESULTS} is not a rollout benchmark's results.json")
    mine, theirs = plan.identity(), previous.get("identity") or {}
    differing = [key for key in mine if mine[key] != theirs.get(key)]
    if differing:
        raise ConfigError(
            f"--run {plan.run_dir.name}: its results.json was made with other {', '.join(differing)}; "
            "rerun with the same flags to continue it, or name another --run"
        )
    done = {log.config for log in map(StepLog.from_json, previous.get("log") or []) if log.finished}
    stored = {c["name"]: tuple(c.get("server_args") or ()) for c in previous.get("configs") or []}
    changed = [c.name for c in plan.configs if c.name in done and stored.get(c.name) != c.server_args]
    if changed:
        raise ConfigError(
            f"--run {plan.run_dir.name}: configuration(s) {', '.join(changed)} ran with other launch flags there"
        )


def resume_state(previous: Mapping[str, Any]) -> tuple[list[Sample], list[StepLog], list[dict[str, Any]]]:
    """The finished (configuration, step) pairs' samples and logs; the other logs with errors (kept for the
    record: those steps run again)."""
    logs = [StepLog.from_json(log) for log in previous.get("log") or []]
    done = finished_pairs(logs)
    samples = [s for s in map(Sample.from_json, previous.get("samples") or []) if (s.config, s.step) in done]
    earlier = [asdict(log) for log in logs if not log.finished and log.error]
    return samples, [log for log in logs if log.finished], [*previous.get("earlier_errors", []), *earlier]


def pending_work(
    configs: Sequence[BenchConfig], steps: Sequence[StepPlan], done: set[tuple[str, int]]
) -> list[tuple[BenchConfig, list[StepPlan]]]:
    """Per configuration (in order), the steps still to run; configurations with none are left out."""
    out = []
    for config in configs:
        todo = [step for step in steps if (config.name, step.index) not in done]
        if todo:
            out.append((config, todo))
    return out


# ----------------------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------------------


def group_id(step: int, prompt: BenchPrompt) -> str:
    return f"{step}-{prompt.id}"


def sample_id(step: int, prompt: BenchPrompt, sample: int) -> str:
    """What a sample's seed is derived from (``--sampling-seed``): one seed per (step, prompt, sample), the same
    in every configuration, so they all sample the same n answers (on CPU: seeded verify, docs/cpu.md)."""
    return f"{group_id(step, prompt)}/{sample}"


def custom_params(group: str, details: bool) -> dict[str, Any]:
    """A rollout request's custom_params: its group, and the per-round accept lengths on speculative servers."""
    return {**(DETAILS if details else {}), GROUP_KEY: group}


def generate(
    base_url: str, prompt: BenchPrompt, params: Mapping[str, Any], custom: Mapping[str, Any], timeout: float
) -> dict[str, Any]:
    """SGLang's native ``/generate`` with the prompt's token ids; the raw answer."""
    if prompt.input_ids is None:
        raise ValueError(f"prompt {prompt.id} has no token ids (the chat template needs the target's tokenizer)")
    payload = {"input_ids": list(prompt.input_ids), "sampling_params": {**params, "custom_params": dict(custom)}}
    return _post_json(base_url + "/generate", payload, timeout)


def response_of(out: Mapping[str, Any]) -> Response:
    """The parts of a ``/generate`` answer a record keeps (as runner.send_generate builds them)."""
    meta = out.get("meta_info") or {}
    return Response(
        dict(meta),
        int(meta.get("completion_tokens", len(out.get("output_ids") or []))),
        meta.get("prompt_tokens"),
        _digest(out.get("output_ids", out.get("text"))),
        out.get("text"),
    )


def update_weights(base_url: str, model_path: str, weight_version: str, timeout: float) -> dict[str, Any]:
    """``/update_weights_from_disk``; raises unless SGLang answers success (a failed load answers 400)."""
    start = time.perf_counter()
    answer = _post_json(
        base_url + "/update_weights_from_disk", {"model_path": model_path, "weight_version": weight_version}, timeout
    )
    seconds = time.perf_counter() - start
    if not answer.get("success"):
        raise RuntimeError(f"/update_weights_from_disk {model_path} did not succeed: {answer}")
    return {
        "model_path": model_path,
        "weight_version": weight_version,
        "success": True,
        "message": answer.get("message"),
        "seconds": seconds,
    }


# ----------------------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------------------


@dataclass
class RunState:
    samples: list[Sample] = field(default_factory=list)
    logs: list[StepLog] = field(default_factory=list)


class RolloutRunner:
    """Runs each configuration's pending steps on its own server (or the external one); ``on_step`` is called
    after every step, finished or failed (e.g. to save results.json)."""

    def __init__(self, plan: RolloutPlan, state: RunState, on_step: Callable[[], None] | None = None) -> None:
        self.plan = plan
        self.settings = plan.settings
        self.state = state
        self.on_step = on_step
        self._server: Any = None  # sglang_tts.bench.server.ServerProcess
        self._weights: str = LAUNCH  # what the current server serves

    def run(self, work: Sequence[tuple[BenchConfig, Sequence[StepPlan]]]) -> None:
        done = finished_pairs(self.state.logs)
        per_step = sum(len(step.prompts) for _, steps in work for step in steps) * self.settings.samples
        bar = tqdm(total=per_step, desc="samples", unit="sample", disable=not self.plan.progress, dynamic_ncols=True)
        try:
            for config, steps in work:
                self._run_config(config, steps, done, bar)
        finally:
            self._stop()
            bar.close()

    def _run_config(
        self, config: BenchConfig, steps: Sequence[StepPlan], done: set[tuple[str, int]], bar: tqdm
    ) -> None:
        base_url: str | None = None
        end = bar.n + sum(len(step.prompts) for step in steps) * self.settings.samples
        for i, step in enumerate(steps):
            log = StepLog(config.name, step.index, step.weights)
            log.resumed = any(c == config.name and k < step.index for c, k in done) and i == 0
            self.state.logs.append(log)
            try:
                if base_url is None:
                    bar.set_postfix_str(f"{config.name}: starting server")
                    base_url = self._start(config, log)
                self._run_step(base_url, config, step, log, bar)
                log.finished = True
            except Exception as error:  # noqa: BLE001 - recorded; the other configurations still run
                log.error = f"{type(error).__name__}: {error}"
                if self._server is not None:
                    log.error += "\nserver log tail:\n" + self._server.log_tail(40)
                tqdm.write(f"[rollout] {config.name} failed in step {step.index}: {log.error.splitlines()[0]}")
                bar.update(max(0, end - bar.n))
                if self.on_step is not None:
                    self.on_step()
                break  # its later steps would run on a server in an unknown state: they rerun on resuming
            if self.on_step is not None:
                self.on_step()
        self._stop()

    def _start(self, config: BenchConfig, log: StepLog) -> str:
        s = self.settings
        self._weights = LAUNCH
        if s.base_url is not None:
            return s.base_url
        from sglang_tts.bench.server import start_server

        start = time.perf_counter()
        self._server = start_server(
            s.model,
            config.server_args,
            cpu_defaults=s.cpu_defaults,
            timeout_s=s.server_timeout_s,
            log_dir=s.log_dir,
            kv_tokens=s.kv_tokens,
            die_with_parent=True,  # a killed benchmark leaves no server behind (called from the main thread)
        )
        log.server_start_s = time.perf_counter() - start
        if s.warmup_tokens > 0:
            # One-time costs of a fresh server (lazy init, the first update's setup) stay out of the first step.
            prompt = self.plan.steps[0].prompts[0]
            params = s.sampling.generate_params(s.warmup_tokens)
            start = time.perf_counter()
            generate(self._server.base_url, prompt, params, custom_params("warmup", config.speculative), 600.0)
            log.warmup_s = time.perf_counter() - start
        return self._server.base_url

    def _stop(self) -> None:
        if self._server is not None:
            from sglang_tts.bench.server import stop_server

            stop_server(self._server)
        self._server = None

    def _run_step(self, base_url: str, config: BenchConfig, step: StepPlan, log: StepLog, bar: tqdm) -> None:
        s = self.settings
        if step.weights != self._weights:
            bar.set_postfix_str(f"{config.name} step {step.index}: updating weights")
            if step.weights_path is None:
                raise RuntimeError(
                    f"step {step.index} runs on the launch weights, but the server serves {self._weights}"
                )
            flush_cache(base_url)  # idle first: SGLang flushes after the update, which fails while requests run
            update_timeout = request_timeout(0, s.request_timeout_s)
            log.update = update_weights(base_url, step.weights_path, step.weights, update_timeout)
            self._weights = step.weights
        if self.plan.drift and s.probe_tokens > 0:
            log.probe = self._probe(base_url)
        bar.set_postfix_str(f"{config.name} step {step.index}: flush")
        flush_cache(base_url)  # every configuration, every step: the siblings of this step share what follows
        bar.set_postfix_str(f"{config.name} step {step.index} ({step.weights})")
        jobs = [(prompt, j) for prompt in step.prompts for j in range(s.samples)]
        timeout = request_timeout(s.sampling.max_new_tokens, s.request_timeout_s)

        def one(prompt: BenchPrompt, j: int) -> tuple[dict[str, Any], float, float]:
            params = s.sampling.generate_params(prompt_id=sample_id(step.index, prompt, j))
            sent = time.perf_counter()
            custom = custom_params(group_id(step.index, prompt), config.speculative)
            out = generate(base_url, prompt, params, custom, timeout)
            done = time.perf_counter()
            return out, done - sent, done

        start = time.perf_counter()
        results: dict[int, tuple[dict[str, Any], float, float]] = {}
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            futures = {pool.submit(one, prompt, j): i for i, (prompt, j) in enumerate(jobs)}
            for future in as_completed(futures):
                results[futures[future]] = future.result()  # the first failure fails the step
                bar.update(1)
        makespan = max(end for _, _, end in results.values()) - start
        for i, (prompt, j) in enumerate(jobs):
            out, wall, _ = results[i]
            response = response_of(out)
            record = record_from_response(config.name, prompt, step.index, response, wall, s.sampling.label)
            record.concurrency, record.wave_wall_s = len(jobs), makespan
            group = group_id(step.index, prompt)
            version = response.meta.get("weight_version")
            self.state.samples.append(Sample(record, step.index, j, group, step.weights, version))
        log.makespan_s = makespan

    def _probe(self, base_url: str) -> dict[str, Any]:
        """A short greedy request on the run's first prompt: its output changes with the target's weights."""
        s = self.settings
        prompt = self.plan.steps[0].prompts[0]
        params = replace(s.sampling, temperature=0.0, top_p=1.0, top_k=-1).generate_params(s.probe_tokens)
        out = generate(base_url, prompt, params, {GROUP_KEY: "probe"}, 600.0)
        ids = list(out.get("output_ids") or [])
        meta = out.get("meta_info") or {}
        return {"output_ids": ids, "digest": _digest(ids), "weight_version": meta.get("weight_version")}


@dataclass
class RolloutResult:
    run_dir: Path
    results: Path
    report: Path
    plots: list[str]
    failures: list[str]


def _payload(
    plan: RolloutPlan, state: RunState, sessions: list[dict[str, Any]], earlier: list[dict[str, Any]]
) -> dict[str, Any]:
    configs = [c.to_json() for c in plan.configs]
    names = [c.name for c in plan.configs]
    aggregates = aggregate(state.samples, state.logs, names, plan.settings.bucket)
    return {
        "benchmark": "rollout",
        "run": plan.run_dir.name,
        "started": sessions[0]["started"],
        "command": shlex.join(plan.argv),
        "argv": plan.argv,
        "machine": sessions[-1]["machine"],
        "sessions": sessions,
        "drift": plan.drift,
        "settings": {**plan.summary, "bucket": plan.settings.bucket},
        "runner": asdict(plan.settings),
        "identity": plan.identity(),
        "server_info": plan.server_info,
        "configs": configs,
        "steps": [s.to_json() for s in plan.steps],
        "prompts": [p.to_json() for p in plan.prompts],
        "log": [asdict(log) for log in state.logs],
        "earlier_errors": earlier,
        "samples": [s.to_json() for s in state.samples],
        "aggregates": aggregates.to_json(),
    }


def run_rollout(plan: RolloutPlan) -> RolloutResult:
    """Run (or continue) the plan, saving results.json after every step, then write report.md and the plots."""
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    if plan.settings.log_dir is None and plan.settings.base_url is None:
        (plan.run_dir / "server_logs").mkdir(exist_ok=True)
        plan.settings.log_dir = str(plan.run_dir / "server_logs")
    results = plan.run_dir / RESULTS
    state, sessions, earlier = RunState(), [], []
    if results.is_file():
        previous = json.loads(results.read_text())
        check_resumable(previous, plan)
        state.samples, state.logs, earlier = resume_state(previous)
        sessions = list(previous.get("sessions") or [])
    sessions.append({"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": plan.argv, "machine": machine_info()})
    work = pending_work(plan.configs, plan.steps, finished_pairs(state.logs))
    pairs, kept = sum(len(steps) for _, steps in work), len(finished_pairs(state.logs))
    print(f"[rollout] {pairs} (configuration, step) pairs to run, {kept} kept from {results}", file=sys.stderr)

    def save() -> None:
        write_json(results, _payload(plan, state, sessions, earlier))

    save()
    RolloutRunner(plan, state, save).run(work)
    if hasattr(os, "getloadavg"):
        sessions[-1]["machine"]["load_average_end"] = list(os.getloadavg())
    return finish(plan.run_dir, _payload(plan, state, sessions, earlier))


def finish(run_dir: Path, payload: dict[str, Any]) -> RolloutResult:
    """Aggregate ``payload``'s samples, then write results.json, report.md and the plots."""
    samples = [Sample.from_json(s) for s in payload.get("samples") or []]
    logs = [StepLog.from_json(log) for log in payload.get("log") or []]
    names = [c["name"] for c in payload.get("configs") or []]
    bucket = int(payload["settings"].get("bucket") or DEFAULT_BUCKET)
    aggregates = aggregate(samples, logs, names, bucket)
    payload["aggregates"] = aggregates.to_json()
    plots = write_plots(aggregates, run_dir, bool(payload.get("drift")))
    report = run_dir / REPORT
    report.write_text(render_report(payload, aggregates, logs, plots, samples))
    results = write_json(run_dir / RESULTS, payload)
    failures = [f"{log.config} (step {log.step})" for log in logs if log.error]
    return RolloutResult(run_dir, results, report, plots, failures)


def rerender(results_json: Path, bucket: int | None = None) -> RolloutResult:
    """Rebuild the aggregates, report.md and plots from a results.json (optionally with another bucket)."""
    path = Path(results_json)
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"--from-json {path}: cannot read it ({error})") from None
    if payload.get("benchmark") != "rollout":
        raise ConfigError(f"--from-json {path}: not a rollout benchmark's results.json")
    if bucket is not None:
        if bucket < 1:
            raise ConfigError(f"--bucket must be >= 1, got {bucket}")
        payload["settings"]["bucket"] = bucket
    return finish(path.parent, payload)


def summary_lines(result: RolloutResult) -> list[str]:
    lines = [f"results: {result.results}", f"report:  {result.report}", *(f"plot:    {p}" for p in result.plots)]
    if result.failures:
        lines.append("FAILED: " + ", ".join(result.failures))
    return lines


# ----------------------------------------------------------------------------------------------------------
# report.md
# ----------------------------------------------------------------------------------------------------------


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _updates(counts: Counts) -> str:
    if counts.updates_per_sample is None:
        return "-"
    return f"{counts.updates_per_sample:.1f} ({fmt(counts.ms_per_update, 0)} ms)"


def config_table(aggregates: RolloutAggregates) -> str:
    header = [
        "config",
        "steps",
        "samples",
        "makespan s",
        "vs no-spec",
        "p50 s",
        "p90 s",
        "max s",
        "tok/s",
        "tokens/round",
        "updates/sample (ms each)",
        "looping",
    ]
    rows = [
        [
            c.config,
            str(c.steps),
            str(c.counts.samples),
            fmt(c.makespan_s, 1),
            _x(c.speedup_vs_no_spec),
            fmt(c.counts.latency_p50_s, 1),
            fmt(c.counts.latency_p90_s, 1),
            fmt(c.counts.latency_max_s, 1),
            fmt(c.tokens_per_s),
            fmt(c.counts.tokens_per_round),
            _updates(c.counts),
            str(c.counts.looping),
        ]
        for c in aggregates.configs
    ]
    return table(header, rows) if rows else "_No step finished._"


def step_table(aggregates: RolloutAggregates) -> str:
    header = ["config", "step", "weights", "makespan s", "vs no-spec", "p50 s", "p90 s", "max s"]
    header += ["tokens", "tok/s", "tokens/round", "hit max", "looping"]
    rows = [
        [
            s.config,
            str(s.step),
            s.weights,
            fmt(s.makespan_s, 1),
            _x(s.speedup_vs_no_spec),
            fmt(s.counts.latency_p50_s, 1),
            fmt(s.counts.latency_p90_s, 1),
            fmt(s.counts.latency_max_s, 1),
            str(s.counts.completion_tokens),
            fmt(s.tokens_per_s),
            fmt(s.counts.tokens_per_round),
            f"{s.counts.hit_max_tokens}/{s.counts.samples}",
            str(s.counts.looping),
        ]
        for s in aggregates.steps
    ]
    return table(header, rows, "lrl" + "r" * 10) if rows else "_No step finished._"


def drift_table(aggregates: RolloutAggregates, steps: Sequence[Mapping[str, Any]]) -> str:
    """Tokens per round per configuration and step; in brackets the ratio to the step before a weight change."""
    columns = [int(s["step"]) for s in steps]
    header = ["config", *(f"step {k} ({s['weights']})" for k, s in zip(columns, steps))]
    rows = []
    for c in aggregates.configs:
        row = [c.config]
        for k in columns:
            s = aggregates.step(c.config, k)
            if s is None:
                row.append("-")
                continue
            value = fmt(s.counts.tokens_per_round)
            row.append(value + (f" ({s.change_ratio:.2f}x)" if s.change_ratio is not None else ""))
        rows.append(row)
    return table(header, rows) if rows else "_No step finished._"


def frozen_reference(names: Sequence[str]) -> str | None:
    """The stale drafter every drift configuration is compared with: the first ``frozen`` configuration."""
    return next((n for n in names if n.split(":", 1)[-1] == "frozen"), None)


def relative_table(aggregates: RolloutAggregates, steps: Sequence[Mapping[str, Any]], reference: str) -> str:
    """Tokens per round of every other configuration as a ratio to ``reference``'s on the same step (same
    prompts, same weights: what adaptation gains over the stale drafter as the policy moves)."""
    columns = [int(s["step"]) for s in steps]
    header = ["config", *(f"step {k} ({s['weights']})" for k, s in zip(columns, steps))]
    rows = []
    for c in aggregates.configs:
        if c.config == reference or c.counts.tokens_per_round is None:
            continue
        row = [c.config]
        for k in columns:
            mine, ref = aggregates.step(c.config, k), aggregates.step(reference, k)
            ratio = _ratio(mine.counts.tokens_per_round if mine else None, ref.counts.tokens_per_round if ref else None)
            row.append(_x(ratio))
        rows.append(row)
    return table(header, rows) if rows else "_Nothing to compare._"


def position_table(aggregates: RolloutAggregates) -> str:
    if not aggregates.buckets:
        return "_No per-round accept lengths were recorded (no-spec, stock and ngram servers return none)._"
    names = list(aggregates.buckets)
    starts = sorted({b.start for buckets in aggregates.buckets.values() for b in buckets})
    rows = []
    for start in starts:
        row = [f"{start}-{start + aggregates.bucket - 1}"]
        for name in names:
            b = next((b for b in aggregates.buckets[name] if b.start == start), None)
            row.append(f"{fmt(b.mean)} ({b.rounds})" if b else "-")
        rows.append(row)
    return table(["output tokens", *names], rows)


def updates_table(logs: Sequence[StepLog], samples_by_pair: Mapping[tuple[str, int], set[str | None]]) -> str:
    rows = []
    for log in logs:
        if not log.finished or (log.update is None and log.probe is None):
            continue
        update = log.update or {}
        probe = log.probe or {}
        served = ", ".join(str(v) for v in sorted(samples_by_pair.get((log.config, log.step), set()), key=str))
        rows.append(
            [
                log.config,
                str(log.step),
                log.weights,
                "yes" if update.get("success") else ("-" if not update else "no"),
                fmt(update.get("seconds"), 1) if update else "-",
                served or "-",
                str(probe.get("digest", "-")),
            ]
        )
    if not rows:
        return "_No weight update or probe was recorded._"
    header = ["config", "step", "weights", "update ok", "update s", "weight_version served", "probe output digest"]
    return table(header, rows, "lrlrrll")


def probe_agreement(logs: Sequence[StepLog]) -> list[str]:
    """Sentences: whether greedy probes agree across configurations per step and change with the weights."""
    by_step: dict[int, dict[str, str]] = {}
    for log in logs:
        if log.finished and log.probe:
            by_step.setdefault(log.step, {})[log.config] = log.probe["digest"]
    if not by_step:
        return []
    disagree = [str(k) for k, d in sorted(by_step.items()) if len(set(d.values())) > 1]
    out = [
        "Greedy probe (the first prompt, a few tokens): "
        + (
            "every configuration wrote the same output at every step."
            if not disagree
            else f"configurations differ at step(s) {', '.join(disagree)} (fp32 summation order can flip near-ties)."
        )
    ]
    digests = {k: set(d.values()) for k, d in by_step.items()}
    unchanged = [k for k in sorted(digests) if k - 1 in digests and digests[k] == digests[k - 1]]
    if unchanged:
        out.append(
            f"The probe output did not change from the step before at step(s) {', '.join(map(str, unchanged))} "
            "(a small update may leave the first greedy tokens as they were: see the weight_version served)."
        )
    return out


def sample_agreement(samples: Sequence[Sample], seed: Any) -> list[str]:
    """A sentence for a seeded run: did every configuration write the same text for each (step, prompt, sample)?
    Then the makespans compare the same tokens; unseeded sampled runs draw their own samples (no sentence)."""
    if seed in (None, "none"):
        return []
    by_sample: dict[tuple[int, str, int], dict[str, str | None]] = {}
    for s in samples:
        by_sample.setdefault((s.step, s.group, s.sample), {})[s.config] = s.record.output_digest
    shared = {k: d for k, d in by_sample.items() if len(d) > 1}
    if not shared:
        return []
    differ = sorted(k for k, d in shared.items() if len(set(d.values())) > 1)
    head = f"Seeded samples (`--sampling-seed {seed}`, one seed per step, prompt and sample): "
    if not differ:
        return [
            head + f"every configuration wrote the same text for each of the {len(shared)} samples they share, "
            "so their makespans compare the same tokens."
        ]
    named = ", ".join(f"{group}/{j}" for _, group, j in differ[:6]) + (" ..." if len(differ) > 6 else "")
    return [
        head + f"{len(differ)} of {len(shared)} samples differ between configurations ({named}): their makespans "
        "compare different texts there (a seeded answer is exact on CPU for batches of one sampling option; "
        "fp32 summation order can still flip a near-tie)."
    ]


def steps_share_prompts(steps: Sequence[Mapping[str, Any]]) -> bool:
    """Did every step sample the same prompts (--same-prompts)?"""
    return len(steps) > 1 and all(list(s["prompt_ids"]) == list(steps[0]["prompt_ids"]) for s in steps)


def render_report(
    payload: Mapping[str, Any],
    aggregates: RolloutAggregates,
    logs: Sequence[StepLog],
    plots: Sequence[str],
    samples: Sequence[Sample] = (),
) -> str:
    machine = payload.get("machine") or {}
    settings = payload.get("settings") or {}
    configs = [BenchConfig.from_json(c) for c in payload.get("configs") or []]
    drift = bool(payload.get("drift"))
    order = {c.name: i for i, c in enumerate(configs)}
    logs = sorted(logs, key=lambda log: (order.get(log.config, len(order)), log.step))  # resumed ones ran last
    out = [
        f"# RL rollout benchmark{' (policy drift)' if drift else ''}: {payload.get('run')}",
        "",
        f"Command: `{payload.get('command')}`",
        "",
        f"Machine: {machine.get('cpu_count')} CPUs, {machine.get('platform')}, GPU {machine.get('gpu') or 'none'}; "
        f"torch {machine.get('torch')}, sglang {machine.get('sglang')}; load average at start "
        f"{', '.join(fmt(x) for x in machine.get('load_average') or []) or 'n/a'}.",
        "",
        "Settings: " + "; ".join(f"{k} = {v}" for k, v in settings.items()) + ".",
        "",
        "Configurations: "
        + "; ".join(f"`{c.name}` ({' '.join(c.server_args) or 'no extra flags'})" for c in configs)
        + ".",
        "",
        "Steps: "
        + "; ".join(f"{s['step']}: {s['weights']}, prompts {', '.join(s['prompt_ids'])}" for s in payload["steps"])
        + ".",
        "",
        "## Per configuration (all its steps)",
        "",
        config_table(aggregates),
        "",
        "## Per step",
        "",
        step_table(aggregates),
    ]
    agreement = sample_agreement(samples, ((payload.get("identity") or {}).get("sampling") or {}).get("seed"))
    if agreement:
        out += ["", *agreement]
    if drift:
        out += [
            "",
            "## Policy drift: tokens per round per step",
            "",
            "In brackets: the ratio to the step before, where the weights changed at this step. "
            + (
                "Every step samples the same prompts, so that ratio is the weights' change (and the samples'); "
                if steps_share_prompts(payload["steps"])
                else "Every step has its own prompts, so that ratio moves with the prompts too; "
            )
            + "configurations on one step share prompts and weights.",
            "",
            drift_table(aggregates, payload["steps"]),
            *_relative_section(aggregates, payload["steps"]),
            "",
            "### Weight updates",
            "",
            updates_table(logs, _versions(payload)),
            "",
            *probe_agreement(logs),
        ]
    out += [
        "",
        f"## Tokens per round by output position (pooled over steps; mean (rounds), buckets of {aggregates.bucket})",
        "",
        position_table(aggregates),
    ]
    looping = [c for c in aggregates.configs if c.counts.looping]
    out += [
        "",
        "Repetition: "
        + (
            "; ".join(f"{c.config} {c.counts.looping} of {c.counts.samples} samples loop" for c in looping)
            if looping
            else "no sample loops"
        )
        + f" (a quarter of its text under {REPETITIVE_BELOW:.0%} distinct word 4-grams: a loop is easy to draft).",
    ]
    if plots:
        out += ["", "## Plots", "", *(f"![{Path(p).stem}]({Path(p).name})" for p in plots)]
    failures = [log for log in logs if log.error]
    earlier = payload.get("earlier_errors") or []
    if failures or earlier:
        out += ["", "## Failures", ""]
        out += [f"- {log.config}, step {log.step}: {log.error.splitlines()[0]}" for log in failures if log.error]
        out += [
            f"- (an earlier session, rerun since) {e['config']}, step {e['step']}: {str(e['error']).splitlines()[0]}"
            for e in earlier
        ]
    starts = [log.server_start_s for log in logs if log.server_start_s is not None]
    resumed = [f"{log.config} at step {log.step}" for log in logs if log.resumed]
    out += [
        "",
        "## Schedule",
        "",
        f"{len(starts)} server starts"
        + (f" ({sum(starts) / len(starts):.0f} s each on average)" if starts else "")
        + f" in {len(payload.get('sessions') or [])} session(s). One server per configuration runs all its steps "
        "after one unrecorded warm-up request; every step starts with /flush_cache."
        + (
            f" Resumed on a fresh server (a drafter that adapts across steps started over): {', '.join(resumed)}."
            if resumed
            else ""
        ),
        "",
        "## Definitions",
        "",
        "- step: P prompts x n samples, all sent at once; makespan: first request sent -> last response received.",
        "- vs no-spec: no-spec's makespan / this makespan (same step; over all: summed over the steps both ran).",
        "- p50 / p90 / max s: per-sample latency (its request sent -> its response), client-side.",
        "- tok/s: completion tokens / makespan (the server's output rate with P x n requests in flight).",
        "- tokens/round: tokens per verify round, bonus included, pooled over rounds: the per-round accept lengths "
        "TTS servers return, else SGLang's spec_accept_length x spec_verify_ct (stock, ngram).",
        "- updates/sample: tts_num_updates per sample; one update trains the rounds of every sample in its window "
        "(one shared drafter, or each request's adapter with --tts-scope request) and counts once for each of them, "
        "so summed over samples it exceeds the server's updates. ms each: tts_update_ms / updates.",
        "- hit max: samples that stopped at max_new_tokens; looping: samples with a quarter of their text under "
        f"{REPETITIVE_BELOW:.0%} distinct word 4-grams.",
    ]
    if drift:
        out += [
            "- drift: before a step whose weights differ, /update_weights_from_disk loads them into the target (a TTS "
            "server's drafter keeps its own weights; `+keep` / `+reset`: `--tts-on-target-update`); "
            "`weight_version served` is meta_info.weight_version of the step's samples.",
        ]
    return "\n".join(out) + "\n"


def _relative_section(aggregates: RolloutAggregates, steps: Sequence[Mapping[str, Any]]) -> list[str]:
    reference = frozen_reference([c.config for c in aggregates.configs])
    if reference is None:
        return []
    title = f"Tokens per round as a ratio to `{reference}` (the stale drafter) on the same step:"
    return ["", title, "", relative_table(aggregates, steps, reference)]


def _versions(payload: Mapping[str, Any]) -> dict[tuple[str, int], set[str | None]]:
    out: dict[tuple[str, int], set[str | None]] = {}
    for s in payload.get("samples") or []:
        out.setdefault((s["config"], s["step"]), set()).add(s.get("weight_version"))
    return out


# ----------------------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------------------


def plot_makespan(aggregates: RolloutAggregates, path: Path) -> Path | None:
    """Makespan per step, one bar per configuration."""
    if not aggregates.steps:
        return None
    plt = pyplot()
    names = [c.config for c in aggregates.configs]
    steps = sorted({s.step for s in aggregates.steps})
    width = 0.8 / max(1, len(names))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(steps) * max(1, len(names)) / 2 + 2), 4.2))
    for i, name in enumerate(names):
        xs = [k + (i - (len(names) - 1) / 2) * width for k in steps]
        ys = [s.makespan_s if (s := aggregates.step(name, k)) else math.nan for k in steps]
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks(steps, [f"step {k}" for k in steps])
    ax.set_ylabel("makespan (s)")
    ax.set_title("makespan per step (P x n samples at once)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_position(aggregates: RolloutAggregates, path: Path) -> Path | None:
    """Tokens per round along the output, one line per configuration with per-round data (pooled over steps)."""
    if not aggregates.buckets:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    for name, buckets in aggregates.buckets.items():
        ax.plot([b.start + b.size / 2 for b in buckets], [b.mean for b in buckets], marker="o", ms=3, label=name)
    ax.set_xlabel("output position (tokens, bucket centre)")
    ax.set_ylabel("tokens per verify round")
    ax.set_title("tokens per round along the output (all steps)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_drift(aggregates: RolloutAggregates, path: Path) -> Path | None:
    """Tokens per round per step, one line per speculative configuration."""
    lines = {
        c.config: [(s.step, s.counts.tokens_per_round) for s in aggregates.steps if s.config == c.config]
        for c in aggregates.configs
        if c.counts.tokens_per_round is not None
    }
    if not lines:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    for name, points in lines.items():
        ax.plot([k for k, _ in points], [math.nan if v is None else v for _, v in points], marker="o", label=name)
    weights = {s.step: s.weights for s in aggregates.steps}
    ax.set_xticks(sorted(weights), [f"{k}\n{weights[k]}" for k in sorted(weights)], fontsize=8)
    ax.set_xlabel("step (weights serving it)")
    ax.set_ylabel("tokens per verify round")
    ax.set_title("tokens per round as the policy moves")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(aggregates: RolloutAggregates, out_dir: Path, drift: bool) -> list[str]:
    writers: list[tuple[str, Callable[[RolloutAggregates, Path], Path | None]]] = [
        (MAKESPAN_PLOT, plot_makespan),
        (POSITION_PLOT, plot_position),
    ]
    if drift:
        writers.append((DRIFT_PLOT, plot_drift))
    written = [writer(aggregates, out_dir / name) for name, writer in writers]
    return [str(p) for p in written if p is not None]


# ----------------------------------------------------------------------------------------------------------
# Drifted copies of a target (smoke mode, or --drift without checkpoints)
# ----------------------------------------------------------------------------------------------------------

DRIFT_READY = ".drift_ready.json"


def make_drift_checkpoints(source: Path, out_dir: Path, copies: int, scale: float, seed: int = 0) -> list[Path]:
    """``copies`` checkpoints of ``source``'s architecture, a random walk from its weights: copy k adds to copy
    k-1 Gaussian noise of ``scale`` x each tensor's std (norms and integer tensors untouched). Config and
    tokenizer files are copied. Written once (a marker records the recipe) and reused."""
    import torch
    from safetensors.torch import load_file, save_file

    from sglang_tts.assets import file_lock

    if copies < 1 or scale <= 0:
        raise ConfigError(f"drift copies must be >= 1 and the scale > 0, got {copies} and {scale}")
    source, out_dir = Path(source), Path(out_dir)
    weights = sorted(source.glob("*.safetensors"))
    if not weights:
        raise ConfigError(f"{source} has no *.safetensors weights to make drifted copies of")
    paths = [out_dir / f"{source.name}-drift{k}" for k in range(1, copies + 1)]
    recipe = {"format": 1, "source": str(source.resolve()), "copies": copies, "scale": scale, "seed": seed}
    with file_lock(out_dir.parent / f".{out_dir.name}.lock"):
        marker = out_dir / DRIFT_READY
        if marker.is_file() and json.loads(marker.read_text()) == recipe:
            return paths
        shutil.rmtree(out_dir, ignore_errors=True)
        out_dir.mkdir(parents=True)
        generator = torch.Generator().manual_seed(seed)
        states = {w.name: load_file(str(w)) for w in weights}
        for path in paths:
            path.mkdir()
            for item in source.iterdir():
                if item.suffix == ".safetensors":
                    continue
                (shutil.copytree if item.is_dir() else shutil.copy2)(item, path / item.name)
            for name, state in states.items():
                for key, t in state.items():
                    if not t.is_floating_point() or "norm" in key or t.numel() < 2:
                        continue
                    noise = torch.randn(t.shape, generator=generator, dtype=torch.float32)
                    state[key] = (t.float() + scale * t.float().std() * noise).to(t.dtype)
                save_file(state, str(path / name), metadata={"format": "pt"})
        marker.write_text(json.dumps(recipe) + "\n")  # written last
    return paths


# ----------------------------------------------------------------------------------------------------------
# From the command line to a plan
# ----------------------------------------------------------------------------------------------------------


@dataclass
class RolloutArgs:
    """The command line of scripts/bench_rollout.py (None: the default, or the smoke default)."""

    smoke: bool = False
    from_json: Path | None = None
    configs: list[str] | None = None
    drafter_kind: list[str] | None = None
    drafter: list[str] = field(default_factory=list)
    model: str | None = None
    eagle3_shape: str = "chain"
    tts_lr: float | None = None
    server_arg: list[str] = field(default_factory=list)
    variant: list[str] = field(default_factory=list)
    base_url: str | None = None
    device: str = "auto"
    datasets: list[str] | None = None
    seed: int = 0
    steps: int | None = None
    prompts_per_step: int | None = None
    same_prompts: bool = False  # every step samples the same prompts (step 0's)
    samples: int | None = None
    max_new_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool | None = None
    sampling_seed: int | None = None  # a seed per (step, prompt, sample); None: unseeded
    drift: list[str] | None = None  # [] : make drifted copies of the target
    drift_copies: int | None = None
    drift_scale: float | None = None
    bucket: int | None = None
    warmup_tokens: int | None = None
    probe_tokens: int = DEFAULT_PROBE_TOKENS
    request_timeout: float | None = None
    server_timeout: float = 900.0
    out: Path = Path("results")
    run: str | None = None
    smoke_dir: Path | None = None
    quiet: bool = False


def parse_names(names: Sequence[str], drift: bool) -> None:
    """Refuse a bad configuration name before anything is prepared; in drift mode refuse stock."""
    for name in names:
        spec = parse_config_name(name)
        if drift and spec.variant == "stock":
            raise ConfigError(
                f"{name}: a stock EAGLE3/DFLASH server loads the target's checkpoint into its drafter too (EAGLE-3: "
                "the scheduler dies; docs/rl.md); the stale drafter under drift is `frozen`"
            )


def select_prompts(datasets: Sequence[str], total: int, seed: int) -> list[Prompt]:
    """``total`` prompts, an equal seeded sample from each dataset, interleaved (as bench_long samples them)."""
    per = -(-total // len(datasets))
    try:
        prompts = sample_prompts(datasets, per, seed)
    except PromptSourceError as error:
        raise ConfigError(f"{error}: fewer steps or prompts per step, or more --datasets") from None
    return prompts[:total]


def build_plan(args: RolloutArgs, argv: list[str]) -> RolloutPlan:
    """Resolve models, drafters, prompts, drift checkpoints and configurations (smoke defaults where unset)."""
    drift_mode = args.drift is not None
    if args.configs:
        names = list(args.configs)
    elif args.base_url:
        names = []  # the running server's configuration: no-spec unless --configs names it
    elif args.smoke:
        names = list(SMOKE_DRIFT_CONFIGS if drift_mode else SMOKE_CONFIGS)
    else:
        names = list(DRIFT_CONFIGS if drift_mode else DEFAULT_CONFIGS)
    parse_names(names, drift_mode)
    per_step = args.prompts_per_step or (SMOKE_PROMPTS_PER_STEP if args.smoke else DEFAULT_PROMPTS_PER_STEP)
    samples = args.samples or (SMOKE_SAMPLES if args.smoke else DEFAULT_SAMPLES)
    if per_step < 1 or samples < 1:
        raise ConfigError(f"--prompts-per-step and --samples must be >= 1, got {per_step} and {samples}")
    if args.temperature < 0:
        raise ConfigError(f"--temperature must be >= 0, got {args.temperature}")
    sampling = SamplingSettings(
        max_new_tokens=args.max_new_tokens or (SMOKE_MAX_NEW_TOKENS if args.smoke else DEFAULT_MAX_NEW_TOKENS),
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        ignore_eos=bool(args.ignore_eos if args.ignore_eos is not None else args.smoke),
        seed=args.sampling_seed,
    )
    kinds = list(args.drafter_kind or ("eagle3",))
    shape = parse_eagle3_shape(args.eagle3_shape)
    variants = {**ROLLOUT_VARIANTS, **parse_variants(args.variant)}
    tts_lr = args.tts_lr if args.tts_lr is not None else (smoke.TTS_LR if args.smoke else None)
    server_info = None
    if args.smoke:
        models = smoke.prepare_smoke_models(args.smoke_dir)
        model = str(models.target)
        drafters = {**models.drafters, **parse_drafter_args(args.drafter, kinds)}
    elif args.base_url:
        try:
            server_info = get_json(args.base_url.rstrip("/") + "/server_info")
        except OSError as error:
            raise ConfigError(f"--base-url {args.base_url}: cannot read /server_info ({error})") from None
        model = args.model or server_info.get("tokenizer_path") or server_info.get("model_path")
        drafters = {}
    else:
        from sglang_tts.assets import resolve_model

        model = str(resolve_model(args.model))
        drafters = resolve_drafters(
            kinds_needed(names, kinds), parse_drafter_args(args.drafter, kinds), Path(model).name
        )

    # The steps' weights: given checkpoints, or (--drift alone) drifted copies of the target.
    drift: list[str] = []
    if drift_mode:
        drift = [str(Path(p).expanduser()) for p in args.drift or []]
        if not drift:
            copies = args.drift_copies or (SMOKE_DRIFT_COPIES if args.smoke else DEFAULT_DRIFT_COPIES)
            scale = args.drift_scale or (SMOKE_DRIFT_SCALE if args.smoke else DEFAULT_DRIFT_SCALE)
            root = Path(model).parent if args.smoke else _drift_cache()
            out = root / f"{Path(model).name}-drift-x{copies}-s{scale:g}-seed{args.seed}"
            drift = [str(p) for p in make_drift_checkpoints(Path(model), out, copies, scale, args.seed)]
        missing = [p for p in drift if not (Path(p) / "config.json").is_file()]
        if missing and not args.base_url:
            raise ConfigError(f"--drift: no config.json in {', '.join(missing)} (checkpoint folders of the target)")
    steps_n = args.steps or (len(drift) + 1 if drift_mode else (SMOKE_STEPS if args.smoke else DEFAULT_STEPS))

    if args.base_url:
        kind = args.drafter_kind[0] if args.drafter_kind else None
        if len(names) > 1:
            raise ConfigError("--base-url measures one configuration: name it with --configs, e.g. eagle3:tts-s5")
        configs = [external_config(names[0] if names else None, server_info or {}, kind)]
    else:
        extra = split_server_args(args.server_arg)
        if samples * per_step > SGLANG_SPEC_MAX_RUNNING:
            extra = ("--max-running-requests", str(samples * per_step), *extra)
        configs = build_configs(
            names, kinds, drafters, tts_lr=tts_lr, extra_server_args=extra, eagle3_shape=shape, variants=variants
        )

    distinct = per_step if args.same_prompts else steps_n * per_step  # prompts the steps take
    if args.smoke and not args.datasets:
        chosen = list(SMOKE_PROMPTS)
        if len(chosen) < distinct:
            raise ConfigError(f"--smoke has {len(chosen)} prompts: at most {len(chosen) // per_step} steps")
        prompts = chat_prompts(chosen[:distinct], model, instruction=None)
        datasets = sorted({p.dataset for p in prompts})
    else:
        datasets = list(args.datasets or DEFAULT_DATASETS)
        prompts = chat_prompts(select_prompts(datasets, distinct, args.seed), model)
    steps = plan_steps(prompts, steps_n, per_step, drift if drift_mode else None, args.same_prompts)

    cpu = cpu_launch(args.device)
    kv_tokens = None
    summary: dict[str, Any] = {
        "model": model,
        "drafters": ", ".join(f"{k}={v}" for k, v in drafters.items()) or "none",
        "datasets": ", ".join(datasets),
        "seed": args.seed,
        "steps": steps_n,
        "prompts per step": per_step,
        "same prompts every step": args.same_prompts,
        "samples per prompt": samples,
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "ignore_eos": sampling.ignore_eos,
        "sampling_seed": sampling.seed if sampling.seed is not None else "none",
        "tts_lr": tts_lr if tts_lr is not None else "server default",
        "eagle3_shape": args.eagle3_shape,
        "drift": ", ".join(drift) if drift_mode else "off",
        "smoke": args.smoke,
    }
    if not args.base_url:
        # In step order: step k holds [k * P, (k + 1) * P) (with --same-prompts every step holds [0, P)).
        lengths = prompt_token_counts([p for step in steps for p in step.prompts], model)
        check_context(configs, model, max(lengths), sampling.max_new_tokens)
        if cpu:
            # Every sample of a step in flight at once: the KV pool holds the largest step's P prompts n times
            # over, each with a whole answer (a smaller pool makes SGLang queue or retract samples).
            waves = [
                [n for n in lengths[k * per_step : (k + 1) * per_step] for _ in range(samples)] for k in range(steps_n)
            ]
            kv_tokens = waves_kv_tokens(waves, sampling.max_new_tokens)
            summary["kv_pool_tokens"] = kv_tokens
    warmup = (
        args.warmup_tokens
        if args.warmup_tokens is not None
        else (smoke.WARMUP_TOKENS if args.smoke else DEFAULT_WARMUP_TOKENS)
    )
    settings = RolloutSettings(
        model=model,
        sampling=sampling,
        samples=samples,
        warmup_tokens=warmup,
        probe_tokens=args.probe_tokens,
        request_timeout_s=args.request_timeout,
        server_timeout_s=args.server_timeout,
        cpu_defaults=cpu,
        kv_tokens=kv_tokens,
        base_url=args.base_url.rstrip("/") if args.base_url else None,
        bucket=args.bucket or (SMOKE_BUCKET if args.smoke else DEFAULT_BUCKET),
    )
    if settings.bucket < 1:
        raise ConfigError(f"--bucket must be >= 1, got {settings.bucket}")
    run_name = args.run or time.strftime("%Y%m%d-%H%M%S") + ("-smoke" if args.smoke else "")
    return RolloutPlan(
        run_dir=Path(args.out) / run_name,
        argv=argv,
        configs=configs,
        steps=steps,
        settings=settings,
        drift=drift_mode,
        summary=summary,
        server_info=server_info,
        progress=not args.quiet,
    )


def _drift_cache() -> Path:
    from sglang_tts.assets import cache_root

    return cache_root() / "drift"
