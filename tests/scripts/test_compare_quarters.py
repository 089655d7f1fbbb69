"""scripts/compare_quarters.py (and sglang_tts.bench.across_runs): acceptance by quarter over the prompts every
run answered, against a chosen series, with the digests checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scripts_testing import load_script

from sglang_tts.bench.across_runs import Series, compare_quarters
from sglang_tts.bench.runner import RequestRecord

CLEAN = [0.9] * 4


def _record(config: str, prompt: str, lengths: list[int], digest: str, shares=CLEAN, sampling="greedy") -> dict:
    return RequestRecord(
        config=config, dataset="d", prompt_id=prompt, round=0, completion_tokens=1 + sum(lengths), wall_s=1.0,
        sampling=sampling, accept_lengths=lengths, output_digest=digest, distinct_ngrams=list(shares),
    ).to_json()  # fmt: skip


def _run(root: Path, name: str, records: list[dict]) -> Path:
    run = root / name
    run.mkdir()
    (run / "results.json").write_text(json.dumps({"requests": records}))
    return run


def test_only_the_common_prompts_count_and_differing_digests_are_named(tmp_path):
    # Run a answered p1 and p2; run b only p1 (with another text) and p3. 40 tokens each: quarters of 10 rounds.
    a = _run(tmp_path, "a", [
        _record("eagle3:frozen", "p1", [1] * 40, "x"),
        _record("eagle3:frozen", "p2", [4] * 10, "y"),
        _record("eagle3:frozen", "p1", [3] * 13, "x", sampling="t0.7"),  # another sampling mode: not read
    ])  # fmt: skip
    b = _run(tmp_path, "b", [
        _record("eagle3:tts", "p1", [1] * 20 + [3] * 7, "z", shares=[0.9, 0.9, 0.9, 0.1]),
        _record("eagle3:tts", "p3", [2] * 20, "w"),
    ])  # fmt: skip
    rows, prompts, differing = compare_quarters([Series("a", a, "eagle3:frozen"), Series("b", b, "eagle3:tts")])
    assert prompts == ["p1"] and differing == ["p1"]
    assert rows[0].by_quarter == pytest.approx([1.0] * 4)
    # b's p1: 42 tokens, one-token rounds start 1..20 (quarters 0-1), three-token rounds at 21..39 (quarters 2-3)
    assert rows[1].by_quarter == pytest.approx([1.0, 1.0, 3.0, 3.0])
    assert rows[1].by_quarter_no_loop[3] is None
    with pytest.raises(ValueError, match="no greedy records"):
        compare_quarters([Series("a", a, "eagle3:tts")])
    with pytest.raises(ValueError, match="LABEL=RUN_DIR:CONFIG"):
        Series.parse("a:eagle3:frozen")


def test_script_writes_the_tables_with_ratios_and_gains(tmp_path):
    records = [_record("eagle3:frozen", "p1", [1] * 40, "x"), _record("eagle3:tts", "p1", [2] * 20, "x")]
    run = _run(tmp_path, "run", records)
    out = tmp_path / "out"
    script = load_script("compare_quarters")
    argv = ["--out", str(out), "--series", f"frozen={run}:eagle3:frozen", f"tts={run}:eagle3:tts",
            "--against", "frozen", "--gain", "tts=frozen"]  # fmt: skip
    assert script.main(argv) == 0
    text = (out / "quarters.md").read_text()
    assert "Outputs identical in every series." in text
    assert "| tts / frozen |  |  |  | 2.000 | 2.000 | 2.000 | 2.000 |  |" in text
    assert "| tts over frozen |  |  |  | +100.0% | +100.0% | +100.0% | +100.0% |  |" in text
    saved = json.loads((out / "quarters.json").read_text())
    assert [r["label"] for r in saved["rows"]] == ["frozen", "tts"] and saved["meta"]["prompts"] == ["p1"]
    assert (out / "quarters.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="not a series label"):
        script.main([*argv[:-2], "--gain", "tts=nope"])
