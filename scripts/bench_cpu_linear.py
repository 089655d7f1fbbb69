"""Candidate CPU formulations of a linear layer, timed per (weight shape, rows): the evidence behind
sglang_tts/platform/cpu/linear.py's choice (packed oneDNN weights from a row count measured per weight shape at
load, F.linear below).

    python scripts/bench_cpu_linear.py                      # Qwen2.5-0.5B and SmolLM2-135M weight shapes
    python scripts/bench_cpu_linear.py --shapes 151936x896 --rows 1,4,8

Prints a Markdown table of milliseconds per call (the fastest of repeated calls, so another process
stalling a few calls does not count) and writes it with --out. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

# Runnable from a checkout without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_tts.platform.cpu.linear import fastest_ms, pack_weight

# Qwen2.5-0.5B: LM head, gate_up, down, qkv, o; SmolLM2-135M: tied head, gate_up, down, qkv.
DEFAULT_SHAPES = "151936x896,9728x896,896x4864,1152x896,896x896,49152x576,3072x576,576x1536,960x576"


def candidates(weight: torch.Tensor, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    packed = pack_weight(weight)
    mkl = torch.ops.mkl._mkl_reorder_linear_weight(weight, x.shape[0])  # MKL's pack is per row count
    return {
        "F.linear": lambda: F.linear(x, weight),
        "(W @ x.T).T": lambda: (weight @ x.T).T.contiguous(),
        "oneDNN packed": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        "MKL packed (per M)": lambda: torch.ops.mkl._mkl_linear(x, mkl, weight, None, x.shape[0]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="out x in weight shapes, comma separated")
    parser.add_argument("--rows", default="1,2,3,4,7,8,16,64,256", help="rows M of the input, comma separated")
    parser.add_argument("--budget", type=float, default=0.3, help="seconds of calls per cell")
    parser.add_argument("--out", type=Path, default=None, help="write the Markdown table here")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    lines = [
        f"ms per call, fastest of repeated calls; {torch.get_num_threads()} threads, torch {torch.__version__}.",
        "",
        "| weight | M | F.linear | (W @ x.T).T | oneDNN packed | MKL packed (per M) | packed / F.linear |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for shape in args.shapes.split(","):
        out_f, in_f = (int(s) for s in shape.split("x"))
        weight = torch.randn(out_f, in_f) * 0.05
        for rows in (int(m) for m in args.rows.split(",")):
            x = torch.randn(rows, in_f)
            with torch.inference_mode():
                ms = {name: fastest_ms(fn, 5, args.budget) for name, fn in candidates(weight, x).items()}
            cells = " | ".join(f"{v:.3f}" for v in ms.values())
            lines.append(f"| {shape} | {rows} | {cells} | {ms['oneDNN packed'] / ms['F.linear']:.2f} |")
            print(lines[-1], file=sys.stderr, flush=True)
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
