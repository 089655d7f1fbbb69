#!/usr/bin/env python
"""Benchmark the TTS update-loss backends: time and peak memory of forward+backward.

Compares ``naive`` (materialised logits, autograd) with ``chunked`` (PyTorch, Liger-style) and, when CUDA and
Triton are available, ``triton``. For every (V, N) shape it reports the median wall time of forward+backward
and two peaks measured by replaying the allocator events (``sglang_tts.kernels.memory``):

* total   - every byte allocated above the starting level, gradients included;
* working - the same without the returned ``dL/dhidden`` and ``dL/dW`` (identical for all backends), i.e. the
  intermediates the backends differ in.

Writes ``bench_kernels.json``, ``bench_kernels.md`` and ``bench_kernels.png`` under ``--out``;
prints the Markdown table.

Example (small CPU run)::

    .venv/bin/python scripts/bench_kernels.py --vocab 32000 49152 --positions 16 64 256 --repeats 3
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from sglang_tts.bench.report import write_rows_report
from sglang_tts.kernels import chunked_linear_kl, naive_linear_kl, triton_available
from sglang_tts.kernels.memory import measure_peak_memory

MIB = 2**20


@dataclass
class BenchRow:
    backend: str
    vocab: int
    positions: int
    hidden: int
    time_ms: float  # median forward+backward
    peak_total_mib: float
    peak_working_mib: float


def _backend_fns(device: torch.device) -> dict[str, Callable[..., Tensor]]:
    fns: dict[str, Callable[..., Tensor]] = {"naive": naive_linear_kl, "chunked": chunked_linear_kl}
    if device.type == "cuda" and triton_available():
        from sglang_tts.kernels.triton_linear_kl import triton_linear_kl

        fns["triton"] = triton_linear_kl
    return fns


def _make_problem(n: int, h: int, v: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, ...]:
    gen = torch.Generator(device="cpu").manual_seed(n * 7919 + v)
    hidden = (torch.randn(n, h, generator=gen) * 0.05).to(device, dtype)
    weight = (torch.randn(v, h, generator=gen) * 0.05).to(device, dtype)
    teacher = torch.softmax(torch.randn(n, v, generator=gen), dim=-1).to(device)
    prev = torch.softmax(torch.randn(n, v, generator=gen), dim=-1).to(device)
    weights = torch.rand(n, generator=gen).to(device)
    return hidden, weight, teacher, weights, prev


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_one(
    fn: Callable[..., Tensor],
    problem: tuple[Tensor, ...],
    reg_lambda: float,
    repeats: int,
    warmup: int,
    device: torch.device,
) -> tuple[float, float, float]:
    """``(median ms, total peak MiB, working peak MiB)`` of ``fn`` forward+backward on ``problem``."""
    hidden, weight, teacher, weights, prev = problem

    def step() -> tuple[Tensor, Tensor]:
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        fn(h, w, teacher, weights, prev, reg_lambda).backward()
        return h, w

    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    # Memory in a separate run: the profiler's bookkeeping would distort the timings.
    peak = measure_peak_memory(step, device, exclude=lambda hw: [hw[0].grad, hw[1].grad])
    return statistics.median(times), peak.total / MIB, peak.working / MIB


def to_markdown(rows: Sequence[BenchRow], meta: dict[str, object]) -> str:
    lines = [
        f"Device: {meta['device']} ({meta['device_name']}), torch {meta['torch']}, H={meta['hidden']}, "
        f"dtype {meta['dtype']}, lambda={meta['reg_lambda']}, median of {meta['repeats']} runs.",
        "",
        "| V | N | backend | fwd+bwd ms | peak total MiB | peak working MiB | working vs naive |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    naive_working = {(r.vocab, r.positions): r.peak_working_mib for r in rows if r.backend == "naive"}
    for r in rows:
        base = naive_working.get((r.vocab, r.positions))
        ratio = f"{base / r.peak_working_mib:.1f}x lower" if base and r.peak_working_mib > 0 else "-"
        if r.backend == "naive":
            ratio = "1.0x"
        lines.append(
            f"| {r.vocab} | {r.positions} | {r.backend} | {r.time_ms:.1f} | {r.peak_total_mib:.1f} | "
            f"{r.peak_working_mib:.1f} | {ratio} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[BenchRow], path: Path) -> None:
    """Time and working memory against positions, one line per (backend, vocabulary)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(10, 4))
    for backend, vocab in sorted({(r.backend, r.vocab) for r in rows}):
        sel = sorted((r for r in rows if r.backend == backend and r.vocab == vocab), key=lambda r: r.positions)
        xs = [r.positions for r in sel]
        ax_time.plot(xs, [r.time_ms for r in sel], marker="o", label=f"{backend}, V={vocab}")
        ax_mem.plot(xs, [r.peak_working_mib for r in sel], marker="o", label=f"{backend}, V={vocab}")
    ax_time.set(xlabel="positions N", ylabel="forward + backward (ms)", title="Update loss time")
    ax_mem.set(xlabel="positions N", ylabel="peak working memory (MiB)", title="Memory besides dW, dh")
    for ax in (ax_time, ax_mem):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 49152])
    parser.add_argument("--positions", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--reg-lambda", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--backends", nargs="+", default=None, help="subset of naive/chunked/triton")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--out", type=Path, default=Path("results/bench_kernels"))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[BenchRow]:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    fns = _backend_fns(device)
    if args.backends is not None:
        unknown = set(args.backends) - set(fns)
        if unknown:
            raise SystemExit(f"backends not available on {device}: {sorted(unknown)}")
        fns = {name: fns[name] for name in args.backends}

    combos = [(v, n, name) for v in args.vocab for n in args.positions for name in fns]
    rows: list[BenchRow] = []
    problem_key: tuple[int, int] | None = None
    problem: tuple[Tensor, ...] = ()
    for v, n, name in tqdm(combos, desc="bench_kernels", unit="case"):
        if problem_key != (v, n):
            problem_key, problem = (v, n), _make_problem(n, args.hidden, v, device, dtype)
        ms, total, working = bench_one(fns[name], problem, args.reg_lambda, args.repeats, args.warmup, device)
        rows.append(BenchRow(name, v, n, args.hidden, round(ms, 2), round(total, 2), round(working, 2)))

    meta: dict[str, object] = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "hidden": args.hidden,
        "dtype": args.dtype,
        "reg_lambda": args.reg_lambda,
        "repeats": args.repeats,
    }
    write_rows_report(args.out, "bench_kernels", meta, rows, to_markdown(rows, meta), lambda path: plot(rows, path))
    return rows


if __name__ == "__main__":
    main()
