"""scripts/bench_linear_ce.py: both losses measured on a small problem and the report written (the timing itself
is not a test)."""

from __future__ import annotations

import json

from scripts_testing import load_script


def test_measures_both_losses_and_writes_the_report(tmp_path):
    bench = load_script("bench_linear_ce")
    rows = bench.main(
        ["--rows", "8", "32", "--hidden", "16", "--vocab", "500", "--repeats", "2", "--out", str(tmp_path)]
    )
    assert [(r.backend, r.rows) for r in rows] == [("plain", 8), ("fused", 8), ("plain", 32), ("fused", 32)]
    assert all(r.wall_ms > 0 and r.user_ms >= 0 and r.minor_faults >= 0 for r in rows)
    saved = json.loads((tmp_path / "bench_linear_ce.json").read_text())
    assert len(saved["rows"]) == 4 and saved["meta"]["repeats"] == 2
    assert "| fused | 32 | 16 | 500 |" in (tmp_path / "bench_linear_ce.md").read_text()
    assert (tmp_path / "bench_linear_ce.png").stat().st_size > 0
