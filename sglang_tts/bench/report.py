"""The benchmark's outputs: results.json (raw records + aggregates + provenance), report.md, PNG plots.

The Markdown states what was measured, including where TTS does not beat the frozen drafter: a
"Where TTS does not win" section lists every such configuration and dataset.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sglang_tts.bench.configs import BenchConfig
from sglang_tts.bench.metrics import ALL, GREEDY, LONG_OUTPUT_TOKENS, Aggregates, Summary, frozen_baseline
from sglang_tts.bench.repetition import REPETITIVE_BELOW
from sglang_tts.bench.runner import parse_mode

# Plot file stems; each run writes ``<stem>_<sampling>.png`` (sampling: greedy, t0.7, ...).
ACCEPTANCE_PLOT = "acceptance_by_position"
DATASET_PLOT = "acceptance_by_dataset"
STRIDE_PLOT = "stride_sweep"
THROUGHPUT_PLOT = "throughput"
PLOTS = (ACCEPTANCE_PLOT, DATASET_PLOT, STRIDE_PLOT, THROUGHPUT_PLOT)


# ----------------------------------------------------------------------------------------------------------
# Provenance and JSON
# ----------------------------------------------------------------------------------------------------------


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """CPU count, platform, library versions, accelerator, load average and the checkout's commit."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "sglang": _version("sglang"),
        "transformers": _version("transformers"),
        "sglang_tts": _version("sglang-tts"),
    }
    try:
        import torch

        info["cuda"] = torch.cuda.is_available()
        if info["cuda"]:
            info["gpu"] = torch.cuda.get_device_name(0)
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        info["cuda"] = False
    if hasattr(os, "getloadavg"):
        info["load_average"] = list(os.getloadavg())
    try:
        # Read-only: the commit the code ran from (uncommitted changes are not recorded).
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, cwd=Path(__file__).parent
        )
        info["git_commit"] = commit.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["git_commit"] = None
    return info


def _clean(value: Any) -> Any:
    """JSON has no NaN: write null instead (readers then see a missing value, not a parse error)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` atomically (a crash mid-write never leaves a truncated results.json)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(json.dumps(_clean(payload), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def write_rows_report(
    out_dir: Path, stem: str, meta: dict[str, Any], rows: Sequence[Any], markdown: str, plot: Callable[[Path], None]
) -> None:
    """A micro-benchmark's report (scripts/bench_kernels.py, bench_linear_ce.py): ``<stem>.json`` (``meta`` and
    the dataclass ``rows``), ``<stem>.md`` (``markdown``) and ``<stem>.png`` (drawn by ``plot``); prints the table."""
    write_json(out_dir / f"{stem}.json", {"meta": meta, "rows": [asdict(r) for r in rows]})
    (out_dir / f"{stem}.md").write_text(markdown)
    plot(out_dir / f"{stem}.png")
    print(markdown)


# ----------------------------------------------------------------------------------------------------------
# Markdown
# ----------------------------------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def fmt_pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.1f}%"


def fmt_signed(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:+.{digits}f}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str | None = None) -> str:
    """A Markdown table; ``align`` is one character per column, l or r (default: first l, rest r)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _kinds(aggregates: Aggregates) -> list[str]:
    return list(dict.fromkeys(s.kind for s in aggregates.summaries if s.kind is not None))


def _tts_all(aggregates: Aggregates, kind: str) -> list[Summary]:
    """The kind's TTS summaries over all data, ordered by stride then async before sync."""
    rows = [s for s in aggregates.summaries if s.kind == kind and s.variant == "tts" and s.dataset == ALL]
    return sorted(rows, key=lambda s: (s.stride or 0, s.sync))


def _ngram_all(aggregates: Aggregates) -> list[Summary]:
    """The ngram configurations' summaries over all data (SGLang's NGRAM: no drafter, no kind)."""
    return [s for s in aggregates.summaries if s.variant == "ngram" and s.dataset == ALL]


def acceptance_tables(aggregates: Aggregates) -> str:
    """Per dataset: frozen vs every TTS configuration, overall and in the last quarter (paper Tables 1/2)."""
    parts: list[str] = []
    names = {s.config for s in aggregates.summaries}
    for kind in _kinds(aggregates):
        tts = _tts_all(aggregates, kind)
        frozen_name = f"{kind}:frozen"
        if not tts or aggregates.summary(frozen_name) is None:
            continue
        # (title, Summary attribute, Comparison attribute, Summary attribute counting the requests or None)
        for label, attr, gain, count in (
            ("whole output", "accept_mean", "accept_gain_pct", None),
            ("last quarter of each output", "accept_last_quarter", "last_quarter_gain_pct", None),
            ("quarters of each output that do not loop", "accept_new_text", "new_text_gain_pct", None),
            (
                f"outputs of at least {LONG_OUTPUT_TOKENS} tokens that never loop (frozen's count in brackets)",
                "accept_long_clean",
                "long_clean_gain_pct",
                "long_clean_requests",
            ),
        ):
            header = ["dataset", "frozen"]
            for t in tts:
                baseline = frozen_baseline(t.config, kind, names)
                short = t.config.split(":", 1)[1]
                header.append(short if baseline == frozen_name else f"{short} (% vs {baseline.split(':', 1)[1]})")
            rows = []
            for dataset in [*aggregates.datasets, ALL]:
                frozen = aggregates.summary(frozen_name, dataset)
                row = [dataset, fmt(getattr(frozen, attr) if frozen else None)]
                if count is not None and frozen is not None:
                    row[1] += f" ({getattr(frozen, count)})"
                for s in tts:
                    mine = aggregates.summary(s.config, dataset)
                    comparison = aggregates.comparison(s.config, dataset)
                    value = fmt(getattr(mine, attr) if mine else None)
                    row.append(f"{value} ({fmt_pct(getattr(comparison, gain) if comparison else None)})")
                rows.append(row)
            parts.append(f"**{kind}, {label}** (tokens per round; % vs frozen)\n\n" + table(header, rows))
    return "\n\n".join(parts) if parts else "_No frozen + TTS pair was run._"


def stride_tables(aggregates: Aggregates) -> str:
    """Acceptance, throughput and update cost per stride, relative to frozen (paper Tables 3/7/8)."""
    header = [
        "config",
        "S",
        "mode",
        "accept",
        "vs frozen",
        "2nd half",
        "last 1/4",
        "vs frozen",
        "tok/s",
        "tok/s vs frozen",
        "updates/req",
        "ms/update",
        "update % of wall",
        "updates-free tok/s",
    ]
    parts = []
    for kind in _kinds(aggregates):
        rows = []
        frozen = aggregates.summary(f"{kind}:frozen")
        for s in ([frozen] if frozen else []) + _tts_all(aggregates, kind):
            c = aggregates.comparison(s.config)
            per_req = s.updates / s.requests if s.updates is not None and s.requests else None
            other = c is not None and c.baseline != f"{kind}:frozen"
            rows.append(
                [
                    f"{s.config} (vs {c.baseline})" if other else s.config,
                    str(s.stride) if s.stride else "-",
                    "frozen" if s.variant == "frozen" else ("sync" if s.sync else "async"),
                    fmt(s.accept_mean),
                    fmt_pct(c.accept_gain_pct) if c else "-",
                    fmt(s.accept_second_half),
                    fmt(s.accept_last_quarter),
                    fmt_pct(c.last_quarter_gain_pct) if c else "-",
                    fmt(s.tokens_per_s),
                    fmt(c.tokens_per_s_ratio) + "x" if c and c.tokens_per_s_ratio is not None else "-",
                    fmt(per_req, 1),
                    fmt(s.ms_per_update, 1),
                    fmt(100 * s.update_wall_fraction, 1) if s.update_wall_fraction is not None else "n/a",
                    fmt(s.updates_free_tokens_per_s) if s.sync else "-",
                ]
            )
        if rows:
            parts.append(f"**{kind}** (all datasets)\n\n" + table(header, rows, "lllrrrrrrrrrrr"))
    return "\n\n".join(parts) if parts else "_No TTS configuration was run._"


def async_sync_table(aggregates: Aggregates) -> str:
    """Asynchronous vs synchronous updates at each stride where both ran."""
    rows = []
    for kind in _kinds(aggregates):
        by = {(s.stride, s.sync): s for s in _tts_all(aggregates, kind)}
        for (stride, sync), sync_summary in sorted(by.items(), key=lambda kv: kv[0][0] or 0):
            if not sync or (stride, False) not in by:
                continue
            a = by[(stride, False)]
            bound = sync_summary.updates_free_tokens_per_s
            rows.append(
                [
                    kind,
                    str(stride),
                    fmt(a.tokens_per_s),
                    fmt(sync_summary.tokens_per_s),
                    fmt(bound),
                    fmt(a.tokens_per_s / sync_summary.tokens_per_s) + "x" if sync_summary.tokens_per_s else "n/a",
                    fmt(100 * a.tokens_per_s / bound, 0) + "%" if bound else "n/a",
                    f"{fmt(a.accept_mean)} / {fmt(sync_summary.accept_mean)}",
                ]
            )
    if not rows:
        return "_No stride ran both asynchronously and with `--tts-sync` (add e.g. tts-s5 and tts-s5-sync)._"
    header = ["kind", "S", "async tok/s", "sync tok/s", "updates-free bound", "async / sync", "async / bound", "accept"]
    return table(header, rows)


def throughput_table(aggregates: Aggregates) -> str:
    """Tokens/s of no-spec, ngram, stock, frozen and TTS at its best stride (highest tokens/s among async strides)."""
    base = aggregates.summary("no-spec")
    rows = []
    if base is not None:
        rows.append(["no-spec", fmt(base.tokens_per_s), "1.00x", "-", "-"])
    for s in _ngram_all(aggregates):
        ratio = fmt(s.tokens_per_s / base.tokens_per_s) + "x" if base and base.tokens_per_s else "n/a"
        rows.append([s.config, fmt(s.tokens_per_s), ratio, "-", fmt(s.accept_mean)])
    for kind in _kinds(aggregates):
        frozen = aggregates.summary(f"{kind}:frozen")
        best = aggregates.summary(aggregates.best_tts[kind]) if kind in aggregates.best_tts else None
        stock = aggregates.summary(f"{kind}:stock")
        for s, label in ((stock, "stock"), (frozen, "frozen"), (best, "best TTS")):
            if s is None:
                continue
            rows.append(
                [
                    f"{s.config} ({label})",
                    fmt(s.tokens_per_s),
                    fmt(s.tokens_per_s / base.tokens_per_s) + "x" if base and base.tokens_per_s else "n/a",
                    fmt(s.tokens_per_s / frozen.tokens_per_s) + "x" if frozen and frozen.tokens_per_s else "n/a",
                    fmt(s.accept_mean),
                ]
            )
    if not rows:
        return "_Nothing ran._"
    return table(["config", "tok/s", "vs no-spec", "vs frozen", "accept"], rows)


def position_table(aggregates: Aggregates) -> str:
    """Pooled acceptance per output-position bucket, one column per speculative configuration."""
    rows_by = [s for s in aggregates.summaries if s.dataset == ALL and s.buckets]
    if not rows_by:
        return "_No per-round accept lengths were recorded._"
    starts = sorted({b.start for s in rows_by for b in s.buckets})
    size = rows_by[0].buckets[0].size
    rows = []
    for start in starts:
        row = [f"{start}-{start + size - 1}"]
        for s in rows_by:
            bucket = next((b for b in s.buckets if b.start == start), None)
            row.append(f"{fmt(bucket.mean)} ({bucket.rounds})" if bucket else "-")
        rows.append(row)
    return table(["output tokens", *(s.config for s in rows_by)], rows)


def quarter_table(aggregates: Aggregates) -> str | None:
    """Pooled tokens per round by quarter of each output, all rounds and the quarters that do not loop, one
    row per speculative configuration (pooled over datasets); a drafter configuration beside its frozen
    baseline (metrics.frozen_baseline) shows the gain per quarter (the paper's shape: the last quarter's
    gain against the first's)."""
    rows_by = [s for s in aggregates.summaries if s.dataset == ALL and s.buckets]
    if not rows_by:
        return None
    names = {s.config for s in aggregates.summaries}
    rows = []
    for s in rows_by:
        baseline = frozen_baseline(s.config, s.kind, names)
        frozen = aggregates.summary(baseline) if baseline is not None else None
        for label, attr in (("all rounds", "accept_by_quarter"), ("no loop", "accept_by_quarter_new_text")):
            mine = getattr(s, attr)
            base = getattr(frozen, attr) if frozen is not None and frozen is not s else None
            cells = []
            for q in range(4):
                cell = fmt(mine[q])
                if base is not None and mine[q] is not None and base[q]:
                    cell += f" ({fmt_pct((mine[q] / base[q] - 1) * 100)})"
                cells.append(cell)
            rows.append([s.config, label, *cells])
    return table(["configuration", "rounds", "Q1", "Q2", "Q3", "Q4"], rows)


def prompt_ttft_table(aggregates: Aggregates) -> str | None:
    """Prompt adaptation's work and the time to first token, per configuration (None: neither was recorded)."""
    rows_by = [s for s in aggregates.summaries if s.dataset == ALL]
    if not any(s.prompt_positions or s.ttft_mean_s is not None for s in rows_by):
        return None
    rows = [
        [
            s.config,
            str(s.prompt_positions or 0),
            fmt(s.prompt_ms / 1000 / s.requests, 1) if s.prompt_ms and s.requests else "-",
            fmt(s.ttft_mean_s) if s.ttft_mean_s is not None else "-",
        ]
        for s in rows_by
    ]
    return table(["configuration", "prompt positions learned", "prompt update s per request", "mean TTFT s"], rows)


def proposer_table(aggregates: Aggregates) -> str | None:
    """--tts-hybrid: per configuration and dataset, the rounds each proposer drafted, its accepted drafted
    tokens per round (bonus excluded), the requests whose drafter was retired and the updates skipped because
    the drafter drafted none of their stride (None: no hybrid ran)."""
    rows_by = [s for s in aggregates.summaries if s.suffix_rounds is not None]
    if not rows_by:
        return None

    def per_round(accepted: int | None, rounds: int | None) -> str:
        return fmt(accepted / rounds) if accepted is not None and rounds else "-"

    rows = [
        [
            s.config,
            s.dataset,
            str(s.suffix_rounds),
            per_round(s.suffix_accepted, s.suffix_rounds),
            str(s.drafter_rounds or 0),
            per_round(s.drafter_accepted, s.drafter_rounds),
            f"{s.retired_requests or 0} of {s.requests}",
            fmt(s.idle_updates / s.requests, 1) if s.idle_updates is not None and s.requests else "-",
        ]
        for s in rows_by
    ]
    header = [
        "configuration",
        "dataset",
        "suffix rounds",
        "accepted",
        "drafter rounds",
        "accepted",
        "retired",
        "idle updates skipped / request",
    ]
    return table(header, rows)


def prefill_table(aggregates: Aggregates) -> str | None:
    """Prompt tokens per configuration and dataset, and how many SGLang's radix cache served (None: no
    request was served from the cache, so every configuration prefilled the same tokens)."""
    rows_by = [s for s in aggregates.summaries if s.prompt_tokens is not None]
    if not any(s.cached_tokens for s in rows_by):
        return None
    rows = []
    for s in rows_by:
        cached = s.cached_tokens or 0
        rows.append([s.config, s.dataset, str(s.prompt_tokens), str(cached), str(s.prompt_tokens - cached)])
    return table(["configuration", "dataset", "prompt tokens", "from the cache", "prefilled"], rows)


def losses(aggregates: Aggregates) -> list[str]:
    """Plain sentences for every TTS configuration and dataset where TTS does not beat frozen."""
    out = []
    for c in aggregates.comparisons:
        problems = []
        if c.accept_gain_pct is not None and c.accept_gain_pct <= 0:
            problems.append(f"acceptance {fmt_pct(c.accept_gain_pct)}")
        if c.last_quarter_gain_pct is not None and c.last_quarter_gain_pct <= 0:
            problems.append(f"last-quarter acceptance {fmt_pct(c.last_quarter_gain_pct)}")
        if c.tokens_per_s_ratio is not None and c.tokens_per_s_ratio < 1:
            problems.append(f"tokens/s {fmt(c.tokens_per_s_ratio)}x of frozen")
        if problems:
            out.append(f"- {c.config} on {c.dataset}: " + ", ".join(problems))
    return out


def repetition_sentence(repetitive: Sequence[Mapping[str, Any]]) -> str:
    """Which outputs loop in their last quarter (``Aggregates.repetitive``)."""
    if not repetitive:
        return (
            f"Repetition: no output's last quarter fell below {REPETITIVE_BELOW:.0%} distinct word 4-grams (no loops)."
        )
    by_prompt: dict[str, list[str]] = {}
    for item in repetitive:
        by_prompt.setdefault(str(item["prompt_id"]), []).append(f"{item['config']} {fmt(item['last_quarter'])}")
    listed = "; ".join(f"{pid} ({', '.join(entries)})" for pid, entries in sorted(by_prompt.items()))
    return (
        f"Repetition: the last quarter of these outputs has under {REPETITIVE_BELOW:.0%} distinct word 4-grams, "
        f"i.e. the text loops and late acceptance there measures the loop: {listed}."
    )


def _by_concurrency(by_sampling: Mapping[str, Aggregates]) -> dict[str, dict[int, Aggregates]]:
    """{sampling mode without its concurrency: {concurrency: aggregates}} (``greedy-c4`` -> greedy, 4)."""
    groups: dict[str, dict[int, Aggregates]] = {}
    for label, aggregates in by_sampling.items():
        base, concurrency = parse_mode(label)
        groups.setdefault(base, {})[concurrency] = aggregates
    return groups


def _config_names(per_c: Mapping[int, Aggregates], variants: Sequence[str] | None = None) -> list[str]:
    """Configurations with a summary over all datasets at any concurrency, in first-seen order."""
    return list(
        dict.fromkeys(
            s.config
            for c in sorted(per_c)
            for s in per_c[c].summaries
            if s.dataset == ALL and (variants is None or s.variant in variants)
        )
    )


def concurrency_tables(by_sampling: Mapping[str, Aggregates]) -> str:
    """Per sampling mode run at several concurrencies: each configuration's acceptance (gain over the frozen
    drafter of its kind, in tokens per round) and tokens/s (ratio to frozen) side by side per concurrency.
    Empty when every mode ran at one concurrency only."""
    groups = _by_concurrency(by_sampling)
    parts = []
    for base, per_c in groups.items():
        if len(per_c) < 2:
            continue
        concurrencies = sorted(per_c)
        names = _config_names(per_c, ("frozen", "tts"))
        header = ["configuration"]
        header += [f"c={c} accept (gain)" for c in concurrencies]
        header += [f"c={c} tok/s (x frozen)" for c in concurrencies]
        rows = []
        for name in names:
            accept_cells, speed_cells = [], []
            for c in concurrencies:
                mine = per_c[c].summary(name)
                if mine is None:
                    accept_cells.append("-")
                    speed_cells.append("-")
                    continue
                frozen = per_c[c].summary(f"{mine.kind}:frozen")
                gain = None
                ratio = None
                if frozen is not None and mine.variant == "tts":
                    if mine.accept_mean is not None and frozen.accept_mean is not None:
                        gain = mine.accept_mean - frozen.accept_mean
                    if frozen.tokens_per_s > 0:
                        ratio = mine.tokens_per_s / frozen.tokens_per_s
                accept_cells.append(fmt(mine.accept_mean) + (f" ({fmt_signed(gain)})" if gain is not None else ""))
                speed_cells.append(fmt(mine.tokens_per_s, 1) + (f" ({fmt(ratio)}x)" if ratio is not None else ""))
            rows.append([name, *accept_cells, *speed_cells])
        title = _sampling_title(base)
        parts.append(f"**{title}** (tokens per round; gain = TTS - frozen of the same kind)\n\n" + table(header, rows))
    return "\n\n".join(parts)


def reference_tables(by_sampling: Mapping[str, Aggregates], reference: str) -> str:
    """Per sampling mode: every configuration's tokens/s as a ratio to ``reference`` (a configuration name)
    and its acceptance, per concurrency: the comparison a baseline other than frozen needs (a
    controller against the best static configuration, per-request adapters against the shared drafter)."""
    groups = _by_concurrency(by_sampling)
    parts = []
    for base, per_c in groups.items():
        concurrencies = sorted(per_c)
        names = _config_names(per_c)
        header = ["configuration"]
        header += [f"c={c} tok/s (x ref)" for c in concurrencies]
        header += [f"c={c} accept" for c in concurrencies]
        rows = []
        for name in names:
            speed_cells, accept_cells = [], []
            for c in concurrencies:
                mine, ref = per_c[c].summary(name), per_c[c].summary(reference)
                if mine is None:
                    speed_cells.append("-")
                    accept_cells.append("-")
                    continue
                ratio = mine.tokens_per_s / ref.tokens_per_s if ref is not None and ref.tokens_per_s > 0 else None
                speed_cells.append(fmt(mine.tokens_per_s, 1) + (f" ({fmt(ratio)}x)" if ratio is not None else ""))
                accept_cells.append(fmt(mine.accept_mean))
            rows.append([f"{name} (reference)" if name == reference else name, *speed_cells, *accept_cells])
        if all(per_c[c].summary(reference) is None for c in concurrencies):
            parts.append(f"**{_sampling_title(base)}**: the reference `{reference}` did not run.")
            continue
        title = f"**{_sampling_title(base)}** (tokens/s, x the reference; tokens per round)"
        parts.append(title + "\n\n" + table(header, rows))
    return "\n\n".join(parts)


def _sampling_title(sampling: str) -> str:
    """``greedy`` -> "greedy decoding", ``t0.7`` -> "temperature 0.7"."""
    return "greedy decoding" if sampling == GREEDY else f"temperature {sampling.lstrip('t')}"


def _mode_title(label: str) -> str:
    base, concurrency = parse_mode(label)
    title = _sampling_title(base)
    return title if concurrency == 1 else f"{title}, {concurrency} concurrent requests"


def _mode_sections(
    aggregates: Aggregates, label: str, plots: Sequence[str], level: str, seeded: bool = False
) -> list[str]:
    """The tables of one sampling mode (``level`` is the Markdown heading prefix of its sections; ``seeded``:
    the sampled requests carried a seed per prompt, ``--sampling-seed``)."""
    out = [
        f"{level} Acceptance per dataset: frozen vs TTS",
        "",
        acceptance_tables(aggregates),
        "",
        f"{level} Stride sweep",
        "",
        stride_tables(aggregates),
        "",
        f"{level} Asynchronous vs synchronous updates",
        "",
        async_sync_table(aggregates),
        "",
        f"{level} Throughput",
        "",
        throughput_table(aggregates),
        "",
        f"{level} Acceptance by output position (pooled over datasets; mean (rounds))",
        "",
        position_table(aggregates),
        "",
    ]
    quarters = quarter_table(aggregates)
    if quarters is not None:
        title = f"{level} Acceptance by quarter of each output (pooled over datasets; % vs its frozen baseline)"
        out += [title, "", quarters, ""]
    prompt = prompt_ttft_table(aggregates)
    if prompt is not None:
        out += [f"{level} Prompt adaptation and time to first token", "", prompt, ""]
    prefill = prefill_table(aggregates)
    if prefill is not None:
        title = f"{level} Prefill (wall times include it; cache hits can differ between configurations)"
        out += [title, "", prefill, ""]
    proposers = proposer_table(aggregates)
    if proposers is not None:
        out += [f"{level} Hybrid proposers (accepted: drafted tokens per round, bonus excluded)", "", proposers, ""]
    out += [
        f"{level} Where TTS does not win",
        "",
    ]
    if not aggregates.comparisons:
        out.append("No TTS configuration ran next to a frozen one of the same kind: nothing to compare.")
    else:
        out += losses(aggregates) or [
            "TTS beat frozen on acceptance (overall and last quarter) and tokens/s in every comparison."
        ]
    agreement = aggregates.output_agreement
    out += ["", f"{level} Outputs", ""]
    greedy = parse_mode(label)[0] == GREEDY
    if greedy or seeded:
        differing = agreement.get("differing") or []
        total = agreement.get("prompts", 0)
        what = "Greedy decoding" if greedy else "Seeded sampling (the same seed per prompt)"
        out.append(
            f"{what}: all configurations produced identical outputs on {total - len(differing)} of {total} "
            "prompts"
            + (
                f"; they differ on {', '.join(differing)} (fp32 summation order can flip near-ties)."
                if differing
                else "."
            )
        )
    else:
        out.append(
            "Temperature sampling: outputs differ between configurations, so per-position numbers compare "
            "different texts; only the distribution is shared."
        )
    out += ["", repetition_sentence(aggregates.repetitive)]
    mine = [p for p in plots if Path(p).stem.endswith(f"_{label}")]
    if mine:
        out += ["", f"{level} Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in mine]
    return out


def render_markdown(
    by_sampling: Mapping[str, Aggregates],
    *,
    run: str,
    command: str,
    machine: dict[str, Any],
    settings: dict[str, Any],
    configs: Sequence[BenchConfig],
    slot_logs: Sequence[dict[str, Any]],
    plots: Sequence[str],
) -> str:
    """report.md: settings, per sampling mode the paper-style tables, where TTS loses and the plots; then
    failures, the schedule and the definitions."""
    gpu = machine.get("gpu") or "none"
    out = [
        f"# Long-reasoning benchmark: {run}",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {machine.get('cpu_count')} CPUs, {machine.get('platform')}, GPU {gpu}; torch "
        f"{machine.get('torch')}, sglang {machine.get('sglang')}; load average at start "
        f"{', '.join(fmt(x) for x in machine.get('load_average') or []) or 'n/a'}.",
        "",
        "Settings: "
        + "; ".join(f"{k} = {v}" for k, v in settings.items() if not isinstance(v, (dict, list)) or v)
        + ".",
        "",
        "Configurations: "
        + "; ".join(f"`{c.name}` ({' '.join(c.server_args) or 'no extra flags'})" for c in configs)
        + ".",
    ]
    seeded = settings.get("sampling_seed", "none") not in ("none", None)
    if not by_sampling:
        out += ["", "_No request completed._"]
    reference = settings.get("reference")
    if reference and by_sampling:
        out += ["", f"## Against the reference `{reference}`", "", reference_tables(by_sampling, reference)]
    sweep = concurrency_tables(by_sampling)
    if sweep:
        out += ["", "## Concurrency sweep", "", sweep]
    for label, aggregates in by_sampling.items():
        out += ["", f"## Sampling: {_mode_title(label)}", "", *_mode_sections(aggregates, label, plots, "###", seeded)]
    failures = [log for log in slot_logs if log.get("error")]
    if failures:
        out += ["", "## Failures", ""]
        out += [f"- round {log['round']}, {log['config']}: {log['error'].splitlines()[0]}" for log in failures]
    starts = [log["server_start_s"] for log in slot_logs if log.get("server_start_s") is not None]
    out += [
        "",
        "## Schedule",
        "",
        f"{len(slot_logs)} slots (configuration x round), {len(starts)} server starts"
        + (f" ({fmt(sum(starts) / len(starts), 0)} s each on average)" if starts else "")
        + ". Each round runs every configuration on the same prompts (each at every temperature), in an order "
        "rotated by one per round; one unrecorded warm-up request follows each server start.",
        "",
        "## Definitions",
        "",
        "- accept: tokens emitted per verify round, bonus included, pooled over rounds (total tokens / rounds).",
        "- 2nd half / last 1/4: rounds whose first token lies in the second half / last quarter of their output.",
        "- tok/s: completion tokens / client-side wall time, pooled; requests run one at a time, except in "
        "modes `-c<N>`, where N requests are sent together and each is charged its wave's wall time / N "
        "(so tok/s is the server's output rate).",
        "- stock: SGLang's own EAGLE3 / DFLASH algorithm with the same drafter (no per-round lengths: its "
        "acceptance is SGLang's spec_accept_length); frozen: TTS with `--tts-freeze`; ngram: SGLang's NGRAM "
        "algorithm (no drafter; acceptance from spec_accept_length too), its corpus emptied before each request.",
        "- best TTS: the asynchronous TTS configuration with the highest tok/s over all datasets.",
        "- ms/update, update % of wall: `tts_update_ms` (overlapped with serving unless `--tts-sync`). In modes "
        "`-c<N>` with one shared drafter (`--tts-scope batch`), each request counts every update made while it "
        "ran, so updates/req and update % of wall count one update up to N times.",
        "- updates-free tok/s (sync only): tokens / (wall - update time): what that acceptance would give if "
        "updates were free; an optimistic bound for the asynchronous executor (it ignores that overlapped "
        "updates still compete for cores).",
        "- repetition: share of distinct word 4-grams in each quarter of an output's text (`distinct_ngrams` in "
        f"results.json); a last quarter below {REPETITIVE_BELOW:.0%} loops, which `--ignore-eos` invites. "
        '"Quarters that do not loop": acceptance over the rounds starting in quarters at or above that share.',
        f"- outputs of at least {LONG_OUTPUT_TOKENS} tokens that never loop: acceptance pooled over the requests "
        "with that many completion tokens and every quarter at or above that share (whole requests).",
    ]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------------------


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_acceptance_by_position(aggregates: Aggregates, path: Path) -> Path | None:
    """Acceptance vs output position, one line per configuration, one panel per drafter kind."""
    kinds = [k for k in _kinds(aggregates) if any(s.kind == k and s.buckets for s in aggregates.summaries)]
    if not kinds:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 4.2), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for s in aggregates.summaries:
            if s.kind != kind or s.dataset != ALL or not s.buckets:
                continue
            x = [b.start + b.size / 2 for b in s.buckets]
            y = [b.mean for b in s.buckets]
            style = {"color": "black", "linestyle": "--"} if s.variant == "frozen" else {}
            ax.plot(x, y, marker="o", markersize=3, label=s.config.split(":", 1)[1], **style)
        ax.set_title(f"{kind}: acceptance along the output")
        ax.set_xlabel("output position (tokens, bucket centre)")
        ax.set_ylabel("accepted tokens per round")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_stride_sweep(aggregates: Aggregates, path: Path) -> Path | None:
    """Acceptance and tokens/s relative to frozen vs the update stride S (async solid, sync dashed).
    Configurations whose stride the update budget picks (``tts``, no fixed S) have no place on it."""
    kinds = [k for k in _kinds(aggregates) if any(s.stride for s in _tts_all(aggregates, k))]
    if not kinds:
        return None
    plt = pyplot()
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    strides = sorted({s.stride for k in kinds for s in _tts_all(aggregates, k) if s.stride})
    for kind in kinds:
        frozen = aggregates.summary(f"{kind}:frozen")
        for sync in (False, True):
            rows = [s for s in _tts_all(aggregates, kind) if s.sync == sync and s.stride]
            label = f"{kind} {'sync (--tts-sync)' if sync else 'async'}"
            style = "--" if sync else "-"
            for ax, attr in ((left, "accept_mean"), (right, "tokens_per_s")):
                base = getattr(frozen, attr) if frozen is not None else None
                if not rows or not base or math.isnan(base):
                    continue
                rel = [_value(s, attr) / base for s in rows]
                ax.plot([s.stride for s in rows], rel, style, marker="o", label=label)
    for ax, ylabel in ((left, "acceptance relative to frozen"), (right, "tokens/s relative to frozen")):
        ax.axhline(1.0, color="gray", linestyle=":", label="frozen")
        ax.set_xscale("log")
        ax.set_xticks(strides)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("update stride S (log scale)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    left.set_title("acceptance vs stride (all datasets)")
    right.set_title("throughput vs stride (all datasets)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_acceptance_by_dataset(aggregates: Aggregates, path: Path) -> Path | None:
    """Mean acceptance per dataset, frozen vs the best TTS configuration, % improvement on each TTS bar."""
    pairs = []
    for kind in _kinds(aggregates):
        frozen = f"{kind}:frozen"
        if kind in aggregates.best_tts and aggregates.summary(frozen) is not None:
            pairs.append((kind, frozen, aggregates.best_tts[kind]))
    if not pairs:
        return None
    plt = pyplot()
    datasets = [*aggregates.datasets, ALL] if len(aggregates.datasets) > 1 else list(aggregates.datasets)
    fig, axes = plt.subplots(1, len(pairs), figsize=(max(5.0, 1.3 * len(datasets) + 2.5) * len(pairs), 4.2))
    axes = list(axes) if len(pairs) > 1 else [axes]
    width = 0.38
    for ax, (kind, frozen, tts) in zip(axes, pairs):
        xs = list(range(len(datasets)))
        f_vals = [_value(aggregates.summary(frozen, d), "accept_mean") for d in datasets]
        t_vals = [_value(aggregates.summary(tts, d), "accept_mean") for d in datasets]
        ax.bar([x - width / 2 for x in xs], f_vals, width, color="0.6", label=frozen.split(":", 1)[1])
        bars = ax.bar([x + width / 2 for x in xs], t_vals, width, color="tab:blue", label=tts.split(":", 1)[1])
        for bar, d in zip(bars, datasets):
            c = aggregates.comparison(tts, d)
            if c is not None and c.accept_gain_pct is not None:
                ax.annotate(
                    fmt_pct(c.accept_gain_pct),
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        ax.set_xticks(xs, datasets, rotation=20 if len(datasets) > 3 else 0)
        ax.set_ylabel("accepted tokens per round")
        ax.set_title(f"{kind}: acceptance per dataset (TTS vs frozen)")
        ax.set_ylim(0, max([v for v in f_vals + t_vals if v == v] + [1.0]) * 1.18)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _value(summary: Summary | None, attr: str) -> float:
    """A summary's value for a bar chart (NaN, i.e. no bar, where missing)."""
    value = getattr(summary, attr) if summary is not None else None
    return math.nan if value is None else float(value)


def plot_throughput(aggregates: Aggregates, path: Path) -> Path | None:
    """Tokens/s of no speculation, NGRAM, stock EAGLE3/DFLASH, frozen and TTS at its best stride (all datasets)."""
    bars: list[tuple[str, float, str]] = []
    base = aggregates.summary("no-spec")
    if base is not None:
        bars.append(("no-spec", base.tokens_per_s, "0.4"))
    bars += [(s.config, s.tokens_per_s, "tab:green") for s in _ngram_all(aggregates)]
    for kind in _kinds(aggregates):
        for name, label, color in (
            (f"{kind}:stock", f"{kind} stock", "tab:orange"),
            (f"{kind}:frozen", f"{kind} frozen", "0.6"),
            (aggregates.best_tts.get(kind), "best", "tab:blue"),
        ):
            s = aggregates.summary(name) if name else None
            if s is not None:
                name = f"{kind} {s.config.split(':', 1)[1]} (best TTS)" if label == "best" else label
                bars.append((name, s.tokens_per_s, color))
    if not bars:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(bars) + 1.5), 4.2))
    drawn = ax.bar(range(len(bars)), [b[1] for b in bars], color=[b[2] for b in bars])
    if base is not None and base.tokens_per_s and not math.isnan(base.tokens_per_s):
        for bar, (_, value, _) in zip(drawn, bars):
            ax.annotate(
                f"{value / base.tokens_per_s:.2f}x",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], rotation=20, ha="right")
    ax.set_ylabel("completion tokens / s")
    ax.set_title("throughput (batch size 1; x = relative to no-spec)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(aggregates: Aggregates, out_dir: Path, label: str = GREEDY) -> list[str]:
    """Every plot that has data, as ``<stem>_<label>.png``; returns the written paths."""
    writers = (
        (ACCEPTANCE_PLOT, plot_acceptance_by_position),
        (DATASET_PLOT, plot_acceptance_by_dataset),
        (STRIDE_PLOT, plot_stride_sweep),
        (THROUGHPUT_PLOT, plot_throughput),
    )
    written = [writer(aggregates, out_dir / f"{stem}_{label}.png") for stem, writer in writers]
    return [str(p) for p in written if p is not None]
