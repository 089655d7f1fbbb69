"""Natural answer lengths per workload, from a benchmark's request records.

The long-generation workload is meant to draw answers of more than 1,500 tokens that do not loop; whether
it does depends on the model, so it is measured, not assumed: run the prompts without ``--ignore-eos``
(``scripts/answer_lengths.py`` does it through ``scripts/bench_long.py``) and summarise the records here.
A request that stopped by itself (finish reason ``stop``) has a natural length; one cut at
``--max-new-tokens`` (``length``) only gives a lower bound and is counted apart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sglang_tts.bench.metrics import long_and_clean, loops
from sglang_tts.bench.repetition import REPETITIVE_BELOW
from sglang_tts.bench.runner import RequestRecord

QUANTILES = (("min", 0.0), ("p10", 0.1), ("p25", 0.25), ("median", 0.5), ("p75", 0.75), ("p90", 0.9), ("max", 1.0))
LONG_TOKENS = 1500  # the long-generation workload's target length


class LengthsError(ValueError):
    """The records cannot give natural lengths (e.g. the run ignored EOS); the message says why."""


@dataclass(frozen=True)
class LengthStats:
    """Answer lengths of one workload in one sampling mode."""

    dataset: str
    sampling: str
    requests: int
    natural: int  # stopped by themselves
    truncated: int  # cut at max_new_tokens: their natural length is longer
    looping: int  # some quarter under REPETITIVE_BELOW distinct word 4-grams
    long_clean: int  # at least `threshold` tokens and no looping quarter (natural or truncated)
    threshold: int
    quantiles: dict[str, int]  # over the natural ends (empty when none)

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "quantiles": dict(self.quantiles)}


def nearest_rank(sorted_values: Sequence[int], q: float) -> int:
    """The ``q`` quantile by the nearest-rank rule (``q = 0``: the minimum)."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def pick_config(records: Sequence[RequestRecord], config: str | None) -> str:
    """``config`` if given (it must have records), else ``no-spec`` if present, else the first one recorded."""
    names = list(dict.fromkeys(r.config for r in records))
    if not names:
        raise LengthsError("the run has no request records")
    if config is None:
        return "no-spec" if "no-spec" in names else names[0]
    if config not in names:
        raise LengthsError(f"no records of configuration {config!r}; recorded: {', '.join(names)}")
    return config


def length_stats(
    records: Sequence[RequestRecord], config: str | None = None, threshold: int = LONG_TOKENS
) -> list[LengthStats]:
    """Per (workload, sampling mode): lengths of one configuration's requests (:func:`pick_config`).

    A batched mode (``greedy-c8``) is a mode of its own; each prompt counts once per mode (a wave cycles
    the prompt list to fill itself, so a prompt can appear twice in one mode).
    """
    name = pick_config(records, config)
    groups: dict[tuple[str, str], dict[str, RequestRecord]] = {}
    for record in records:
        if record.config == name:
            groups.setdefault((record.dataset, record.sampling), {}).setdefault(record.prompt_id, record)
    out = []
    for (dataset, sampling), by_prompt in sorted(groups.items()):
        group = list(by_prompt.values())
        natural = sorted(r.completion_tokens for r in group if r.finish_reason == "stop")
        out.append(
            LengthStats(
                dataset=dataset,
                sampling=sampling,
                requests=len(group),
                natural=len(natural),
                truncated=sum(r.finish_reason == "length" for r in group),
                looping=sum(loops(r) for r in group),
                long_clean=sum(long_and_clean(r, threshold) for r in group),
                threshold=threshold,
                quantiles={label: nearest_rank(natural, q) for label, q in QUANTILES} if natural else {},
            )
        )
    return out


def stats_from_results(
    payload: dict[str, Any], config: str | None = None, threshold: int = LONG_TOKENS
) -> list[LengthStats]:
    """:func:`length_stats` of a loaded ``results.json``; refuses a run made with ``ignore_eos``."""
    if payload.get("settings", {}).get("ignore_eos"):
        raise LengthsError("this run ignored EOS (--ignore-eos): its lengths are the cap, not natural answer lengths")
    return length_stats([RequestRecord.from_json(r) for r in payload["requests"]], config, threshold)


def render_lengths(stats: Sequence[LengthStats], source: str) -> str:
    """A markdown table of :func:`length_stats` (tokens of the natural ends; counts of the others)."""
    if not stats:
        return f"No requests in {source}.\n"
    threshold = stats[0].threshold
    header = ["workload", "mode", "requests", "natural ends", "cut at max", "loop"]
    header += [label for label, _ in QUANTILES] + [f">= {threshold} & no loop"]
    lines = [
        f"Natural answer lengths (tokens), {source}",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|",
    ]
    for s in stats:
        values = [str(s.quantiles[label]) if s.quantiles else "-" for label, _ in QUANTILES]
        row = [s.dataset, s.sampling, str(s.requests), str(s.natural), str(s.truncated), str(s.looping)]
        lines.append("| " + " | ".join([*row, *values, str(s.long_clean)]) + " |")
    lines += [
        "",
        "Quantiles are over the answers that ended by themselves; an answer cut at the token cap is longer than the "
        f"cap. loop: some quarter of the text under {REPETITIVE_BELOW} distinct word 4-grams.",
    ]
    return "\n".join(lines) + "\n"
