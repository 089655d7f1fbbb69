"""sglang_tts.bench.report and suite: the tables, results.json, report.md and PNG plots from records."""

from __future__ import annotations

import json
import math

import pytest
from bench_testing import DRAFTERS, full_configs, full_records, record

from sglang_tts.bench.configs import build_configs
from sglang_tts.bench.metrics import aggregate, aggregate_by_sampling
from sglang_tts.bench.report import (
    PLOTS,
    acceptance_tables,
    async_sync_table,
    concurrency_tables,
    losses,
    position_table,
    prefill_table,
    prompt_ttft_table,
    proposer_table,
    quarter_table,
    reference_tables,
    repetition_sentence,
    throughput_table,
    write_json,
    write_plots,
)
from sglang_tts.bench.runner import SlotLog
from sglang_tts.bench.suite import REPORT, RESULTS, finish, rerender

PNG = b"\x89PNG\r\n\x1a\n"


def _row(text: str, first_cell: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {first_cell} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_acceptance_table_shows_the_gain_over_frozen_per_dataset():
    text = acceptance_tables(aggregate(full_records(), full_configs(), bucket=20))
    row = _row(text, "aime2024")  # eagle3 whole output: frozen, tts-s1, tts-s5, tts-s5-sync
    assert row[:3] == ["aime2024", "1.20", "2.00 (+66.7%)"]
    assert _row(text, "math500")[2] == "1.50 (+25.0%)"
    assert "**dflash, last quarter of each output**" in text
    assert "**eagle3, quarters of each output that do not loop**" in text


def test_acceptance_on_new_text_is_tabled_against_frozen():
    tts = record("eagle3:tts-s1", "d", [1] * 20 + [4] * 10, 1.0, distinct_ngrams=[0.9, 0.9, 0.1, 0.1])
    frozen = record("eagle3:frozen", "d", [1] * 40, 1.0, distinct_ngrams=[0.9] * 4)
    text = acceptance_tables(aggregate([tts, frozen], full_configs(("frozen", "tts-s1")), bucket=8))
    new_text = text.split("quarters of each output that do not loop")[1]
    assert _row(new_text, "all") == ["all", "1.00", "1.39 (+39.1%)"]


def test_long_outputs_that_never_loop_are_tabled_with_their_count():
    frozen = record("eagle3:frozen", "d", [1] * 1100, 1.0, distinct_ngrams=[0.9] * 4)
    tts = record("eagle3:tts-s1", "d", [2] * 550, 1.0, distinct_ngrams=[0.9] * 4)
    text = acceptance_tables(aggregate([tts, frozen], full_configs(("frozen", "tts-s1")), bucket=64))
    long_clean = text.split("outputs of at least 1024 tokens that never loop")[1]
    assert _row(long_clean, "all") == ["all", "1.00 (1)", "2.00 (+100.0%)"]


def test_throughput_and_async_sync_tables():
    agg = aggregate(full_records(), full_configs(), bucket=20)
    text = throughput_table(agg)
    assert _row(text, "no-spec") == ["no-spec", "10.00", "1.00x", "-", "-"]
    # best TTS = tts-s5: 142 tokens / 8 s = 17.75 tok/s, 1.78x no-spec, 2.04x frozen (122 / 14 s)
    assert _row(text, "eagle3:tts-s5 (best TTS)") == ["eagle3:tts-s5 (best TTS)", "17.75", "1.77x", "2.04x", "1.75"]
    assert _row(text, "eagle3:stock (stock)")[1:3] == ["12.50", "1.25x"]
    sync = _row(async_sync_table(agg), "eagle3")
    assert sync[:5] == ["eagle3", "5", "17.75", "11.83", "13.65"]


def test_losses_name_every_configuration_where_tts_does_not_win():
    records = [
        record("eagle3:frozen", "d", [2] * 10, 1.0),
        record("eagle3:tts-s1", "d", [1] * 10, 2.0, tts_num_updates=10, tts_update_ms=10.0),
    ]
    # frozen: 21 tokens / 1 s; TTS: 11 tokens / 2 s
    lost = losses(aggregate(records, full_configs(("frozen", "tts-s1")), bucket=8))
    assert len(lost) == 2  # dataset d and "all"
    assert lost[0].startswith("- eagle3:tts-s1 on d: acceptance -50.0%")
    assert "tokens/s 0.26x of frozen" in lost[0]


def test_position_table_lists_buckets_per_configuration():
    text = position_table(aggregate(full_records(), full_configs(("frozen",)), bucket=20))
    # pooled over both datasets (identical frozen records): 21 of 11 rounds -> 42 tokens / 22 rounds
    assert _row(text, "40-59") == ["40-59", "1.91 (22)", "1.91 (22)"]


def test_quarter_table_gives_each_quarter_and_the_gain_over_frozen():
    # 41 tokens each: frozen 40 one-token rounds; TTS 20 two-token rounds whose last quarter loops.
    frozen = record("eagle3:frozen", "d", [1] * 40, 1.0, distinct_ngrams=[0.9] * 4)
    tts = record("eagle3:tts-s1", "d", [2] * 20, 1.0, distinct_ngrams=[0.9, 0.9, 0.9, 0.1])
    text = quarter_table(aggregate([frozen, tts], full_configs(("frozen", "tts-s1")), bucket=8))
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()[2:]]
    assert rows[0] == ["eagle3:frozen", "all rounds", "1.00", "1.00", "1.00", "1.00"]
    assert rows[2] == [
        "eagle3:tts-s1",
        "all rounds",
        "2.00 (+100.0%)",
        "2.00 (+100.0%)",
        "2.00 (+100.0%)",
        "2.00 (+100.0%)",
    ]
    assert rows[3] == ["eagle3:tts-s1", "no loop", "2.00 (+100.0%)", "2.00 (+100.0%)", "2.00 (+100.0%)", "n/a"]
    assert quarter_table(aggregate([], full_configs(("frozen",)), bucket=8)) is None


def test_a_tagged_drafter_configuration_is_compared_with_the_frozen_one_of_the_same_tags():
    # frozen (1 token a round), frozen+ship (2), tts (2), tts+ship (3): tts+ship's baseline is frozen+ship.
    configs = build_configs(
        ["frozen", "tts", "frozen+ship", "tts+ship"], ["eagle3"], DRAFTERS, variants={"ship": ("--x",)}
    )
    records = [
        record(name, "d", [n] * (60 // n), 1.0, distinct_ngrams=[0.9] * 4)
        for name, n in (("eagle3:frozen", 1), ("eagle3:frozen+ship", 2), ("eagle3:tts", 2), ("eagle3:tts+ship", 3))
    ]
    agg = aggregate(records, configs, bucket=8)
    assert agg.comparison("eagle3:tts+ship").baseline == "eagle3:frozen+ship"
    assert agg.comparison("eagle3:tts+ship").accept_gain_pct == pytest.approx(50.0)
    assert agg.comparison("eagle3:tts").baseline == "eagle3:frozen"
    assert "tts+ship (% vs frozen+ship)" in acceptance_tables(agg)
    assert _row(quarter_table(agg), "eagle3:tts+ship")[2] == "3.00 (+50.0%)"
    assert _row(quarter_table(agg), "eagle3:frozen+ship")[2] == "2.00"  # a frozen variant is its own baseline


def test_prompt_adaptation_and_ttft_are_tabled_only_when_recorded():
    assert prompt_ttft_table(aggregate(full_records(), full_configs(), bucket=20)) is None
    configs = full_configs(("frozen", "tts-s1"))
    frozen = [record("eagle3:frozen", "d", [1] * 10, 1.0, ttft_s=t, prompt_id=f"d-{i}") for i, t in enumerate((1, 2))]
    tts = [
        record("eagle3:tts-s1", "d", [2] * 5, 1.0, ttft_s=t, tts_prompt_positions=512, tts_prompt_ms=3000.0,
               prompt_id=f"d-{i}")
        for i, t in enumerate((1.5, 2.5))
    ]  # fmt: skip
    text = prompt_ttft_table(aggregate(frozen + tts, configs, bucket=8))
    assert _row(text, "eagle3:frozen") == ["eagle3:frozen", "0", "-", "1.50"]
    assert _row(text, "eagle3:tts-s1") == ["eagle3:tts-s1", "1024", "3.0", "2.00"]


def test_the_hybrids_proposers_are_tabled_per_dataset_with_retirements():
    assert proposer_table(aggregate(full_records(), full_configs(), bucket=20)) is None  # no hybrid ran
    configs = build_configs(["ngram", "tts+hybrid"], ["eagle3"], {"eagle3": "/d"})
    hybrid = dict(tts_suffix_rounds=6, tts_suffix_accepted=3, tts_drafter_rounds=4, tts_drafter_accepted=1)
    records = [
        record("ngram", "d", [2] * 10, 1.0),
        record("eagle3:tts+hybrid", "d", [2] * 10, 1.0, tts_drafter_retired=1, prompt_id="d-0", **hybrid),
        record("eagle3:tts+hybrid", "d", [2] * 10, 1.0, tts_drafter_retired=0, prompt_id="d-1", **hybrid),
    ]
    records[1].tts_idle_updates, records[2].tts_idle_updates = 3, 0
    text = proposer_table(aggregate(records, configs, bucket=8))
    assert _row(text, "eagle3:tts+hybrid")[1:] == ["d", "12", "0.50", "8", "0.25", "1 of 2", "1.5"]
    assert "| eagle3:tts+hybrid | all | 12 | 0.50 | 8 | 0.25 | 1 of 2 | 1.5 |" in text  # and pooled
    assert "| ngram |" not in text  # only hybrid configurations report proposers


def test_prefill_is_tabled_when_the_radix_cache_served_part_of_a_prompt():
    configs = build_configs(["frozen+hybrid", "tts+hybrid"], ["eagle3"], {"eagle3": "/d"})
    uncached = [record(c.name, "d", [2] * 10, 1.0, prompt_tokens=100, cached_tokens=0) for c in configs]
    assert prefill_table(aggregate(uncached, configs, bucket=8)) is None  # every configuration prefilled it all
    wave = [
        record("eagle3:frozen+hybrid", "d", [2] * 10, 1.0, prompt_tokens=100, cached_tokens=90, prompt_id="d-0"),
        record("eagle3:frozen+hybrid", "d", [2] * 10, 1.0, prompt_tokens=100, cached_tokens=0, prompt_id="d-1"),
        record("eagle3:tts+hybrid", "d", [2] * 10, 1.0, prompt_tokens=100, cached_tokens=0, prompt_id="d-0"),
        record("eagle3:tts+hybrid", "d", [2] * 10, 1.0, prompt_tokens=100, cached_tokens=0, prompt_id="d-1"),
    ]
    text = prefill_table(aggregate(wave, configs, bucket=8))
    assert _row(text, "eagle3:frozen+hybrid")[1:] == ["d", "200", "90", "110"]
    assert _row(text, "eagle3:tts+hybrid")[1:] == ["d", "200", "0", "200"]


def test_write_plots_writes_every_plot_as_png(tmp_path):
    agg = aggregate(full_records(), full_configs(), bucket=20)
    written = write_plots(agg, tmp_path, "greedy")
    assert [p.split("/")[-1] for p in written] == [f"{stem}_greedy.png" for stem in PLOTS]
    for path in written:
        data = open(path, "rb").read()
        assert data.startswith(PNG) and len(data) > 5000


def test_plots_without_data_are_skipped(tmp_path):
    agg = aggregate([record("no-spec", "d", None, 2.0, completion_tokens=10)], full_configs(("no-spec",)), 8)
    assert [p.split("/")[-1] for p in write_plots(agg, tmp_path, "t0.7")] == ["throughput_t0.7.png"]


def test_write_json_replaces_nan_with_null(tmp_path):
    path = write_json(tmp_path / "x.json", {"a": math.nan, "b": [1.0, math.inf], "c": {"d": 2}})
    assert json.loads(path.read_text()) == {"a": None, "b": [1.0, None], "c": {"d": 2}}


def _payload(records, configs, bucket=20):
    return {
        "run": "unit",
        "command": "bench_long.py --unit",
        "machine": {"cpu_count": 2, "platform": "test", "load_average": [0.5, 0.5, 0.5]},
        "settings": {"temperatures": "0, 0.7", "bucket": bucket},
        "configs": [c.to_json() for c in configs],
        "schedule": [vars(SlotLog(0, c.name, ["p"], server_start_s=30.0)) for c in configs],
        "requests": [r.to_json() for r in records],
        "aggregates": None,
    }


def test_finish_writes_results_report_and_plots_per_sampling_mode(tmp_path):
    greedy = full_records()
    hot = [record(r.config, r.dataset, r.accept_lengths, r.wall_s, sampling="t0.7") for r in greedy]
    result = finish(tmp_path, _payload([*greedy, *hot], full_configs()))
    assert result.failures == []
    data = json.loads((tmp_path / RESULTS).read_text())
    assert set(data["aggregates"]) == {"greedy", "t0.7"}
    summaries = {(s["config"], s["dataset"]): s for s in data["aggregates"]["greedy"]["summaries"]}
    assert summaries[("eagle3:frozen", "all")]["accept_mean"] == pytest.approx(1.2)
    assert len(result.plots) == 2 * len(PLOTS)
    report = (tmp_path / REPORT).read_text()
    assert "## Sampling: greedy decoding" in report and "## Sampling: temperature 0.7" in report
    assert "![acceptance_by_position_greedy](acceptance_by_position_greedy.png)" in report
    assert "11 server starts (30 s each on average)" in report
    assert "Greedy decoding: all configurations produced identical outputs on 2 of 2 prompts." in report
    assert "Repetition: no output's last quarter fell below 50% distinct word 4-grams (no loops)." in report


def test_repetition_sentence_names_the_looping_outputs_per_prompt():
    sentence = repetition_sentence(
        [
            {"config": "eagle3:frozen", "prompt_id": "p1", "round": 0, "last_quarter": 0.12},
            {"config": "eagle3:tts-s2", "prompt_id": "p1", "round": 0, "last_quarter": 0.1},
            {"config": "eagle3:tts-s2", "prompt_id": "p0", "round": 0, "last_quarter": 0.4},
        ]
    )
    assert sentence.endswith("loop: p0 (eagle3:tts-s2 0.40); p1 (eagle3:frozen 0.12, eagle3:tts-s2 0.10).")


def test_rerender_recomputes_with_another_bucket_and_reports_failures(tmp_path):
    payload = _payload(full_records(), full_configs(("frozen", "tts-s1")))
    payload["schedule"][1]["error"] = "ServerStartError: boom\nlog tail"
    finish(tmp_path, payload)
    result = rerender(tmp_path / RESULTS, bucket=50)
    assert result.failures == [f"{payload['schedule'][1]['config']} (round 0)"]
    data = json.loads((tmp_path / RESULTS).read_text())
    frozen = next(s for s in data["aggregates"]["greedy"]["summaries"] if s["config"] == "eagle3:frozen")
    assert [b["start"] for b in frozen["buckets"]] == [0, 50]
    assert "## Failures" in (tmp_path / REPORT).read_text()


def test_aggregate_by_sampling_of_no_records_renders(tmp_path):
    assert aggregate_by_sampling([], full_configs(("frozen",)), 8) == {}
    result = finish(tmp_path, _payload([], full_configs(("frozen",))))
    assert "_No request completed._" in result.report.read_text()
    assert result.plots == []


def test_concurrency_tables_put_each_configuration_side_by_side_per_concurrency():
    greedy = full_records()
    batched = []
    for r in greedy:
        lengths = r.accept_lengths if "tts" not in r.config else [1] * 30 + [2] * 10  # TTS gains less at c=4
        batched.append(record(r.config, r.dataset, lengths, r.wall_s * 2, sampling="greedy-c4", concurrency=4))
        batched[-1].wave_wall_s = r.wall_s * 2
    by = aggregate_by_sampling([*greedy, *batched], full_configs(), bucket=20)
    text = concurrency_tables(by)
    assert "c=1 accept (gain)" in text and "c=4 tok/s (x frozen)" in text
    row = _row(text, "eagle3:tts-s5")
    frozen_1 = by["greedy"].summary("eagle3:frozen").accept_mean
    tts_1 = by["greedy"].summary("eagle3:tts-s5").accept_mean
    tts_4 = by["greedy-c4"].summary("eagle3:tts-s5").accept_mean
    assert row[1] == f"{tts_1:.2f} ({tts_1 - frozen_1:+.2f})"
    assert row[2] == f"{tts_4:.2f} ({tts_4 - frozen_1:+.2f})"  # frozen's acceptance is the same at c=4
    assert tts_4 - frozen_1 < tts_1 - frozen_1
    assert _row(text, "eagle3:frozen")[1] == f"{frozen_1:.2f}"
    assert "no-spec" not in text  # only drafters with a frozen baseline
    assert concurrency_tables({"greedy": by["greedy"]}) == ""


def test_reference_tables_give_every_configuration_as_a_ratio_to_the_reference(tmp_path):
    greedy = full_records()
    batched = [record(r.config, r.dataset, r.accept_lengths, r.wall_s * 2, sampling="greedy-c4", concurrency=4)
               for r in greedy if r.config != "eagle3:tts-s5"]  # fmt: skip
    for r in batched:
        r.wave_wall_s = r.wall_s
    by = aggregate_by_sampling([*greedy, *batched], full_configs(), bucket=20)
    text = reference_tables(by, "eagle3:tts-s5")
    assert "c=1 tok/s (x ref)" in text and "c=4 accept" in text
    ref_1 = by["greedy"].summary("eagle3:tts-s5").tokens_per_s
    frozen_1 = by["greedy"].summary("eagle3:frozen").tokens_per_s
    frozen_4 = by["greedy-c4"].summary("eagle3:frozen")
    row = _row(text, "eagle3:frozen")
    assert row[1] == f"{frozen_1:.1f} ({frozen_1 / ref_1:.2f}x)"
    assert row[2] == f"{frozen_4.tokens_per_s:.1f}"  # no reference ran at c=4: no ratio there
    assert row[4] == f"{frozen_4.accept_mean:.2f}"
    assert _row(text, "eagle3:tts-s5 (reference)")[1:3] == [f"{ref_1:.1f} (1.00x)", "-"]
    assert _row(text, "no-spec")[1].endswith("x)")  # every configuration, not only drafters
    assert "did not run" in reference_tables(by, "eagle3:tts-s99")
    # report.md shows it when the settings name a reference
    payload = _payload(full_records(), full_configs())
    payload["settings"]["reference"] = "eagle3:tts-s1"
    report = finish(tmp_path, payload).report.read_text()
    assert "## Against the reference `eagle3:tts-s1`" in report
    assert "| eagle3:tts-s1 (reference) |" in report
