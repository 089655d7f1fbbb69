"""sglang_tts.bench.metrics: pooled acceptance, position buckets, ratios against frozen, the best stride."""

from __future__ import annotations

import pytest
from bench_testing import full_configs, full_records, record

from sglang_tts.bench.metrics import (
    ALL,
    aggregate,
    aggregate_by_sampling,
    bucket_accept,
    long_and_clean,
    pooled_accept,
    pooled_accept_from,
    pooled_by_quarter,
    round_starts,
    rounds_by_quarter,
    rounds_from,
    rounds_in_new_text,
    sampling_order,
)


def test_round_starts_count_the_prefill_token_as_position_zero():
    assert round_starts([1, 3, 2, 4]) == [1, 2, 5, 7]
    assert round_starts([]) == []


def test_rounds_from_selects_by_start_position_against_the_requests_own_length():
    r = record("eagle3:frozen", "d", [1] * 40 + [2] * 10, 7.0)  # 61 tokens, starts 1..40, 41, 43, .., 59
    assert r.completion_tokens == 61
    assert rounds_from(r, 0.5) == [1] * 10 + [2] * 10  # starts >= 30.5
    assert rounds_from(r, 0.75) == [2] * 7  # starts >= 45.75: 47, 49, .., 59
    assert pooled_accept_from([r], 0.5) == pytest.approx(1.5)
    assert pooled_accept_from([r], 0.75) == pytest.approx(2.0)


def test_pooled_accept_weighs_rounds_and_falls_back_to_sglangs_mean():
    long = record("c", "d", [2] * 30, 1.0)
    short = record("c", "d", [4] * 10, 1.0)
    # pooled: (60 + 40) / 40 rounds, not the mean of the per-request means (3.0)
    assert pooled_accept([long, short]) == pytest.approx(2.5)
    stock = record("c", "d", None, 1.0, completion_tokens=100)
    stock.spec_accept_length, stock.spec_verify_ct = 1.5, 20
    assert pooled_accept([stock]) == pytest.approx(1.5)
    assert pooled_accept([stock, short]) == pytest.approx((30 + 40) / 30)
    assert pooled_accept([record("no-spec", "d", None, 1.0, completion_tokens=5)]) is None


def test_bucket_accept_pools_rounds_by_their_first_tokens_position():
    a = record("c", "d", [1] * 40 + [2] * 10, 1.0)
    buckets = bucket_accept([a], 20)
    assert [(b.start, b.size, b.rounds) for b in buckets] == [(0, 20, 19), (20, 20, 20), (40, 20, 11)]
    assert [b.mean for b in buckets] == pytest.approx([1.0, 1.0, 21 / 11])
    b = record("c", "d", [5, 5], 1.0)  # starts 1, 6: both in bucket 0
    pooled = bucket_accept([a, b], 20)
    assert pooled[0].rounds == 21
    assert pooled[0].mean == pytest.approx((19 + 10) / 21)
    with pytest.raises(ValueError):
        bucket_accept([a], 0)


def test_aggregate_summaries_and_ratios_against_frozen():
    agg = aggregate(full_records(), full_configs(), bucket=20)
    assert agg.datasets == ["aime2024", "math500"]
    frozen = agg.summary("eagle3:frozen", "aime2024")
    tts = agg.summary("eagle3:tts-s1", "aime2024")
    assert frozen.accept_mean == pytest.approx(1.2)
    assert frozen.tokens_per_s == pytest.approx(61 / 7)
    assert tts.accept_mean == pytest.approx(2.0)
    assert tts.accept_second_half == pytest.approx(3.0)
    assert tts.updates == 40 and tts.ms_per_update == pytest.approx(10.0)

    c = agg.comparison("eagle3:tts-s1", "aime2024")
    assert c.baseline == "eagle3:frozen"
    assert c.accept_gain_pct == pytest.approx(200 / 3)
    assert c.second_half_gain == pytest.approx(3.0 - 1.5)
    assert c.last_quarter_gain_pct == pytest.approx(50.0)
    assert c.tokens_per_s_ratio == pytest.approx((81 / 5) / (61 / 7))
    assert agg.comparison("eagle3:tts-s1", "math500").accept_gain_pct == pytest.approx(25.0)

    # "all" pools both datasets: (80 + 60) / 80 rounds vs (60 + 60) / 100 rounds
    both = agg.comparison("eagle3:tts-s1", ALL)
    assert agg.summary("eagle3:tts-s1").accept_mean == pytest.approx(1.75)
    assert both.accept_gain_pct == pytest.approx((1.75 / 1.2 - 1) * 100)
    assert both.tokens_per_s_ratio == pytest.approx((142 / 10) / (122 / 14))

    # stock has no per-round lengths: SGLang's mean, no buckets, no comparison (it is no TTS configuration)
    stock = agg.summary("dflash:stock")
    assert stock.accept_mean == pytest.approx(1.25) and stock.buckets == [] and stock.rounds == 0
    assert agg.comparison("dflash:stock") is None
    assert agg.summary("no-spec").tokens_per_s == pytest.approx(10.0)
    assert agg.summary("no-spec").accept_mean is None


def test_sync_update_cost_and_updates_free_bound():
    agg = aggregate(full_records(), full_configs(), bucket=20)
    sync = agg.summary("eagle3:tts-s5-sync")
    assert sync.sync and sync.updates == 16 and sync.update_ms == pytest.approx(1600)
    assert sync.ms_per_update == pytest.approx(100.0)
    assert sync.update_wall_fraction == pytest.approx(1.6 / 12)
    assert sync.updates_free_tokens_per_s == pytest.approx(142 / (12 - 1.6))
    assert agg.summary("eagle3:tts-s5").updates_free_tokens_per_s is None  # async: no bound


def test_best_tts_is_the_fastest_asynchronous_stride_per_kind():
    agg = aggregate(full_records(), full_configs(), bucket=20)
    assert agg.best_tts == {"eagle3": "eagle3:tts-s5", "dflash": "dflash:tts-s5"}


def test_output_agreement_names_prompts_whose_outputs_differ():
    records = [
        record("eagle3:frozen", "d", [1], 1.0, prompt_id="p0", output_digest="a"),
        record("eagle3:tts-s1", "d", [1], 1.0, prompt_id="p0", output_digest="a"),
        record("eagle3:frozen", "d", [1], 1.0, prompt_id="p1", output_digest="b"),
        record("eagle3:tts-s1", "d", [1], 1.0, prompt_id="p1", output_digest="c"),
    ]
    agg = aggregate(records, full_configs(("frozen", "tts-s1")), bucket=8)
    assert agg.output_agreement == {"prompts": 2, "differing": ["p1"]}
    assert agg.repetitive == []


def test_outputs_whose_last_quarter_loops_are_listed():
    records = [
        record("eagle3:frozen", "d", [1], 1.0, prompt_id="p0", distinct_ngrams=[0.95, 0.9, 0.6, 0.31]),
        record("eagle3:tts-s1", "d", [1], 1.0, prompt_id="p0", distinct_ngrams=[0.95, 0.9, 0.6, 0.5]),
        record("eagle3:tts-s1", "d", [1], 1.0, prompt_id="p1", distinct_ngrams=[0.9, 0.2, 0.9, None]),
        record("eagle3:frozen", "d", [1], 1.0, prompt_id="p1"),  # no text recorded (an older run)
    ]
    agg = aggregate(records, full_configs(("frozen", "tts-s1")), bucket=8)
    assert agg.repetitive == [{"config": "eagle3:frozen", "prompt_id": "p0", "round": 0, "last_quarter": 0.31}]


def test_sampling_modes_are_aggregated_separately():
    greedy = full_records()
    hot = [record(r.config, r.dataset, r.accept_lengths, r.wall_s * 2, sampling="t0.7") for r in greedy]
    by = aggregate_by_sampling([*hot, *greedy], full_configs(), bucket=20)
    assert list(by) == ["greedy", "t0.7"]
    assert by["greedy"].summary("eagle3:frozen").tokens_per_s == pytest.approx(122 / 14)
    assert by["t0.7"].summary("eagle3:frozen").tokens_per_s == pytest.approx(122 / 28)
    assert sampling_order(["t1", "t0.7", "greedy", "t0.7"]) == ["greedy", "t0.7", "t1"]


def test_concurrent_modes_charge_each_request_its_share_of_the_wave():
    greedy = full_records()
    batched = []
    for r in greedy:
        # Four requests sent together: each took 3x its sequential time, the wave as long as the slowest.
        batched.append(record(r.config, r.dataset, r.accept_lengths, r.wall_s * 3, sampling="greedy-c4", concurrency=4))
        batched[-1].wave_wall_s = r.wall_s * 3
    by = aggregate_by_sampling([*batched, *greedy], full_configs(), bucket=20)
    assert list(by) == ["greedy", "greedy-c4"]
    # Same tokens, each request charged a quarter of 3x the time: 4/3 of the sequential rate.
    assert by["greedy-c4"].summary("eagle3:frozen").tokens_per_s == pytest.approx(122 / 14 * 4 / 3)
    assert by["greedy-c4"].summary("eagle3:frozen").accept_mean == by["greedy"].summary("eagle3:frozen").accept_mean
    assert sampling_order(["greedy-c4", "t0.7", "greedy", "t0.7-c4", "greedy-c8"]) == [
        "greedy",
        "t0.7",
        "greedy-c4",
        "t0.7-c4",
        "greedy-c8",
    ]


def test_acceptance_on_new_text_leaves_out_the_rounds_in_looping_quarters():
    # 61 tokens: 20 one-token rounds (starts 1..20), then ten 4-token rounds (starts 21, 25, ..., 57).
    tts = record("eagle3:tts-s1", "d", [1] * 20 + [4] * 10, 1.0, distinct_ngrams=[0.9, 0.9, 0.1, 0.1])
    # Quarters of 61 tokens: the loop starts at position 31, so only the 4-token rounds at 21, 25, 29 count.
    assert rounds_in_new_text(tts) == [1] * 20 + [4] * 3
    assert rounds_in_new_text(record("eagle3:tts-s1", "d", [2, 2], 1.0)) == []  # no text scores
    frozen = record("eagle3:frozen", "d", [1] * 40, 1.0, distinct_ngrams=[0.9] * 4)
    agg = aggregate([tts, frozen], full_configs(("frozen", "tts-s1")), bucket=8)
    assert agg.summary("eagle3:tts-s1").accept_new_text == pytest.approx(32 / 23)
    assert agg.summary("eagle3:tts-s1").accept_mean == pytest.approx(60 / 30)  # the loop inflates the mean
    assert agg.comparison("eagle3:tts-s1").new_text_gain_pct == pytest.approx((32 / 23 - 1) * 100)


def test_rounds_by_quarter_split_by_start_and_drop_looping_quarters_on_request():
    # 61 tokens: quarters start at 0, 15.25, 30.5, 45.75; one-token rounds start 1..20, 4-token ones 21, 25, ..., 57.
    r = record("eagle3:tts-s1", "d", [1] * 20 + [4] * 10, 1.0, distinct_ngrams=[0.9, 0.9, 0.1, 0.9])
    assert rounds_by_quarter(r) == [[1] * 15, [1] * 5 + [4] * 3, [4] * 4, [4] * 3]
    assert rounds_by_quarter(r, new_text=True) == [[1] * 15, [1] * 5 + [4] * 3, [], [4] * 3]
    assert rounds_by_quarter(record("c", "d", [2, 2], 1.0), new_text=True) == [[], [], [], []]  # no text scores
    other = record("eagle3:tts-s1", "d", [2] * 30, 1.0, distinct_ngrams=[0.9] * 4)  # 61 tokens, starts 1, 3, ..., 59
    assert pooled_by_quarter([r, other]) == pytest.approx(
        [(15 + 16) / 23, (17 + 14) / 15, (16 + 16) / 12, (12 + 14) / 10]
    )
    assert pooled_by_quarter([r, other], new_text=True)[2] == pytest.approx(2.0)  # only `other` counts there
    assert pooled_by_quarter([]) == [None] * 4
    agg = aggregate([r, other], full_configs(("tts-s1",)), bucket=8)
    assert agg.summary("eagle3:tts-s1").accept_by_quarter_new_text[2] == pytest.approx(2.0)


def test_long_outputs_that_never_loop_are_pooled_as_whole_requests():
    clean, looping = [0.9] * 4, [0.9, 0.9, 0.9, 0.2]
    # Two long clean answers per configuration, one long looping one and one short clean one (both left out).
    frozen = [
        record("eagle3:frozen", "d", [1] * 1100, 1.0, prompt_id="a", distinct_ngrams=clean),
        record("eagle3:frozen", "d", [2] * 520, 1.0, prompt_id="b", distinct_ngrams=clean),
        record("eagle3:frozen", "d", [1] * 1100, 1.0, prompt_id="c", distinct_ngrams=looping),
        record("eagle3:frozen", "d", [1] * 100, 1.0, prompt_id="e", distinct_ngrams=clean),
    ]
    tts = [
        record("eagle3:tts-s1", "d", [2] * 550, 1.0, prompt_id="a", distinct_ngrams=clean),
        record("eagle3:tts-s1", "d", [4] * 260, 1.0, prompt_id="b", distinct_ngrams=clean),
        record("eagle3:tts-s1", "d", [4] * 275, 1.0, prompt_id="c", distinct_ngrams=looping),
        record("eagle3:tts-s1", "d", [1] * 100, 1.0, prompt_id="e", distinct_ngrams=clean),
    ]
    assert [long_and_clean(r) for r in frozen] == [True, True, False, False]
    assert not long_and_clean(record("eagle3:frozen", "d", [1] * 1100, 1.0))  # no text scores: not counted
    agg = aggregate(frozen + tts, full_configs(("frozen", "tts-s1")), bucket=64)
    mine, base = agg.summary("eagle3:tts-s1"), agg.summary("eagle3:frozen")
    assert (base.long_clean_requests, mine.long_clean_requests) == (2, 2)
    assert base.accept_long_clean == pytest.approx((1100 + 1040) / (1100 + 520))
    assert mine.accept_long_clean == pytest.approx((1100 + 1040) / (550 + 260))
    assert agg.comparison("eagle3:tts-s1").long_clean_gain_pct == pytest.approx(
        ((2140 / 810) / (2140 / 1620) - 1) * 100
    )
