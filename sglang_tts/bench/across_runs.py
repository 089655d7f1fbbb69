"""Acceptance by quarter of the output, compared across benchmark runs on the same prompts.

One run of ``scripts/bench_long.py`` serves one drafter; comparing drafters (a shipped one against one
trained on shorter sequences, each frozen and with TTS) means pooling configurations of several runs.
A series is one configuration of one run (``LABEL=RUN_DIR:CONFIG``); only the prompts that every series
answered count, and under greedy decoding their outputs should be the same text (the digests are
checked and reported), so "the quarters that do not loop" are the same quarters in every series.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sglang_tts.bench.metrics import pooled_by_quarter
from sglang_tts.bench.runner import RequestRecord, parse_mode


@dataclass(frozen=True)
class Series:
    label: str
    run_dir: Path
    config: str

    @classmethod
    def parse(cls, text: str) -> Series:
        """``LABEL=RUN_DIR:CONFIG`` (CONFIG as the run names it, e.g. ``eagle3:frozen``)."""
        label, sep, rest = text.partition("=")
        run_dir, sep2, config = rest.partition(":")
        if not sep or not sep2 or not label or not run_dir or not config:
            raise ValueError(f"a series is LABEL=RUN_DIR:CONFIG, got {text!r}")
        return cls(label, Path(run_dir), config)


@dataclass
class QuarterRow:
    label: str
    config: str
    run: str
    requests: int
    concurrency: int  # requests in flight when the series ran (the largest of its records)
    by_quarter: list[float | None]  # pooled tokens per round of the rounds starting in each quarter
    by_quarter_no_loop: list[float | None]  # ... over the quarters that do not loop


def load_records(run_dir: Path, config: str, sampling: str = "greedy") -> dict[str, RequestRecord]:
    """The run's records of ``config`` in one sampling mode (``greedy``, ``t0.7``: at any concurrency), by
    prompt id (the first of each prompt)."""
    payload = json.loads((run_dir / "results.json").read_text())
    out: dict[str, RequestRecord] = {}
    for data in payload["requests"]:
        record = RequestRecord.from_json(data)
        if record.config == config and parse_mode(record.sampling)[0] == sampling:
            out.setdefault(record.prompt_id, record)
    if not out:
        raise ValueError(f"{run_dir} has no {sampling} records of {config!r}")
    return out


def compare_quarters(
    series: Sequence[Series], sampling: str = "greedy"
) -> tuple[list[QuarterRow], list[str], list[str]]:
    """Per series, acceptance by quarter over the prompts every series answered. Returns the rows, those
    prompt ids, and the prompt ids whose output digests differ between series (should be none when greedy)."""
    loaded = [load_records(s.run_dir, s.config, sampling) for s in series]
    common = sorted(set.intersection(*(set(r) for r in loaded))) if loaded else []
    if not common:
        raise ValueError("the series share no prompt")
    differing = [p for p in common if len({records[p].output_digest for records in loaded}) > 1]
    rows = []
    for s, records in zip(series, loaded):
        chosen = [records[p] for p in common]
        rows.append(
            QuarterRow(
                label=s.label,
                config=s.config,
                run=s.run_dir.name,
                requests=len(chosen),
                concurrency=max(r.concurrency or 1 for r in chosen),
                by_quarter=pooled_by_quarter(chosen),
                by_quarter_no_loop=pooled_by_quarter(chosen, new_text=True),
            )
        )
    return rows, common, differing
