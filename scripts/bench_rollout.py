#!/usr/bin/env python
"""RL rollout benchmark: GRPO-style steps (P prompts x n samples, all at once) against each configuration.

Launches one SGLang server per configuration at a time (or targets a running one with --base-url), runs every
step on it (a warm-up request after the start, /flush_cache before each step), and records every sample's
latency, tokens, per-round accept lengths and TTS counters, each step's makespan. --drift CKPT ... loads a new
checkpoint of the target before each step (/update_weights_from_disk) to measure what a moving policy does to
the drafter. Writes results/<run>/results.json (after every step), report.md and PNG plots; the same command
with --run NAME continues an interrupted run. See sglang_tts/bench/rollout.py and docs/benchmarks.md.

Examples::

    python scripts/bench_rollout.py --smoke                 # tiny offline models, a few minutes
    python scripts/bench_rollout.py --smoke --drift         # ... with a drifted copy of the tiny target
    python scripts/bench_rollout.py --model Qwen2.5-Coder-0.5B-Instruct --prompts-per-step 4 --samples 4
    python scripts/bench_rollout.py --model M --drift ckpt/step-1 ckpt/step-2 ckpt/step-3
    python scripts/bench_rollout.py --from-json results/RUN/results.json --bucket 64   # re-render
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Runnable from a checkout without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_tts.bench.configs import KINDS, ConfigError  # noqa: E402
from sglang_tts.bench.rollout import (  # noqa: E402
    DEFAULT_CONFIGS,
    DEFAULT_DATASETS,
    DRIFT_CONFIGS,
    RolloutArgs,
    build_plan,
    rerender,
    run_rollout,
    summary_lines,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--smoke", action="store_true", help="tiny offline models, 2 steps of 2 prompts x 2 samples, 48 tokens")
    add("--from-json", type=Path, help="only re-render an existing results.json (report.md and plots beside it)")
    what = parser.add_argument_group("configurations")
    what.add_argument(
        "--configs",
        nargs="+",
        help=f"names (default: {' '.join(DEFAULT_CONFIGS)}; with --drift: {' '.join(DRIFT_CONFIGS)}); "
        "+keep / +reset add --tts-on-target-update keep / reset",
    )
    what.add_argument("--drafter-kind", nargs="+", choices=KINDS, help="drafter kinds to run (default eagle3)")
    what.add_argument("--drafter", action="append", default=[], help="[KIND=]PATH (default: the trained or shipped)")
    what.add_argument("--model", help="target: a folder or a prepare_model.py name (default: SmolLM2-135M-Instruct)")
    what.add_argument(
        "--eagle3-shape", default="chain", help="chain (3 steps, top-k 1, 4 tokens; default), sglang or S,K,T"
    )
    what.add_argument("--tts-lr", type=float, help="--tts-lr for the TTS configurations (default: the server's)")
    what.add_argument("--server-arg", action="append", default=[], help="extra launch flags for every server")
    what.add_argument(
        "--variant", action="append", default=[], metavar="TAG=FLAGS", help="named extra launch flags for NAME+TAG"
    )
    what.add_argument("--base-url", help="benchmark this running server (one configuration: name it with --configs)")
    what.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="cpu adds the CPU flags")
    data = parser.add_argument_group("steps and sampling")
    data.add_argument("--datasets", nargs="+", help=f"prompt sources (default: {' '.join(DEFAULT_DATASETS)})")
    data.add_argument("--seed", type=int, default=0, help="seed of the prompt sample (and of generated drift)")
    data.add_argument("--steps", type=int, help="RL steps (default 3; smoke 2; with --drift: checkpoints + 1)")
    data.add_argument("--prompts-per-step", type=int, help="P: prompts per step (default 4; smoke 2)")
    data.add_argument(
        "--same-prompts",
        action="store_true",
        help="every step samples the same P prompts (step 0's): a change between steps is then the weights' alone",
    )
    data.add_argument("--samples", type=int, help="n: samples per prompt (default 4; smoke 2)")
    data.add_argument("--max-new-tokens", type=int, help="tokens per sample at most (default 1024; smoke 48)")
    data.add_argument("--temperature", type=float, default=1.0)
    data.add_argument("--top-p", type=float, default=1.0)
    data.add_argument("--top-k", type=int, default=-1)
    data.add_argument(
        "--sampling-seed",
        type=int,
        help="a seed per (step, prompt, sample) from this value, the same in every configuration: they all sample "
        "the same answers (on CPU seeded verify makes them exact), so makespans compare the same tokens",
    )
    data.add_argument("--ignore-eos", action="store_true", default=None, help="always --max-new-tokens (smoke: on)")
    drift = parser.add_argument_group("policy drift")
    drift.add_argument(
        "--drift",
        nargs="*",
        metavar="CKPT",
        help="checkpoint folders of the target: step k runs on CKPT_k (step 0 on the launch weights); "
        "without CKPT, --drift-copies noisy copies of the target are made (a stand-in for real checkpoints)",
    )
    drift.add_argument("--drift-copies", type=int, help="generated copies (default 3; smoke 1)")
    drift.add_argument(
        "--drift-scale", type=float, help="noise per copy, x each tensor's std (default 0.02; smoke 0.5)"
    )
    drift.add_argument("--probe-tokens", type=int, default=16, help="greedy probe per drift step (0: none)")
    run = parser.add_argument_group("run and report")
    run.add_argument("--bucket", type=int, help="output-position bucket in tokens (default 128; smoke 16)")
    run.add_argument("--warmup-tokens", type=int, help="warm-up request after each server start (default 32)")
    run.add_argument(
        "--request-timeout",
        type=float,
        help="seconds to wait for one sample (default: sized for --max-new-tokens at 0.5 tokens/s, at least 3600)",
    )
    run.add_argument("--server-timeout", type=float, default=900.0)
    run.add_argument("--out", type=Path, default=Path("results"), help="parent folder of the run folder")
    run.add_argument("--run", help="run folder name (default: a timestamp); an existing run is continued")
    run.add_argument("--smoke-dir", type=Path, help="where --smoke writes its tiny models (default: the cache)")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else [sys.argv[0], *argv])
    parser = build_parser()
    args = RolloutArgs(**vars(parser.parse_args(argv[1:])))
    try:
        if args.from_json:
            result = rerender(args.from_json, args.bucket)
        else:
            plan = build_plan(args, argv)
            print(
                f"[rollout] {len(plan.configs)} configurations x {len(plan.steps)} steps x "
                f"{len(plan.steps[0].prompts)} prompts x {plan.settings.samples} samples -> {plan.run_dir}",
                file=sys.stderr,
            )
            result = run_rollout(plan)
    except ConfigError as error:
        parser.error(str(error))
    print(result.report.read_text())
    for line in summary_lines(result):
        print(line)
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
