#!/usr/bin/env python
"""Acceptance by quarter of the output across benchmark runs: one series per drafter and configuration.

Each series is ``LABEL=RUN_DIR:CONFIG``, one configuration of one ``scripts/bench_long.py`` run (a run serves
one drafter). Only the prompts every series answered count; greedy outputs should be the same text in every
series (the digests are checked), so the quarters that do not loop are the same in every series. Per series:
tokens per round pooled over the rounds starting in each quarter of their output, all rounds and the
quarters that do not loop; with ``--against LABEL`` each row also shows the change against that series, and
with ``--gain TTS_LABEL=FROZEN_LABEL`` the gain of one series over another per quarter.

Writes ``quarters.json``, ``.md`` and ``.png`` under ``--out``; prints the Markdown::

    .venv/bin/python scripts/compare_quarters.py --out docs/results/drafter-length-quarters \\
        --series shipped=docs/results/qwen-window-default-c4:eagle3:frozen \\
                 short512=docs/results/qwen-short512-c1-p4:eagle3:frozen \\
        --against shipped
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_tts.bench.across_runs import QuarterRow, Series, compare_quarters  # noqa: E402
from sglang_tts.bench.report import fmt, fmt_pct, machine_info, table, write_rows_report  # noqa: E402

VIEWS = (("all rounds", "by_quarter"), ("quarters that do not loop", "by_quarter_no_loop"))  # (title, QuarterRow field)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--series", nargs="+", required=True, help="LABEL=RUN_DIR:CONFIG, one per series")
    parser.add_argument("--against", help="a series label: every row also shows its ratio to this one")
    parser.add_argument("--gain", nargs="*", default=[], help="A=B: the gain of series A over series B per quarter")
    parser.add_argument("--sampling", default="greedy", help="the runs' sampling mode to read (default greedy)")
    parser.add_argument("--out", type=Path, required=True, help="folder for quarters.json / .md / .png")
    return parser


def _ratio_cells(mine: Sequence[float | None], base: Sequence[float | None]) -> list[str]:
    return [fmt(a / b, 3) if a is not None and b else "n/a" for a, b in zip(mine, base)]


def render(rows: Sequence[QuarterRow], prompts: Sequence[str], differing: Sequence[str], against: str | None,
           gains: Sequence[tuple[str, str]], command: str) -> str:  # fmt: skip
    by_label = {r.label: r for r in rows}
    parts = [f"# Acceptance by quarter across runs\n\nCommand: `{command}`\n"]
    parts.append(
        f"{len(prompts)} prompts every series answered: {', '.join(prompts)}. "
        + (
            f"Outputs differ between series on {', '.join(differing)}."
            if differing
            else "Outputs identical in every series."
        )
    )
    for title, attr in VIEWS:
        header = ["series", "run", "config", "in flight", "Q1", "Q2", "Q3", "Q4", "Q4 / Q1"]
        body = []
        for r in rows:
            q = getattr(r, attr)
            body.append(
                [
                    r.label,
                    r.run,
                    r.config,
                    str(r.concurrency),
                    *(fmt(v) for v in q),
                    fmt(q[3] / q[0], 3) if q[0] and q[3] else "n/a",
                ]
            )
            if against and against in by_label and r.label != against:
                body.append(
                    [f"{r.label} / {against}", "", "", "", *_ratio_cells(q, getattr(by_label[against], attr)), ""]
                )
        for a, b in gains:
            qa, qb = getattr(by_label[a], attr), getattr(by_label[b], attr)
            cells = [fmt_pct((x / y - 1) * 100 if x is not None and y else None) for x, y in zip(qa, qb)]
            body.append([f"{a} over {b}", "", "", "", *cells, ""])
        parts.append(f"## Tokens per round by quarter, {title}\n\n" + table(header, body))
    parts.append(
        "Quarters by output position: a round belongs to the quarter its first token lies in. A quarter loops "
        "when under half of its word 4-grams are distinct; those rounds leave the second table."
    )
    return "\n\n".join(parts) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    series = [Series.parse(s) for s in args.series]
    labels = [s.label for s in series]
    gains = [tuple(g.split("=", 1)) for g in args.gain]
    for name in [args.against, *(x for g in gains for x in g)]:
        if name is not None and name not in labels:
            raise SystemExit(f"--against/--gain name {name!r} is not a series label ({', '.join(labels)})")
    rows, prompts, differing = compare_quarters(series, args.sampling)
    command = "scripts/compare_quarters.py " + " ".join(sys.argv[1:] if argv is None else argv)
    markdown = render(rows, prompts, differing, args.against, gains, command)

    def plot(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for ax, (title, attr) in zip(axes, VIEWS):
            for r in rows:
                q = getattr(r, attr)
                ax.plot([1, 2, 3, 4], [v if v is not None else float("nan") for v in q], marker="o", label=r.label)
            ax.set_xticks([1, 2, 3, 4], ["Q1", "Q2", "Q3", "Q4"])
            ax.set_title(title)
            ax.set_xlabel("quarter of the output")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("tokens per round")
        axes[1].legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"command": command, "machine": machine_info(), "prompts": prompts, "differing": differing,
            "series": [{"label": s.label, "run_dir": str(s.run_dir), "config": s.config} for s in series]}  # fmt: skip
    write_rows_report(args.out, "quarters", meta, rows, markdown, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
