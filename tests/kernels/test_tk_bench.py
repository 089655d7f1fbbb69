"""Smoke test of scripts/bench_kernels.py on a tiny shape: it runs, and writes consistent JSON and Markdown."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_kernels.py"


def test_bench_writes_json_markdown_and_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_kernels", bench)  # dataclasses look their module up there
    spec.loader.exec_module(bench)

    args = ["--vocab", "300", "--positions", "4", "8", "--hidden", "16", "--repeats", "1", "--warmup", "0"]
    rows = bench.main([*args, "--device", "cpu", "--out", str(tmp_path)])

    assert [(r.backend, r.positions) for r in rows] == [("naive", 4), ("chunked", 4), ("naive", 8), ("chunked", 8)]
    data = json.loads((tmp_path / "bench_kernels.json").read_text())
    assert len(data["rows"]) == 4 and data["meta"]["hidden"] == 16
    # Both backends return dW (300 x 16 float32); the total peak must at least hold it.
    assert all(row["peak_total_mib"] * 2**20 >= 300 * 16 * 4 for row in data["rows"])
    table = (tmp_path / "bench_kernels.md").read_text()
    assert table.count("| 300 |") == 4
    assert (tmp_path / "bench_kernels.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
