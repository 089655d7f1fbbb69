#!/usr/bin/env python
"""Summarise `gpu_check.py --only update_at_scale --json ...` runs: one Markdown table and one plot.

Each JSON is one run of the 8B-scale update (a trained subset and a verify round time); the table has a row
per run and drafter (update time, share hidden per stride, share of serving time the update costs, round
slowdown), the plot the share of serving time an update costs against the stride, a line per run and drafter.

    .venv/bin/python scripts/plot_update_at_scale.py docs/results/update-at-scale-h200/scale-*.json \\
        --out docs/results/update-at-scale-h200
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def load_runs(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """Each file's update_at_scale metrics, with its run name (the file's stem) and device."""
    runs = []
    for path in paths:
        report = json.loads(path.read_text())
        checks = [c for c in report["checks"] if c["name"] == "update_at_scale" and c.get("metrics")]
        if not checks:
            raise SystemExit(f"{path}: no update_at_scale measurements")
        runs.append({"name": path.stem, "device": report.get("device_name", "?"), **checks[0]["metrics"]})
    return runs


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def markdown(runs: Sequence[dict[str, Any]]) -> str:
    strides = sorted({int(s) for run in runs for d in run["drafters"].values() for s in d["strides"]})
    head = [
        "run", "trained", "round ms", "drafter", "params", "update ms",
        *(f"hidden S={s}" for s in strides), *(f"cost S={s}" for s in strides), "round slowdown",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        trainable = run.get("trainable", "all")  # runs before --trainable trained all
        trained = trainable if isinstance(trainable, str) else ",".join(trainable)
        for name, d in run["drafters"].items():
            row = [run["name"], trained, f"{run['verify']['round_ms']:.1f}", name, f"{d['trained_params'] / 1e6:.0f}M"]
            row.append(f"{d['update_ms']:.1f}")
            row += [_pct(d["strides"][str(s)]["hidden"]) for s in strides]
            row += [_pct(d["strides"][str(s)]["overhead"]) for s in strides]
            row.append(f"+{d['round_slowdown']:.0%}" if d["round_slowdown"] is not None else "-")
            lines.append("| " + " | ".join(row) + " |")
    devices = sorted({run["device"] for run in runs})
    note = (
        f"\nDevice: {', '.join(devices)}. hidden: 1 - (extra serving time per update) / (update time alone); "
        "cost: extra serving time per update over the S rounds it overlaps (the share of serving time the update "
        "takes at stride S); round slowdown: a round's excess while an update runs, per share of it overlapped.\n"
    )
    return "\n".join(lines) + "\n" + note


def plot(runs: Sequence[dict[str, Any]], out: Path) -> None:
    from sglang_tts.bench.report import pyplot

    plt = pyplot()
    drafters = list(dict.fromkeys(name for run in runs for name in run["drafters"]))
    fig, axes = plt.subplots(1, len(drafters), figsize=(4.2 * len(drafters), 4.2), sharey=True, squeeze=False)
    for ax, drafter in zip(axes[0], drafters):
        for run in runs:
            d = run["drafters"].get(drafter)
            if d is None:
                continue
            strides = sorted(int(s) for s in d["strides"])
            trainable = run.get("trainable", "all")
            ax.plot(
                strides, [100 * d["strides"][str(s)]["overhead"] for s in strides], marker="o",
                linestyle="-" if trainable == "all" else "--",
                label=f"{run['name']} ({run['verify']['round_ms']:.0f} ms rounds, update {d['update_ms']:.0f} ms)",
            )  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks([1, 2, 5, 10], ["1", "2", "5", "10"])
        ax.set_xlabel("update stride S (rounds per update)")
        ax.set_title(drafter)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("serving time the update costs (%)")
    fig.suptitle("TTS update at 8B scale on the side stream (dashed: fc only)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("jsons", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="folder for summary.md and cost_by_stride.png")
    args = ap.parse_args(argv)
    runs = load_runs(args.jsons)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.md").write_text("# TTS update at 8B scale\n\n" + markdown(runs))
    plot(runs, args.out / "cost_by_stride.png")
    print(markdown(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
