"""What one speculative round costs on CPU, in decode steps: decode, draft, verify and draft-extend times.

For a target and a drafter kind it starts one SGLang server per configuration, one after another:
no speculation, then the drafter verifying each draft-token count (EAGLE-3: a chain of count-1 draft
steps, topk 1; DFlash: a block of `count`). The drafter is random (written with the project's checkpoint
writer): draft, verify and extend times do not depend on its training, and a round then commits about
one token, so its cost shows undiluted. Every server logs the wall time of each phase
(sglang_tts/platform/cpu/round_timing.py); end-to-end times come from the difference of a long and a
short greedy request on the same prompt (the fastest of --repeats each), which cancels the prefill and HTTP
costs. `--temperature T` samples instead, with one fixed seed (the verify then samples every draft row).
`--batch N` sends N copies of each request at once: the N rows decode in lockstep, and the phase medians count
only the calls that ran all N (what a round costs when N requests share the batch, e.g. an RL rollout's
samples).

Reported, per configuration (milliseconds; costs are over the no-spec decode step of the same run):
- decode step: the scheduler's median iteration without speculation, its end-to-end time per token, and
  the target's forward alone;
- round: the median iteration of a round (draft + verify + draft-extend) and its end-to-end time, and
  their costs in decode steps;
- verify (the whole phase, and its target forward alone over the decode forward), the draft phase and one
  drafter forward, and draft-extend.

    python scripts/bench_cpu_round.py --model Qwen2.5-Coder-0.5B-Instruct --out docs/results/cpu-round-qwen
    python scripts/bench_cpu_round.py --model SmolLM2-135M-Instruct --out docs/results/cpu-round-smollm2
    python scripts/bench_cpu_round.py --batch 4 --temperature 1.0 --draft-tokens 2,4 --out docs/results/cpu-round-b4-t1

Writes results.json, report.md and round_cost.png to --out (and prints the Markdown). Run it alone on the
machine: it is a timing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Runnable from a checkout without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_tts.assets import MODELS, prepare_model
from sglang_tts.bench.server import sglang_server
from sglang_tts.platform.cpu.round_timing import TIMING_ENV, read_records

PROMPT = "Write a Python function that parses an ISO-8601 date string and returns a datetime, with tests."


@dataclass(frozen=True)
class RoundConfig:
    """One server: no speculation (draft_tokens 0) or a drafter verifying `draft_tokens` per round."""

    drafter: str  # "none", "eagle3" or "dflash"
    draft_tokens: int = 0

    @property
    def label(self) -> str:
        return "no-spec" if self.drafter == "none" else f"{self.drafter} x{self.draft_tokens}"


@dataclass
class Timing:
    """One configuration's measurements (ms); None where the configuration has no such phase."""

    config: RoundConfig
    e2e_ms_per_step: float  # per output token (no-spec) or per verify round (spec), end to end
    tokens_per_step: float  # output tokens per step (1 without speculation)
    phase_ms: dict[str, float] = field(default_factory=dict)  # median wall time per call, decode-mode calls only
    verify_tokens: int | None = None  # rows of the target's verify forward


def _median_ms(records: Sequence[dict[str, Any]], phase: str, mode: str | None = None) -> float | None:
    # Median, not mean: a call that another process on the machine stalled should not count.
    values = [r["ms"] for r in records if r["phase"] == phase and (mode is None or r.get("mode") == mode)]
    return statistics.median(values) if values else None


def phase_medians(records: Sequence[dict[str, Any]], batch: int | None = None) -> dict[str, float]:
    """Median ms per call of each phase of the decode steps or rounds (prefill calls excluded).

    `iteration` is the scheduler's whole run_batch (a decode step, or a round's draft + verify + extend);
    `draft_forward` is one drafter forward of a draft step. `batch`: only the calls that ran that many
    requests (a wave of concurrent requests shrinks at its end; those calls are another shape)."""
    if batch is not None:
        records = [r for r in records if r.get("batch") == batch]
    rounds = [r for r in records if r["phase"] in ("round", "dflash_round") and r.get("mode") != "extend"]
    medians = {
        "iteration": _median_ms(records, "iteration", "decode"),
        "target_decode": _median_ms(records, "target_forward", "decode"),
        "target_verify": _median_ms(records, "target_forward", "target_verify"),
        "round": statistics.median(r["ms"] for r in rounds) if rounds else None,
        "draft": _median_ms(records, "draft"),
        "draft_forward": _median_ms(records, "draft_forward", "decode"),
        "verify": _median_ms(records, "verify"),
        "draft_extend": _median_ms(records, "draft_extend"),
    }
    return {k: round(v, 3) for k, v in medians.items() if v is not None}


def verify_rows(records: Sequence[dict[str, Any]]) -> int | None:
    rows = {r.get("tokens") for r in records if r["phase"] == "target_forward" and r.get("mode") == "target_verify"}
    return rows.pop() if len(rows) == 1 else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 3) if num is not None and den else None


def summarize(timings: Sequence[Timing]) -> dict[str, Any]:
    """Costs in decode steps, over the no-spec decode step of the same run.

    `steps`: the median scheduler iteration (a round, or a decode step) over the no-spec one: robust to
    another process stalling a few calls. `steps_e2e`: the same from end-to-end request times."""
    base = next(t for t in timings if t.config.drafter == "none")
    step, step_e2e = base.phase_ms.get("iteration"), base.e2e_ms_per_step
    forward = base.phase_ms.get("target_decode")
    rows = []
    for t in timings:
        ms = t.phase_ms
        row: dict[str, Any] = {
            "config": t.config.label,
            "ms": ms.get("iteration"),
            "steps": _ratio(ms.get("iteration"), step),
            "e2e_ms": round(t.e2e_ms_per_step, 2),
            "steps_e2e": _ratio(t.e2e_ms_per_step, step_e2e),
            "tokens_per_step": round(t.tokens_per_step, 3),
        }
        if t.config.drafter != "none":
            row |= {
                "verify_tokens": t.verify_tokens,
                "verify_ms": ms.get("verify"),
                "verify_steps": _ratio(ms.get("verify"), step),
                "target_verify_ms": ms.get("target_verify"),
                "target_verify_over_decode_forward": _ratio(ms.get("target_verify"), forward),
                "draft_ms": ms.get("draft"),
                "draft_forward_ms": ms.get("draft_forward"),
                "draft_extend_ms": ms.get("draft_extend"),
            }
        rows.append(row)
    return {
        "decode_step_ms": step,
        "decode_step_e2e_ms": round(step_e2e, 3),
        "decode_forward_ms": forward,
        "rows": rows,
    }


def markdown(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        f"# CPU round cost: {meta['model']} ({meta['drafter']} drafter, random; "
        f"{meta.get('batch', 1)} request(s) in flight, "
        + ("greedy)" if not meta.get("temperature") else f"sampled at temperature {meta['temperature']}, seeded)"),
        "",
        f"Decode step (no-spec): **{summary['decode_step_ms']:.1f} ms** per scheduler iteration (median), "
        f"{summary['decode_step_e2e_ms']:.1f} ms end to end; the target's decode forward alone "
        f"{summary['decode_forward_ms']:.1f} ms. Costs are in decode steps of this run: a round's median iteration "
        "over the no-spec one (robust to another process stalling a few calls), and the same from end-to-end "
        "request times (e2e). Draft: the draft phase per round and one drafter forward (EAGLE-3 runs "
        "draft tokens - 2 of them; draft-extend makes the first draft token).",
        "",
        "| config | ms / round | round cost | e2e ms | e2e cost | verify rows | verify ms | verify cost"
        " | target verify fwd / decode fwd | draft ms | draft fwd ms | draft-extend ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(value: Any, fmt: str = "{:.2f}") -> str:
        return "" if value is None else fmt.format(value)

    for row in summary["rows"]:
        cells = [
            row["config"], cell(row["ms"], "{:.1f}"), cell(row["steps"]), cell(row["e2e_ms"], "{:.1f}"),
            cell(row["steps_e2e"]), cell(row.get("verify_tokens"), "{}"), cell(row.get("verify_ms"), "{:.1f}"),
            cell(row.get("verify_steps")), cell(row.get("target_verify_over_decode_forward")),
            cell(row.get("draft_ms")), cell(row.get("draft_forward_ms")), cell(row.get("draft_extend_ms")),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Command: `{meta['command']}`", f"Measured {meta['date']}; packed linear: {meta['packed_linear']}."]
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], meta: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    ax.bar([r["config"] for r in rows], [r["steps"] for r in rows], color="tab:blue")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_ylabel("cost in decode steps")
    ax.set_title(f"{meta['model']}: one step / round on CPU")
    for i, r in enumerate(rows):
        ax.text(i, r["steps"], f"{r['steps']:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, max(2.0, max(r["steps"] for r in rows) * 1.15))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------
# Servers and requests
# ---------------------------------------------------------------------------------------------------------


def _generate_wave(
    base_url: str, ids: list[int], new_tokens: int, batch: int, temperature: float = 0.0
) -> tuple[float, list[dict[str, Any]]]:
    """`batch` copies of the same request at once (they decode in lockstep); (seconds, meta_infos)."""
    from concurrent.futures import ThreadPoolExecutor

    start = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        metas = [m for _, m in pool.map(lambda _: _generate(base_url, ids, new_tokens, temperature), range(batch))]
    return time.perf_counter() - start, metas


SAMPLING_SEED = 1234  # sampled requests carry it: every copy and repeat draws the same tokens


def _generate(base_url: str, ids: list[int], new_tokens: int, temperature: float = 0.0) -> tuple[float, dict[str, Any]]:
    """One /generate of exactly `new_tokens`, greedy or sampled with a fixed seed; (seconds, meta_info)."""
    params: dict[str, Any] = {"temperature": temperature, "max_new_tokens": new_tokens, "ignore_eos": True}
    if temperature > 0:
        params["sampling_seed"] = SAMPLING_SEED
    body = json.dumps({"input_ids": ids, "sampling_params": params}).encode()
    request = urllib.request.Request(base_url + "/generate", data=body, headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=1800) as response:
        out = json.loads(response.read())
    return time.perf_counter() - start, out["meta_info"]


def server_args(config: RoundConfig, drafter: Path | None) -> list[str]:
    if config.drafter == "none":
        return []
    args = ["--speculative-draft-model-path", str(drafter)]
    if config.drafter == "eagle3":
        steps = config.draft_tokens - 1
        return [
            "--speculative-algorithm", "EAGLE3", *args, "--speculative-num-steps", str(steps),
            "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(config.draft_tokens),
        ]  # fmt: skip
    return ["--speculative-algorithm", "DFLASH", *args]


def write_drafter(kind: str, model: Path, draft_tokens: int, out: Path, draft_vocab_size: int) -> Path | None:
    from sglang_tts.drafters.checkpoints import write_tiny_dflash, write_tiny_eagle3

    target_config = json.loads((model / "config.json").read_text())
    if kind == "eagle3":
        vocab = min(draft_vocab_size, int(target_config["vocab_size"]))
        return write_tiny_eagle3(out / "eagle3", target_config, layout="midlayer", draft_vocab_size=vocab)
    if kind == "dflash":
        return write_tiny_dflash(out / f"dflash-{draft_tokens}", target_config, block_size=draft_tokens)
    return None


def measure(
    model: Path, config: RoundConfig, drafter: Path | None, ids: list[int], args: argparse.Namespace, work: Path
) -> Timing:
    timing_file = work / f"timing-{config.drafter}-{config.draft_tokens}.jsonl"
    timing_file.touch()
    extra = ["--context-length", str(args.context_length)]
    if args.mem_fraction is not None:
        extra += ["--mem-fraction-static", str(args.mem_fraction)]
    with sglang_server(str(model), [*extra, *server_args(config, drafter)], env={TIMING_ENV: str(timing_file)}) as s:
        wave = functools.partial(_generate_wave, s.base_url, ids, batch=args.batch, temperature=args.temperature)
        wave(args.short)  # warm-up: first-call allocations, oneDNN primitive caches, compiled samplers
        shorts, longs, records = [], [], []
        for _ in range(args.repeats):
            _, offset = read_records(timing_file)
            t_short, m_short = wave(args.short)
            t_long, m_long = wave(args.short + args.new_tokens)
            records += read_records(timing_file, offset)[0]
            shorts.append(t_short)
            longs.append(t_long)
    # Greedy (or one seed) and the same prompt: every request of a wave, and every repeat, makes the same tokens
    # and rounds (the wave runs in lockstep); the fastest wave of each length is the least disturbed.
    tokens = m_long[0]["completion_tokens"] - m_short[0]["completion_tokens"]
    steps = tokens if config.drafter == "none" else m_long[0]["spec_verify_ct"] - m_short[0]["spec_verify_ct"]
    ms_per_step = (min(longs) - min(shorts)) / steps * 1e3
    rows = verify_rows([r for r in records if r.get("batch") == args.batch])
    return Timing(config, ms_per_step, tokens / steps, phase_medians(records, args.batch), rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen2.5-Coder-0.5B-Instruct", help=f"{', '.join(MODELS)} or a folder")
    parser.add_argument("--drafter", choices=["eagle3", "dflash"], default="eagle3")
    parser.add_argument("--draft-tokens", default="2,4,7", help="draft tokens verified per round (comma list)")
    parser.add_argument(
        "--draft-vocab-size",
        type=int,
        default=8192,
        help="EAGLE-3 draft vocabulary (default 8192, as train_drafter.py trains)",
    )
    parser.add_argument("--new-tokens", type=int, default=48, help="extra tokens of the long request")
    parser.add_argument("--short", type=int, default=8, help="tokens of the short request")
    parser.add_argument("--repeats", type=int, default=3, help="long/short pairs per configuration (min of each)")
    parser.add_argument(
        "--batch", type=int, default=1, help="requests in flight: copies of the request sent at once (default 1)"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy (default); above 0, sampled with a fixed seed (the verify samples every draft row)",
    )
    parser.add_argument("--context-length", type=int, default=2048)
    parser.add_argument(
        "--mem-fraction",
        type=float,
        default=None,
        help="--mem-fraction-static of the servers (default: the launcher's, which holds their fixed KV pool)",
    )
    parser.add_argument("--out", type=Path, default=None, help="folder for results.json, report.md, round_cost.png")
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error("--batch: at least 1 request in flight")
    if args.temperature < 0:
        parser.error("--temperature: 0 (greedy) or more")

    from transformers import AutoTokenizer

    model = Path(args.model) if Path(args.model).is_dir() else prepare_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    chat = [{"role": "user", "content": PROMPT}]
    ids = list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))
    counts = [int(c) for c in args.draft_tokens.split(",")]
    configs = [RoundConfig("none"), *(RoundConfig(args.drafter, c) for c in counts)]

    timings = []
    with tempfile.TemporaryDirectory(prefix="bench-cpu-round-") as tmp:
        work = Path(tmp)
        for config in configs:
            drafter = write_drafter(config.drafter, model, config.draft_tokens, work, args.draft_vocab_size)
            timing = measure(model, config, drafter, ids, args, work)
            print(f"{config.label}: {timing.e2e_ms_per_step:.1f} ms/step, {timing.phase_ms}", file=sys.stderr)
            timings.append(timing)

    summary = summarize(timings)
    meta = {
        "model": model.name,
        "drafter": args.drafter,
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "packed_linear": os.environ.get("SGLANG_TTS_CPU_PACKED_LINEAR", "1") != "0",
        "prompt_tokens": len(ids),
        "batch": args.batch,
        "temperature": args.temperature,
        "settings": {k: str(v) for k, v in vars(args).items()},
    }
    report = markdown(summary, meta)
    print(report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        results = {"meta": meta, "summary": summary, "timings": [asdict(t) for t in timings]}
        (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        (args.out / "report.md").write_text(report)
        plot(summary, meta, args.out / "round_cost.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
