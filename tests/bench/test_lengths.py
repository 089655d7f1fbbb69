"""Tests for sglang_tts.bench.lengths and scripts/answer_lengths.py on synthetic records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_tts.bench.lengths import LengthsError, length_stats, nearest_rank, render_lengths, stats_from_results
from sglang_tts.bench.runner import RequestRecord

REPO = Path(__file__).resolve().parents[2]
CLEAN = [0.9, 0.95, 0.92, 0.9]
LOOP = [0.9, 0.8, 0.3, 0.1]


def _record(config: str, dataset: str, tokens: int, reason: str, quarters: list[float], **kw) -> RequestRecord:
    return RequestRecord(
        config, dataset, f"{dataset}-{tokens}", 0, tokens, 1.0, finish_reason=reason, distinct_ngrams=quarters, **kw
    )


RECORDS = [
    _record("no-spec", "long-gen", 1800, "stop", CLEAN),
    _record("no-spec", "long-gen", 900, "stop", CLEAN),
    _record("no-spec", "long-gen", 2400, "stop", LOOP),
    _record("no-spec", "long-gen", 1600, "stop", CLEAN),
    _record("no-spec", "long-gen", 4096, "length", CLEAN),
    _record("no-spec", "reasoning", 400, "stop", CLEAN),
    _record("no-spec", "reasoning", 500, "stop", CLEAN, sampling="t0.7"),
    # Batched: a mode of its own; the wave repeated its one prompt to fill itself, counted once.
    _record("no-spec", "reasoning", 450, "stop", CLEAN, sampling="greedy-c2", concurrency=2),
    _record("no-spec", "reasoning", 450, "stop", CLEAN, sampling="greedy-c2", concurrency=2),
    _record("eagle3:frozen", "long-gen", 100, "stop", CLEAN),  # another configuration: not counted
]


def test_nearest_rank() -> None:
    values = [10, 20, 30, 40]
    assert [nearest_rank(values, q) for q in (0.0, 0.25, 0.5, 0.75, 0.9, 1.0)] == [10, 10, 20, 30, 40, 40]


def test_length_stats_per_workload_and_mode() -> None:
    stats = {(s.dataset, s.sampling): s for s in length_stats(RECORDS)}
    assert set(stats) == {
        ("long-gen", "greedy"),
        ("reasoning", "greedy"),
        ("reasoning", "greedy-c2"),
        ("reasoning", "t0.7"),
    }
    gen = stats["long-gen", "greedy"]
    assert (gen.requests, gen.natural, gen.truncated, gen.looping) == (5, 4, 1, 1)
    # >= 1500 and no looping quarter: 1800, 1600 and the truncated 4096 (the 2400 loops).
    assert gen.long_clean == 3 and gen.threshold == 1500
    # Natural ends sorted: 900, 1600, 1800, 2400.
    assert gen.quantiles == {"min": 900, "p10": 900, "p25": 900, "median": 1600, "p75": 1800, "p90": 2400, "max": 2400}
    assert stats["reasoning", "greedy"].requests == 1 and stats["reasoning", "t0.7"].quantiles["max"] == 500
    batched = stats["reasoning", "greedy-c2"]
    assert (batched.requests, batched.natural, batched.quantiles["median"]) == (1, 1, 450)
    frozen = length_stats(RECORDS, config="eagle3:frozen", threshold=50)
    assert [(s.dataset, s.natural, s.long_clean) for s in frozen] == [("long-gen", 1, 1)]
    with pytest.raises(LengthsError, match="recorded: no-spec, eagle3:frozen"):
        length_stats(RECORDS, config="tts-s5")
    with pytest.raises(LengthsError, match="no request records"):
        length_stats([])


def test_render_and_ignore_eos_refused() -> None:
    table = render_lengths(length_stats(RECORDS), "run-x")
    assert "| long-gen | greedy | 5 | 4 | 1 | 1 | 900 | 900 | 900 | 1600 | 1800 | 2400 | 2400 | 3 |" in table
    assert "run-x" in table and ">= 1500 & no loop" in table
    payload = {"settings": {"ignore_eos": True}, "requests": [r.to_json() for r in RECORDS]}
    with pytest.raises(LengthsError, match="ignored EOS"):
        stats_from_results(payload)


def test_script_reads_a_results_json(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"settings": {"ignore_eos": False}, "requests": [r.to_json() for r in RECORDS]}))
    out = tmp_path / "lengths.json"
    cmd = [sys.executable, str(REPO / "scripts" / "answer_lengths.py"), str(results), "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert "| reasoning | t0.7 | 1 | 1 | 0 | 0 |" in done.stdout
    numbers = json.loads(out.read_text())
    assert numbers[0]["dataset"] == "long-gen" and numbers[0]["quantiles"]["median"] == 1600
    refused = subprocess.run([*cmd[:2]], capture_output=True, text=True)
    assert refused.returncode == 2 and "either a results.json or --base-url" in refused.stderr
