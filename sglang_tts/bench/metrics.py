"""Aggregates of per-request records (pure functions: no servers, no files).

Definitions (report.md repeats them). Every number is computed per sampling mode (greedy, each
temperature: :func:`aggregate_by_sampling`), never pooled across modes.

* acceptance length: tokens emitted per verify round, bonus token included (SGLang's
  ``spec_accept_length``). Means are pooled over rounds (sum of tokens / number of rounds, over all
  requests of a configuration and dataset), so long requests weigh by their length. Records without
  per-round lengths fall back to ``spec_accept_length`` weighted by ``spec_verify_ct`` (overall mean
  only: position-resolved numbers need the rounds).
* output position of a round: the position of its first token; the first output token comes from
  prefill (position 0), so round 1 starts at position 1. A bucket ``[b, b + bucket)`` holds the
  rounds starting in it; "second half" / "last quarter" hold the rounds starting at or after 1/2 / 3/4
  of that request's own completion length.
* throughput: completion tokens / client-side wall seconds, pooled (total tokens / total seconds). At
  concurrency c > 1 (modes ``greedy-c4``...) a request's seconds are its wave's wall time / c, so the
  pooled number is the server's output rate with c requests in flight.
* acceptance on new text: pooled over the rounds that start in a quarter of their output whose
  distinct word 4-gram share is at least ``REPETITIVE_BELOW`` (see ``sglang_tts.bench.repetition``):
  a loop is easy to draft once seen, so this separates adapting to the request from learning a loop.
* long outputs that never loop (the headline set): pooled over the requests with at least
  ``LONG_OUTPUT_TOKENS`` completion tokens and every quarter at or above ``REPETITIVE_BELOW``; whole
  requests, so a configuration's number covers the same text as another's under greedy decoding.
* update cost: ``tts_update_ms`` (time inside updates, overlapped with serving unless ``--tts-sync``);
  per update and as a fraction of wall time.
* updates-free bound (sync configurations only): completion tokens / (wall - update time). With
  ``--tts-sync`` each update runs inline on the serving thread, so subtracting it estimates the
  tokens/s that the same acceptance would give if updates cost nothing: an upper bound for what the
  asynchronous executor at that stride can reach. It ignores that an overlapped update still competes
  for cores and memory bandwidth (on a 2-core CPU the worker thread does), so it is optimistic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from sglang_tts.bench.configs import BenchConfig
from sglang_tts.bench.repetition import REPETITIVE_BELOW
from sglang_tts.bench.runner import RequestRecord, parse_mode

ALL = "all"  # the dataset label of the pooled-over-datasets rows
LONG_OUTPUT_TOKENS = 1024  # "long" in the headline set: outputs this long that never loop
GREEDY = "greedy"


def round_starts(accept_lengths: Sequence[int]) -> list[int]:
    """Output position of each round's first token (position 0 is the prefill token)."""
    starts, position = [], 1
    for length in accept_lengths:
        starts.append(position)
        position += length
    return starts


def rounds_from(record: RequestRecord, fraction: float) -> list[int]:
    """Accept lengths of the rounds starting at or after ``fraction`` of the request's completion length."""
    lengths = record.accept_lengths or []
    threshold = fraction * record.completion_tokens
    return [n for n, start in zip(lengths, round_starts(lengths)) if start >= threshold]


def rounds_in_new_text(record: RequestRecord) -> list[int]:
    """Accept lengths of the rounds starting in a quarter of the output that does not loop (distinct word
    4-gram share at least REPETITIVE_BELOW), in round order; empty for records without text scores."""
    return [n for quarter in rounds_by_quarter(record, new_text=True) for n in quarter]


def quarter_of(start: int, completion_tokens: int) -> int:
    """The quarter (0-3) of an output of ``completion_tokens`` tokens in which position ``start`` lies."""
    return min(3, 4 * start // completion_tokens)


def rounds_by_quarter(record: RequestRecord, new_text: bool = False) -> list[list[int]]:
    """Accept lengths of the rounds starting in each quarter of the output (four lists). ``new_text``:
    a quarter that loops (distinct word 4-gram share under REPETITIVE_BELOW) or has no score is left
    empty, as in :func:`rounds_in_new_text`."""
    quarters: list[list[int]] = [[], [], [], []]
    lengths, shares = record.accept_lengths or [], record.distinct_ngrams
    if not lengths or record.completion_tokens <= 0 or (new_text and not shares):
        return quarters
    for n, start in zip(lengths, round_starts(lengths)):
        q = quarter_of(start, record.completion_tokens)
        if new_text and (shares[q] is None or shares[q] < REPETITIVE_BELOW):
            continue
        quarters[q].append(n)
    return quarters


def pooled_by_quarter(records: Iterable[RequestRecord], new_text: bool = False) -> list[float | None]:
    """Pooled tokens per round of the rounds starting in each quarter of their output (None: no round)."""
    pooled: list[list[int]] = [[], [], [], []]
    for record in records:
        for q, rounds in enumerate(rounds_by_quarter(record, new_text)):
            pooled[q].extend(rounds)
    return [_mean(rounds) for rounds in pooled]


def loops(record: RequestRecord) -> bool:
    """Some quarter of the output is under REPETITIVE_BELOW distinct word 4-grams."""
    return any(share is not None and share < REPETITIVE_BELOW for share in record.distinct_ngrams or [])


def long_and_clean(record: RequestRecord, min_tokens: int = LONG_OUTPUT_TOKENS) -> bool:
    """At least ``min_tokens`` completion tokens, text scores present, and no quarter that loops."""
    return record.completion_tokens >= min_tokens and bool(record.distinct_ngrams) and not loops(record)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def pooled_accept(records: Iterable[RequestRecord]) -> float | None:
    """Pooled tokens per round; from per-round lengths where present, else from SGLang's means."""
    tokens = rounds = 0.0
    for r in records:
        if r.accept_lengths:
            tokens += sum(r.accept_lengths)
            rounds += len(r.accept_lengths)
        elif r.spec_accept_length is not None and r.spec_verify_ct:
            tokens += r.spec_accept_length * r.spec_verify_ct
            rounds += r.spec_verify_ct
    return tokens / rounds if rounds else None


def pooled_accept_from(records: Iterable[RequestRecord], fraction: float) -> float | None:
    """Pooled tokens per round over the rounds starting at or after ``fraction`` of each output."""
    return _mean([n for r in records for n in rounds_from(r, fraction)])


@dataclass
class Bucket:
    """Acceptance of the rounds whose first token falls in ``[start, start + size)``."""

    start: int
    size: int
    mean: float
    rounds: int


def bucket_accept(records: Iterable[RequestRecord], size: int) -> list[Bucket]:
    """Pooled acceptance per output-position bucket, in position order (empty buckets omitted)."""
    if size < 1:
        raise ValueError(f"bucket size must be >= 1, got {size}")
    sums: dict[int, list[int]] = {}
    for r in records:
        lengths = r.accept_lengths or []
        for n, start in zip(lengths, round_starts(lengths)):
            acc = sums.setdefault(start // size, [0, 0])
            acc[0] += n
            acc[1] += 1
    return [Bucket(b * size, size, total / count, count) for b, (total, count) in sorted(sums.items())]


@dataclass
class Summary:
    """One configuration on one dataset (or ``all``)."""

    config: str
    dataset: str
    variant: str
    kind: str | None
    stride: int | None
    sync: bool
    requests: int
    completion_tokens: int
    wall_s: float
    tokens_per_s: float
    rounds: int  # rounds with per-round data
    accept_mean: float | None
    accept_second_half: float | None
    accept_last_quarter: float | None
    buckets: list[Bucket] = field(default_factory=list)
    updates: int | None = None
    skipped_updates: int | None = None
    update_ms: float | None = None
    ms_per_update: float | None = None
    update_wall_fraction: float | None = None
    updates_free_tokens_per_s: float | None = None
    accept_new_text: float | None = None  # rounds in quarters that do not loop (rounds_in_new_text)
    # pooled tokens per round of the rounds starting in each quarter of their output; and the same
    # over the quarters that do not loop (rounds_by_quarter)
    accept_by_quarter: list[float | None] = field(default_factory=lambda: [None] * 4)
    accept_by_quarter_new_text: list[float | None] = field(default_factory=lambda: [None] * 4)
    long_clean_requests: int = 0  # requests of >= LONG_OUTPUT_TOKENS tokens that never loop (long_and_clean)
    accept_long_clean: float | None = None  # pooled over those requests
    prompt_positions: int | None = None  # --tts-prompt-adapt: prompt positions learned, summed over requests
    prompt_ms: float | None = None  # ... run time of those prompt updates, summed per request
    ttft_mean_s: float | None = None  # streamed requests: mean time to first token (client-side)
    # --tts-hybrid: rounds each proposer drafted and its accepted drafted tokens, summed over requests;
    # requests whose drafter --tts-hybrid-retire-below retired
    suffix_rounds: int | None = None
    suffix_accepted: int | None = None
    drafter_rounds: int | None = None
    drafter_accepted: int | None = None
    retired_requests: int | None = None
    idle_updates: int | None = None  # updates skipped, the drafter having drafted none of their stride (per request)
    # prompt tokens asked and those SGLang's radix cache served; at several in flight a wave's copies of
    # one prompt share its prefix or not depending on when each reaches the scheduler
    prompt_tokens: int | None = None
    cached_tokens: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def sum_opt(values: Iterable[float | None]) -> float | None:
    """The sum of the values present; None when none is (no server reported the counter)."""
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def summarize(records: Sequence[RequestRecord], config: BenchConfig, dataset: str, bucket: int) -> Summary:
    """Aggregate one configuration's records (already filtered to one dataset, or all of them)."""
    tokens = sum(r.completion_tokens for r in records)
    wall = sum(r.share_wall_s for r in records)
    updates = _sum_int(r.tts_num_updates for r in records)
    skipped = _sum_int(r.tts_num_skipped_updates for r in records)
    update_ms = sum_opt(r.tts_update_ms for r in records)
    clean = [r for r in records if long_and_clean(r)]
    positions = _sum_int(r.tts_prompt_positions for r in records)
    free = None
    if config.sync and update_ms is not None and wall - update_ms / 1000 > 0:
        free = tokens / (wall - update_ms / 1000)
    return Summary(
        config=config.name,
        dataset=dataset,
        variant=config.variant,
        kind=config.kind,
        stride=config.stride,
        sync=config.sync,
        requests=len(records),
        completion_tokens=tokens,
        wall_s=wall,
        tokens_per_s=tokens / wall if wall > 0 else math.nan,
        rounds=sum(len(r.accept_lengths or []) for r in records),
        accept_mean=pooled_accept(records),
        accept_second_half=pooled_accept_from(records, 0.5),
        accept_last_quarter=pooled_accept_from(records, 0.75),
        buckets=bucket_accept(records, bucket),
        updates=updates,
        skipped_updates=skipped,
        update_ms=update_ms,
        ms_per_update=update_ms / updates if update_ms is not None and updates else None,
        update_wall_fraction=update_ms / 1000 / wall if update_ms is not None and wall > 0 else None,
        updates_free_tokens_per_s=free,
        accept_new_text=_mean([n for r in records for n in rounds_in_new_text(r)]),
        accept_by_quarter=pooled_by_quarter(records),
        accept_by_quarter_new_text=pooled_by_quarter(records, new_text=True),
        long_clean_requests=len(clean),
        accept_long_clean=pooled_accept(clean),
        prompt_positions=positions,
        prompt_ms=sum_opt(r.tts_prompt_ms for r in records),
        ttft_mean_s=_mean([r.ttft_s for r in records if r.ttft_s is not None]),
        suffix_rounds=_sum_int(r.tts_suffix_rounds for r in records),
        suffix_accepted=_sum_int(r.tts_suffix_accepted for r in records),
        drafter_rounds=_sum_int(r.tts_drafter_rounds for r in records),
        drafter_accepted=_sum_int(r.tts_drafter_accepted for r in records),
        retired_requests=_sum_int(r.tts_drafter_retired for r in records),
        idle_updates=_sum_int(r.tts_idle_updates for r in records),
        prompt_tokens=_sum_int(r.prompt_tokens for r in records),
        cached_tokens=_sum_int(r.cached_tokens for r in records),
    )


def _sum_int(values: Iterable[int | None]) -> int | None:
    """sum_opt of a count, as an int."""
    total = sum_opt(values)
    return None if total is None else int(total)


def _pct(new: float | None, old: float | None) -> float | None:
    if new is None or old is None or old == 0:
        return None
    return (new / old - 1.0) * 100.0


def _diff(new: float | None, old: float | None) -> float | None:
    return None if new is None or old is None else new - old


def _ratio(new: float | None, old: float | None) -> float | None:
    if new is None or old is None or old == 0 or math.isnan(old) or math.isnan(new):
        return None
    return new / old


@dataclass
class Comparison:
    """A TTS configuration against the frozen drafter of the same kind on the same dataset."""

    config: str
    baseline: str
    dataset: str
    accept_gain_pct: float | None  # (tts / frozen - 1) * 100, overall
    second_half_gain: float | None  # tts - frozen, tokens per round, rounds in the second half
    last_quarter_gain_pct: float | None
    tokens_per_s_ratio: float | None  # tts / frozen
    new_text_gain_pct: float | None = None  # acceptance gain over the quarters that do not loop
    long_clean_gain_pct: float | None = None  # acceptance gain over the long outputs that never loop

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def compare(tts: Summary, frozen: Summary) -> Comparison:
    return Comparison(
        config=tts.config,
        baseline=frozen.config,
        dataset=tts.dataset,
        accept_gain_pct=_pct(tts.accept_mean, frozen.accept_mean),
        second_half_gain=_diff(tts.accept_second_half, frozen.accept_second_half),
        last_quarter_gain_pct=_pct(tts.accept_last_quarter, frozen.accept_last_quarter),
        tokens_per_s_ratio=_ratio(tts.tokens_per_s, frozen.tokens_per_s),
        new_text_gain_pct=_pct(tts.accept_new_text, frozen.accept_new_text),
        long_clean_gain_pct=_pct(tts.accept_long_clean, frozen.accept_long_clean),
    )


@dataclass
class Aggregates:
    """Everything report.md and the plots show, derived from the records alone."""

    datasets: list[str]
    summaries: list[Summary]
    comparisons: list[Comparison]
    best_tts: dict[str, str]  # kind -> the asynchronous TTS configuration with the highest tokens/s (all data)
    output_agreement: dict[str, Any]
    repetitive: list[dict[str, Any]] = field(default_factory=list)  # outputs whose last quarter loops

    def summary(self, config: str, dataset: str = ALL) -> Summary | None:
        return next((s for s in self.summaries if s.config == config and s.dataset == dataset), None)

    def comparison(self, config: str, dataset: str = ALL) -> Comparison | None:
        return next((c for c in self.comparisons if c.config == config and c.dataset == dataset), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "datasets": self.datasets,
            "summaries": [s.to_json() for s in self.summaries],
            "comparisons": [c.to_json() for c in self.comparisons],
            "best_tts": self.best_tts,
            "output_agreement": self.output_agreement,
            "repetitive": self.repetitive,
        }


def output_agreement(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Whether every configuration produced the same output for each prompt (expected under greedy
    decoding: speculation is lossless; fp32 summation order can still flip a near-tie on long outputs)."""
    by_prompt: dict[str, set[str | None]] = {}
    for r in records:
        by_prompt.setdefault(r.prompt_id, set()).add(r.output_digest)
    differing = sorted(pid for pid, digests in by_prompt.items() if len(digests) > 1)
    return {"prompts": len(by_prompt), "differing": differing}


def repetitive_outputs(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """The requests whose last quarter repeats itself (distinct 4-gram share below REPETITIVE_BELOW): late
    acceptance there measures a loop (see sglang_tts.bench.repetition)."""
    out = []
    for r in records:
        last = (r.distinct_ngrams or [None] * 4)[-1]
        if last is not None and last < REPETITIVE_BELOW:
            out.append({"config": r.config, "prompt_id": r.prompt_id, "round": r.round, "last_quarter": last})
    return out


def frozen_baseline(config: str, kind: str | None, names: Iterable[str]) -> str | None:
    """The frozen configuration a drafter configuration is compared with: the frozen one with the same
    ``+TAG`` suffixes when it ran (``tts+ship`` against ``frozen+ship``: the same drafter, the same extra
    launch flags), else the kind's plain ``frozen``; None when neither ran."""
    if kind is None:
        return None
    names = set(names)
    tags = config.split("+")[1:]
    same = f"{kind}:frozen" + "".join(f"+{tag}" for tag in tags)
    if tags and same in names:
        return same
    plain = f"{kind}:frozen"
    return plain if plain in names else None


def aggregate(records: Sequence[RequestRecord], configs: Sequence[BenchConfig], bucket: int) -> Aggregates:
    """Summaries per (configuration, dataset) and ``all``, comparisons with frozen, the best stride."""
    datasets = sorted({r.dataset for r in records})
    summaries: list[Summary] = []
    for config in configs:
        mine = [r for r in records if r.config == config.name]
        if not mine:
            continue
        for dataset in datasets:
            subset = [r for r in mine if r.dataset == dataset]
            if subset:
                summaries.append(summarize(subset, config, dataset, bucket))
        summaries.append(summarize(mine, config, ALL, bucket))

    index = {(s.config, s.dataset): s for s in summaries}
    names = {s.config for s in summaries}
    comparisons: list[Comparison] = []
    for s in summaries:
        if s.variant != "tts":
            continue
        frozen = index.get((frozen_baseline(s.config, s.kind, names), s.dataset))
        if frozen is not None:
            comparisons.append(compare(s, frozen))

    best: dict[str, str] = {}
    for s in summaries:
        if s.variant == "tts" and not s.sync and s.dataset == ALL and s.kind is not None:
            current = index.get((best.get(s.kind, ""), ALL))
            if current is None or s.tokens_per_s > current.tokens_per_s:
                best[s.kind] = s.config
    return Aggregates(datasets, summaries, comparisons, best, output_agreement(records), repetitive_outputs(records))


def sampling_order(labels: Iterable[str]) -> list[str]:
    """Mode labels in report order: by concurrency (sequential first), then greedy, then by temperature
    (``greedy``, ``t0.7``, ``t1``, ``greedy-c4``, ``t0.7-c4``)."""

    def key(label: str) -> tuple[int, int, float, str]:
        base, concurrency = parse_mode(label)
        if base == GREEDY:
            return (concurrency, 0, 0.0, label)
        try:
            return (concurrency, 1, float(base.lstrip("t")), label)
        except ValueError:
            return (concurrency, 2, 0.0, label)

    return sorted(set(labels), key=key)


def aggregate_by_sampling(
    records: Sequence[RequestRecord], configs: Sequence[BenchConfig], bucket: int
) -> dict[str, Aggregates]:
    """:func:`aggregate` separately per sampling mode (greedy, each temperature): never pooled across them."""
    return {
        label: aggregate([r for r in records if r.sampling == label], configs, bucket)
        for label in sampling_order(r.sampling for r in records)
    }
