#!/usr/bin/env python
"""Benchmark DFlash training's LM-head cross-entropy: the plain PyTorch loss against the fused one.

``plain`` is ``F.cross_entropy(hidden @ W.T, labels)`` with autograd (``linear_cross_entropy_reference``);
``fused`` is ``sglang_tts.training.linear_ce.LinearCrossEntropy`` (one logits buffer kept across steps, the
gradient computed in the forward). Per backend, forward + backward over N labelled slots: median wall time,
and the process's CPU time in user and kernel mode and its minor page faults per call (getrusage), which show
what allocating fresh [N, V] tensors every step costs on CPU. Defaults: the Qwen2.5-Coder-0.5B DFlash step
(batch 4 x 32 anchors x 7 slots = 896 labelled slots, hidden 896, vocabulary 151,936).

Writes ``bench_linear_ce.json``, ``.md`` and ``.png`` under ``--out``; prints the Markdown table::

    .venv/bin/python scripts/bench_linear_ce.py --out docs/results/linear-ce
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from sglang_tts.bench.report import machine_info, table, write_rows_report
from sglang_tts.training.linear_ce import LinearCrossEntropy, linear_cross_entropy_reference


@dataclass
class Row:
    backend: str
    rows: int
    hidden: int
    vocab: int
    wall_ms: float  # median forward + backward
    user_ms: float  # CPU time per call, user mode (all threads)
    sys_ms: float  # ... kernel mode
    minor_faults: float  # per call


def bench(fn: Callable, n: int, d: int, v: int, repeats: int, seed: int = 0) -> tuple[float, float, float, float]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(v, d, generator=gen) * 0.02
    labels = torch.randint(0, v, (n,), generator=gen)
    weights = torch.rand(n, generator=gen) + 0.1
    hidden = torch.randn(n, d, generator=gen)

    def step() -> None:
        h = hidden.detach().requires_grad_(True)
        fn(h, weight, labels, weights)[0].backward()

    step()  # warm-up (and the fused loss's buffer)
    walls = []
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        walls.append((time.perf_counter() - start) * 1e3)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return (
        statistics.median(walls),
        (after.ru_utime - before.ru_utime) * 1e3 / repeats,
        (after.ru_stime - before.ru_stime) * 1e3 / repeats,
        (after.ru_minflt - before.ru_minflt) / repeats,
    )


def to_markdown(rows: Sequence[Row], meta: dict[str, object]) -> str:
    header = ["backend", "N", "D", "V", "fwd+bwd ms", "user ms", "kernel ms", "minor faults"]
    cells = [
        [r.backend, str(r.rows), str(r.hidden), str(r.vocab)]
        + [f"{x:.0f}" for x in (r.wall_ms, r.user_ms, r.sys_ms, r.minor_faults)]
        for r in rows
    ]
    return (
        f"CPU {meta['processor']}, {meta['torch_threads']} threads, torch {meta['torch']}, fp32, "
        f"median of {meta['repeats']} calls.\n\n{table(header, cells)}\n"
    )


def plot(rows: Sequence[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"{r.backend}\nN={r.rows}" for r in rows]
    ax.bar(labels, [r.user_ms for r in rows], label="user CPU")
    ax.bar(labels, [r.sys_ms for r in rows], bottom=[r.user_ms for r in rows], label="kernel CPU")
    ax.plot(labels, [r.wall_ms for r in rows], "ko", label="wall")
    ax.set(ylabel="ms per forward + backward", title="LM-head cross-entropy (DFlash training)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[896], help="labelled slots N")
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("results/bench_linear_ce"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    fns = {"plain": linear_cross_entropy_reference, "fused": LinearCrossEntropy()}
    rows = []
    for n in tqdm(args.rows, desc="bench_linear_ce", unit="size"):
        for name, fn in fns.items():
            wall, user, sys_ms, faults = bench(fn, n, args.hidden, args.vocab, args.repeats)
            rows.append(Row(name, n, args.hidden, args.vocab, round(wall, 1), round(user, 1), round(sys_ms, 1), faults))
    meta: dict[str, object] = {**machine_info(), "repeats": args.repeats}
    write_rows_report(args.out, "bench_linear_ce", meta, rows, to_markdown(rows, meta), lambda path: plot(rows, path))
    return rows


if __name__ == "__main__":
    main()
