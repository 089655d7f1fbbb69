"""scripts/bench_cpu_round.py's arithmetic: phase medians, costs in decode steps, the Markdown table.
(The servers it starts are the ones tests/platform/test_serving.py covers; the timing is not a test.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from scripts_testing import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_cpu_round")


def _records(phase: str, mode: str, values: list[float], **extra) -> list[dict]:
    return [{"phase": phase, "mode": mode, "ms": v, **extra} for v in values]


def test_costs_in_decode_steps(bench) -> None:
    nospec = bench.Timing(
        bench.RoundConfig("none"),
        e2e_ms_per_step=42.0,
        tokens_per_step=1.0,
        phase_ms=bench.phase_medians(
            _records("iteration", "decode", [40.0, 41.0, 400.0])  # one stalled call: the median ignores it
            + _records("target_forward", "decode", [39.0, 39.0, 39.0], tokens=1)
            + _records("iteration", "extend", [900.0])  # prefill: not a decode step
        ),
    )
    spec_records = (
        _records("iteration", "decode", [61.5, 61.5])
        + _records("round", "draft_extend_v2", [61.0, 61.0])
        + _records("round", "extend", [500.0])
        + _records("target_forward", "target_verify", [45.0, 45.0], tokens=4)
        + _records("verify", "target_verify", [48.0, 48.0])
        + _records("draft", "decode", [6.0, 6.0])
        + _records("draft_forward", "decode", [3.0, 3.0])
        + _records("draft_extend", "draft_extend_v2", [5.0, 5.0])
    )
    assert bench.verify_rows(spec_records) == 4
    config = bench.RoundConfig("eagle3", 4)
    chain = bench.Timing(config, 63.0, 1.0, bench.phase_medians(spec_records), bench.verify_rows(spec_records))
    assert chain.phase_ms["round"] == 61.0 and nospec.phase_ms["iteration"] == 41.0

    summary = bench.summarize([nospec, chain])
    assert summary["decode_step_ms"] == 41.0
    row = summary["rows"][1]
    assert row["steps"] == pytest.approx(61.5 / 41.0, abs=1e-3)
    assert row["steps_e2e"] == pytest.approx(1.5)
    assert row["verify_steps"] == pytest.approx(48.0 / 41.0, abs=1e-3)
    assert row["target_verify_over_decode_forward"] == pytest.approx(45.0 / 39.0, abs=1e-3)
    assert (row["verify_tokens"], row["draft_forward_ms"], row["draft_extend_ms"]) == (4, 3.0, 5.0)

    report = bench.markdown(
        summary, {"model": "m", "drafter": "eagle3", "command": "c", "date": "d", "packed_linear": True}
    )
    assert "| eagle3 x4 | 61.5 | 1.50 | 63.0 | 1.50 | 4 | 48.0 | 1.17 | 1.15 | 6.00 | 3.00 | 5.00 |" in report
    assert "| no-spec | 41.0 | 1.00 |" in report


def test_server_args(bench) -> None:
    drafter = Path("/d")
    assert bench.server_args(bench.RoundConfig("none"), None) == []
    args = bench.server_args(bench.RoundConfig("eagle3", 7), drafter)
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert flags["--speculative-algorithm"] == "EAGLE3"
    assert (flags["--speculative-num-steps"], flags["--speculative-num-draft-tokens"]) == ("6", "7")
    assert flags["--speculative-eagle-topk"] == "1"
    assert bench.server_args(bench.RoundConfig("dflash", 4), drafter)[:2] == ["--speculative-algorithm", "DFLASH"]


def test_batch_keeps_only_the_calls_of_the_whole_wave(bench) -> None:
    # A wave of 4 requests: its last calls, after some requests finished, ran fewer rows and are another shape.
    records = (
        _records("iteration", "decode", [100.0, 102.0, 104.0], batch=4)
        + _records("iteration", "decode", [45.0, 46.0], batch=2)
        + _records("target_forward", "target_verify", [150.0, 152.0], tokens=16, batch=4)
        + _records("target_forward", "target_verify", [80.0], tokens=8, batch=2)
    )
    medians = bench.phase_medians(records, batch=4)
    assert medians["iteration"] == 102.0 and medians["target_verify"] == 151.0
    assert bench.phase_medians(records)["iteration"] == 100.0  # all calls: the median mixes the shapes
    assert bench.verify_rows([r for r in records if r["batch"] == 4]) == 16
    assert bench.verify_rows(records) is None  # two row counts: not one shape
