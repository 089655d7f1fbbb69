"""Report the distribution of natural answer lengths per workload (docs/workloads.md).

From a finished benchmark run (any run made without --ignore-eos; the no-spec configuration is used
when it ran, else the first one, or --config)::

    python scripts/answer_lengths.py results/RUN/results.json

From a model served without speculation (runs scripts/bench_long.py --configs no-spec against it, then
reports; the run folder keeps every request)::

    python scripts/answer_lengths.py --base-url http://127.0.0.1:30000 \\
        --datasets long-gen long-context reasoning --num-prompts 0 --max-new-tokens 8192 --temperature 0 0.7

The table goes to stdout (and --json writes the numbers).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_tts.bench.lengths import LONG_TOKENS, LengthsError, render_lengths, stats_from_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", type=Path, help="a benchmark run's results.json")
    parser.add_argument("--config", help="configuration whose requests count (default: no-spec, else the first)")
    parser.add_argument("--threshold", type=int, default=LONG_TOKENS, help="length counted as long (default 1500)")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    served = parser.add_argument_group("measure a served model instead (through scripts/bench_long.py)")
    served.add_argument("--base-url", help="a running server without speculation")
    served.add_argument("--datasets", nargs="+", default=["long-gen", "long-context", "reasoning"])
    served.add_argument("--num-prompts", type=int, default=0, help="per workload (default 0: all held-out prompts)")
    served.add_argument("--max-new-tokens", type=int, default=8192)
    served.add_argument("--temperature", nargs="+", default=["0"])
    served.add_argument("--out", type=Path, default=Path("results"), help="parent folder of the run folder")
    served.add_argument("--model", help="passed on to bench_long.py --model (the served model's folder)")
    return parser


def measure(args: argparse.Namespace) -> Path:
    """Run the benchmark's no-spec configuration against ``--base-url``; returns its results.json."""
    run = time.strftime("lengths-%Y%m%d-%H%M%S")
    command = [
        sys.executable, str(REPO / "scripts" / "bench_long.py"), "--base-url", args.base_url, "--configs", "no-spec",
        "--datasets", *args.datasets, "--num-prompts", str(args.num_prompts),
        "--max-new-tokens", str(args.max_new_tokens), "--temperature", *args.temperature,
        "--rounds", "1", "--out", str(args.out), "--run", run,
    ]  # fmt: skip
    if args.model is not None:
        command += ["--model", args.model]
    subprocess.run(command, check=True)
    return args.out / run / "results.json"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.results is None) == (args.base_url is None):
        parser.error("give either a results.json or --base-url")
    path = args.results if args.results is not None else measure(args)
    try:
        stats = stats_from_results(json.loads(path.read_text()), args.config, args.threshold)
    except LengthsError as error:
        parser.exit(2, f"answer_lengths.py: {path}: {error}\n")
    print(render_lengths(stats, str(path)), end="")
    if args.json is not None:
        args.json.write_text(json.dumps([s.to_json() for s in stats], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
