"""TTSRuntime without a server: per-request state stays bounded under rolling traffic, and the
Prometheus counters see every reset, skipped update and failed publish."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import replace

import pytest
import torch
from prometheus_client import CollectorRegistry
from sglang_testing import core

from sglang_tts.config import TTSConfig, TTSConfigError
from sglang_tts.core.canvas import TeacherVocab
from sglang_tts.sglang.metrics import SchedulerMetrics
from sglang_tts.sglang.runtime import FAULT_ENV, TTSRuntime


def _runtime(monkeypatch, faults: str = "", **config) -> tuple[TTSRuntime, CollectorRegistry]:
    monkeypatch.setenv(FAULT_ENV, faults)
    settings = {"update_stride": 1, "stride_pinned": True, "lr": 1e-3, "reg_lambda": 0.0, "log_interval": 0}
    settings = {**settings, "sync": True, **config}
    runtime = TTSRuntime(core.TinyDrafter(), TTSConfig(**settings), None, "cpu")
    registry = CollectorRegistry()
    runtime.metrics = SchedulerMetrics(registry)
    return runtime, registry


def _round(runtime: TTSRuntime, generator: torch.Generator, live: list[str], drafted: int | None = None) -> bool:
    """One round of `live`. With `drafted` (--tts-hybrid: the requests the drafter drafted), the worker
    builds a canvas only when an update is due, as the EAGLE worker does. Returns whether it built one."""
    runtime.before_draft(live)
    due = True
    if drafted is not None:
        runtime.note_drafted(list(live), drafted)
        due = runtime.update_due()
    canvas = None
    if due:
        canvas = core.random_canvas(generator, batch=len(live))
        canvas.request_ids = list(live)
    for rid in live:
        runtime.remember_anchor(rid, torch.zeros(4))
    runtime.count_round(dict.fromkeys(live, 2))
    runtime.observe(canvas)
    return due


def test_rolling_traffic_resets_the_batch_drafter_and_counts_every_reset(monkeypatch):
    # One request joins and one leaves every round: the batch is never empty.
    runtime, registry = _runtime(monkeypatch, update_stride=25)
    generator = torch.Generator().manual_seed(0)
    lifetime = 4
    live = deque(f"r{i}" for i in range(lifetime))
    for round_index in range(2_000):
        _round(runtime, generator, list(live))
        assert runtime.num_tracked() <= 2 * lifetime
        live.popleft()
        live.append(f"r{round_index + lifetime}")
    stats = runtime.distiller.stats
    assert stats.num_resets == 2_000 // lifetime - 1  # once per generation (core/scope.py)
    assert registry.get_sample_value("sglang_tts:resets_total") == stats.num_resets
    assert registry.get_sample_value("sglang_tts:tracked_requests") <= 2 * lifetime


class _Req:
    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.done = False

    def finished(self) -> bool:
        return self.done


def test_prefill_only_and_aborted_requests_leave_no_state(monkeypatch):
    runtime, _ = _runtime(monkeypatch)
    sizes = []
    for batch_index in range(500):  # 2,000 requests, 4 per prefill batch, never a decode round
        reqs = [_Req(f"b{batch_index}-{i}") for i in range(4)]
        runtime.begin_prefill(reqs)
        for req in reqs:
            runtime.remember_anchor(req.rid, torch.zeros(4))
            runtime.counters(req.rid)  # e.g. a failure charged to the request at prefill
        reqs[0].done = reqs[1].done = True  # max_new_tokens=1: finished at prefill
        del reqs, req  # the others were aborted: SGLang dropped its Req objects (refcounting frees them)
        sizes.append((len(runtime.anchor_features), len(runtime.requests), len(runtime._prefilled)))
    assert sizes[-1] == sizes[199] and max(max(s) for s in sizes) <= 4


@pytest.mark.parametrize("scope", ["batch", "global"])
def test_skipped_updates_and_failed_publishes_reach_prometheus(monkeypatch, scope):
    runtime, registry = _runtime(monkeypatch, faults="nan@1,inf_grad@2,nan_weights@3,raise@4", scope=scope)
    generator = torch.Generator().manual_seed(0)
    publish = runtime.distiller._write_serving
    calls = [0]

    def failing_every_third(tensors):
        calls[0] += 1
        if calls[0] % 3 == 0:
            raise RuntimeError("injected publish fault")
        publish(tensors)

    runtime.distiller._write_serving = failing_every_third
    for _ in range(8):
        _round(runtime, generator, ["a", "b"])
    runtime.before_draft(["a", "b"])
    stats = runtime.distiller.stats
    assert stats.num_skipped_updates == 4 and stats.num_failed_publishes >= 1
    assert registry.get_sample_value("sglang_tts:skipped_updates_total") == 4
    assert registry.get_sample_value("sglang_tts:updates_total") == stats.num_updates == 4
    assert registry.get_sample_value("sglang_tts:failed_publishes_total") == stats.num_failed_publishes
    assert runtime.counters("a").num_skipped_updates == 4


# --- prompt-time adaptation ---------------------------------------------------------------------


def _prompt(runtime: TTSRuntime, req, n: int, start: int = 0, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, core.VOCAB, (n + 1,), generator=gen)
    runtime.remember_prompt(req, ids, torch.randn(n, core.FEATURES, generator=gen), start)


def test_a_prompt_window_waits_for_its_first_decode_round_then_trains(monkeypatch):
    runtime, registry = _runtime(
        monkeypatch, prompt_adapt="only", prompt_positions=16, prompt_steps=3, prompt_min_positions=1
    )
    a, b = _Req("a"), _Req("b")
    runtime.begin_prefill([a, b])
    _prompt(runtime, a, 40)  # cut to the last 16 positions
    _prompt(runtime, b, 10, seed=1)
    assert runtime.prompt_windows["a"][0].num_positions == 16
    runtime.before_draft(["a", "b"])
    runtime.start_prompt_updates([a, b])  # sync: trained at once, published at the next barrier
    assert not runtime.prompt_windows
    runtime.before_draft(["a", "b"])
    stats = runtime.distiller.stats
    assert stats.num_prompt_updates == 1 and stats.prompt_positions_total == 26 and stats.weight_version == 1
    assert runtime.counters("a").prompt_positions == 16 and runtime.counters("b").prompt_positions == 10
    assert runtime.counters("a").prompt_steps == 3 and runtime.counters("a").prompt_ms > 0
    assert registry.get_sample_value("sglang_tts:prompt_updates_total") == 1
    assert registry.get_sample_value("sglang_tts:prompt_positions_total") == 26
    assert registry.get_sample_value("sglang_tts:last_prompt_loss", {"step": "last"}) < registry.get_sample_value(
        "sglang_tts:last_prompt_loss", {"step": "first"}
    )


def test_a_chunked_prompt_keeps_its_window_across_decode_rounds_of_others(monkeypatch):
    runtime, _ = _runtime(monkeypatch, prompt_adapt="on", prompt_positions=64, prompt_min_positions=1)
    long, other = _Req("long"), _Req("other")
    runtime.begin_prefill([long])
    _prompt(runtime, long, 20, start=0)  # first chunk
    runtime.before_draft(["other"])  # a decode round of another request between the chunks
    runtime.start_prompt_updates([other])
    assert "long" in runtime.prompt_windows
    runtime.begin_prefill([long])
    _prompt(runtime, long, 12, start=20, seed=2)  # the chunk that ends the prompt
    assert runtime.prompt_windows["long"][0].num_positions == 32
    runtime.before_draft(["other", "long"])
    runtime.start_prompt_updates([other, long])
    runtime.before_draft(["other", "long"])  # the next barrier collects it
    assert runtime.distiller.stats.num_prompt_updates == 1
    assert runtime.counters("long").prompt_positions == 32 and runtime.counters("other").prompt_positions == 0


def test_prompt_windows_of_requests_that_never_decode_are_dropped(monkeypatch):
    runtime, _ = _runtime(monkeypatch, prompt_adapt="on", prompt_positions=8, prompt_min_positions=1)
    for batch_index in range(300):
        reqs = [_Req(f"b{batch_index}-{i}") for i in range(3)]
        runtime.begin_prefill(reqs)
        for req in reqs:
            _prompt(runtime, req, 8)
        reqs[0].done = True  # finished at prefill
        del reqs, req  # the others were aborted: SGLang dropped them
        runtime.before_draft([])
        assert len(runtime.prompt_windows) == 0
    assert runtime.distiller.stats.num_prompt_updates == 0


def test_prompts_shorter_than_the_minimum_are_not_learned(monkeypatch):
    runtime, _ = _runtime(monkeypatch, prompt_adapt="on", prompt_min_positions=12)
    short, long = _Req("short"), _Req("long")
    runtime.begin_prefill([short, long])
    _prompt(runtime, short, 11)
    _prompt(runtime, long, 12, seed=1)
    runtime.before_draft(["short", "long"])
    runtime.start_prompt_updates([short, long])
    runtime.before_draft(["short", "long"])
    assert not runtime.prompt_windows  # both consumed: the short one dropped, not kept
    assert runtime.distiller.stats.prompt_positions_total == 12
    assert runtime.counters("short").prompt_positions == 0 and runtime.counters("long").prompt_positions == 12


def test_a_prompt_update_collected_by_the_canvas_capture_is_credited(monkeypatch):
    """A request that joins at an update round: its prompt update is still running when that round's
    canvas asks for the buffers (which collects it first); its counters must see it."""
    runtime, _ = _runtime(monkeypatch, prompt_adapt="on", prompt_min_positions=1)
    req = _Req("late")
    runtime.begin_prefill([req])
    _prompt(runtime, req, 9)
    runtime.before_draft(["late"])
    runtime.start_prompt_updates([req])
    runtime.capture_buffers()
    assert runtime.distiller.stats.num_prompt_updates == 1
    assert runtime.counters("late").prompt_positions == 9 and runtime.counters("late").prompt_steps == 4


class _Clock:
    """A perf_counter the test advances: rounds take what the test says they take."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


def _slow_updates(runtime: TTSRuntime, clock: _Clock, seconds: float) -> None:
    """Each update costs the serving thread `seconds` of (fake) time: it runs inline (--tts-sync)."""
    train = runtime.distiller._train

    def slow(canvas, fault):
        clock.now += seconds
        return train(canvas, fault)

    runtime.distiller._train = slow


def test_the_update_budget_lengthens_the_stride_until_updates_fit(monkeypatch):
    """Unpinned (no --tts-update-stride), the stride follows the measured cost: updates of 30 ms
    beside rounds of 40 ms fit a 10% budget only at S >= 7 (30 / (30 + 40 S) <= 0.1)."""
    clock = _Clock()
    monkeypatch.setattr("sglang_tts.sglang.runtime.time", clock)
    monkeypatch.setattr("sglang_tts.core.executor.time", clock)  # the update's own run time too (not the machine's)
    runtime, registry = _runtime(monkeypatch, update_budget=0.1, update_stride=1, stride_pinned=False, guard=False)
    _slow_updates(runtime, clock, 0.030)
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        _round(runtime, generator, ["a"])
        clock.now += 0.040
    assert runtime.config.update_stride >= 7
    assert runtime.governor.budget_stride() == 7
    assert runtime.governor.measured_share < 0.15
    assert runtime.counters("a").update_stride == runtime.config.update_stride
    assert registry.get_sample_value("sglang_tts:update_stride") >= 7
    assert registry.get_sample_value("sglang_tts:update_cost_seconds") == pytest.approx(0.030, rel=0.05)


def test_the_budget_scale_reaches_the_governor_and_the_start_up_line(monkeypatch):
    runtime, _ = _runtime(monkeypatch, update_budget=None, stride_pinned=False)
    assert runtime.governor.budget == pytest.approx(0.05)  # the default 0.5: half the warm-up's 10%
    assert "update budget auto x0.5" in runtime.describe()
    runtime, _ = _runtime(monkeypatch, update_budget=None, update_budget_scale=1.0, stride_pinned=False)
    assert runtime.governor.budget == pytest.approx(0.1)
    assert runtime.governor.held_rounds is None  # the latest round only: no window to cap the stride
    runtime, _ = _runtime(monkeypatch, update_budget=None, stride_pinned=False, update_window=64, window_rows=32)
    assert (runtime.governor.window, runtime.governor.window_rows, runtime.governor.held_rounds) == (64, 32, 32)


def test_a_pinned_stride_stays_and_the_share_is_still_reported(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr("sglang_tts.sglang.runtime.time", clock)
    monkeypatch.setattr("sglang_tts.core.executor.time", clock)  # the update's own run time too (not the machine's)
    runtime, registry = _runtime(monkeypatch, update_budget=0.1, update_stride=3, stride_pinned=True, guard=False)
    _slow_updates(runtime, clock, 0.030)
    generator = torch.Generator().manual_seed(0)
    for _ in range(60):
        _round(runtime, generator, ["a"])
        clock.now += 0.040
    assert runtime.config.update_stride == 3 and runtime.distiller.stats.num_updates == 19  # the 20th: next barrier
    # Far above the budget, and reported: 30 ms of every 3 x 40 + 30 ms.
    assert runtime.counters("a").update_share == pytest.approx(30 / 150, rel=0.1)
    assert registry.get_sample_value("sglang_tts:update_share") == pytest.approx(30 / 150, rel=0.1)


def test_guard_resets_reach_the_requests_and_prometheus(monkeypatch):
    from sglang_tts.core.guard import SCOPE_UNIT

    runtime, registry = _runtime(monkeypatch, update_stride=1)
    generator = torch.Generator().manual_seed(0)
    _round(runtime, generator, ["a", "b"])
    runtime.distiller._guard_resets.add(SCOPE_UNIT)  # as a guard verdict leaves it for the barrier
    _round(runtime, generator, ["a", "b"])
    assert runtime.distiller.stats.num_guard_resets == 1
    assert runtime.counters("a").guard_resets == runtime.counters("b").guard_resets == 1
    assert registry.get_sample_value("sglang_tts:guard_resets_total") == 1


class _Chooser:
    def counts(self, rid: str) -> tuple[dict[str, int], dict[str, int]]:
        return {"suffix": 1, "drafter": 0}, {"suffix": 3, "drafter": 0}

    def retired(self, rid: str) -> bool:
        return False


class _Hybrid:
    """Who drafted each request's round (the suffix proposer or the drafter)."""

    def __init__(self, who: dict[str, str]) -> None:
        self.who, self.chooser = who, _Chooser()
        self.last_costs = {"suffix": 0.058, "drafter": None}  # no drafter round measured at this shape yet
        self.retirements = self.skipped_extends = 0

    def accepted(self, rid: str, num_accepted: int) -> str:
        return self.who[rid]


def test_with_the_hybrid_the_budget_reads_the_drafters_rounds(monkeypatch):
    runtime, registry = _runtime(monkeypatch)
    runtime.hybrid = _Hybrid({"a": "suffix", "b": "suffix", "c": "suffix", "d": "drafter"})
    lengths = {"a": 4, "b": 4, "c": 4, "d": 2}  # the suffix copied whole chains, the drafter one token
    runtime.count_round(lengths)  # with the hybrid: not the whole round's tokens per round
    runtime._count_proposers([_Req(rid) for rid in lengths], list(lengths.values()))
    governor = runtime.governor
    assert governor.drafter_share == pytest.approx(0.25)
    governor.observe_gain(0.4)
    # tau = 2 (the drafter's round alone, not the copies' 4): 0.4 x (2 - 1) / 2 x a quarter of the rounds
    assert governor.round_gain == pytest.approx(0.4 * 0.5 * 0.25)
    assert registry.get_sample_value("sglang_tts:proposer_rounds_total", {"proposer": "suffix"}) == 3
    assert registry.get_sample_value("sglang_tts:hybrid_round_seconds", {"kind": "suffix"}) == 0.058
    assert registry.get_sample_value("sglang_tts:hybrid_round_seconds", {"kind": "drafter"}) is None


@pytest.mark.parametrize("idle", ["skip", "run"])
def test_with_the_hybrid_a_stride_the_drafter_sat_out_trains_nothing(monkeypatch, caplog, idle):
    """Stride 3: the first stride's rounds all go to the suffix proposer, the second has one drafter round,
    the third none again. `skip` runs the second stride's update only; `run` all three."""
    runtime, registry = _runtime(monkeypatch, update_stride=3, hybrid=True, hybrid_idle_updates=idle)
    runtime.hybrid = _Hybrid({})
    caplog.set_level(logging.INFO, logger="sglang_tts.sglang.runtime")
    generator = torch.Generator().manual_seed(0)
    live = ["a", "b"]
    drafted = [0, 0, 0, 0, 1, 0, 0, 0, 0]
    due = [_round(runtime, generator, live, n) for n in drafted]
    runtime.before_draft(live)  # the barrier collects the last round's update
    updates = runtime.distiller.stats.num_updates
    if idle == "skip":
        assert due == [False, False, False, False, False, True, False, False, False]
        assert updates == 1 and runtime.idle_updates == 2
        assert registry.get_sample_value("sglang_tts:hybrid_idle_updates_total") == 2
        assert runtime.counters("a").idle_updates == runtime.counters("b").idle_updates == 2
        assert runtime.counters("a").num_updates == 1
        assert sum("an update was skipped" in r.getMessage() for r in caplog.records) == 1  # logged once
    else:
        assert due == [False, False, True] * 3
        assert updates == 3 and runtime.idle_updates == 0
        assert registry.get_sample_value("sglang_tts:hybrid_idle_updates_total") == 0
    assert runtime.distiller.stats.rounds == len(drafted)  # every round counts either way


def test_without_the_hybrid_no_stride_is_idle(monkeypatch):
    runtime, _ = _runtime(monkeypatch, update_stride=2)
    generator = torch.Generator().manual_seed(0)
    assert [_round(runtime, generator, ["a"], 0) for _ in range(4)] == [False, True, False, True]
    runtime.before_draft(["a"])
    assert runtime.distiller.stats.num_updates == 2 and runtime.idle_updates == 0


def _check_round(runtime: TTSRuntime, generator: torch.Generator, live: list[str]) -> None:
    runtime.before_draft(live)
    check = core.random_canvas(generator, batch=len(live))
    check.request_ids = list(live)
    runtime.observe(None, check)


def _checked_and_skipped(runtime: TTSRuntime, rid: str) -> tuple[int, int]:
    c = runtime.counters(rid)
    return c.fallback_checked, c.fallback_skipped


def test_check_mode_skips_a_first_round_drafted_before_a_publish(monkeypatch):
    # a prefilled (its first draft token drafted) with the weights of version 0; new weights were
    # published before b's prefill: at the round both first run, only b was drafted with the weights
    # the check re-predicts with.
    runtime, _ = _runtime(monkeypatch, update_stride=1000, scope="global")
    runtime.check_fallback = True
    generator = torch.Generator().manual_seed(0)
    drafted = core.LENGTH - 1  # tokens per row the check re-predicts (every canvas position valid)
    runtime.bind_extend_batch([_Req("a")])
    version = runtime.distiller.weight_version
    runtime.distiller.reset()  # publishes (the base weights again, as a new version)
    assert runtime.distiller.weight_version == version + 1
    runtime.bind_extend_batch([_Req("b")])
    _check_round(runtime, generator, ["a", "b"])
    assert _checked_and_skipped(runtime, "a") == (0, drafted)
    assert _checked_and_skipped(runtime, "b") == (drafted, 0)
    _check_round(runtime, generator, ["a", "b"])  # both drafted after the publish now
    assert _checked_and_skipped(runtime, "a") == (drafted, drafted)
    assert _checked_and_skipped(runtime, "b") == (2 * drafted, 0)


def test_check_mode_skips_the_round_whose_context_the_radix_cache_rebound(monkeypatch):
    runtime, _ = _runtime(monkeypatch, update_stride=1000, scope="global")
    runtime.check_fallback = True
    generator = torch.Generator().manual_seed(0)
    drafted = core.LENGTH - 1
    runtime.bind_extend_batch([_Req("a"), _Req("b")])
    for rid in ("a", "b"):
        runtime.remember_prefill_locs(rid, torch.arange(6))
    assert torch.equal(runtime.prefill_locs("a"), torch.arange(6))
    assert runtime.prefill_locs("a") is None  # handed over once
    runtime.context_rebound("a")  # the worker found a's locations changed
    _check_round(runtime, generator, ["a", "b"])
    assert _checked_and_skipped(runtime, "a") == (0, drafted)
    assert _checked_and_skipped(runtime, "b") == (drafted, 0)
    _check_round(runtime, generator, ["a", "b"])  # later rounds read a's context as its drafts did
    assert _checked_and_skipped(runtime, "a") == (drafted, drafted)
    _check_round(runtime, generator, ["a"])  # b left: everything it held goes with it
    assert "b" not in runtime._prefill_locs and "b" not in runtime._drafted_version
    assert runtime.num_tracked() == 2  # a's counters and the version its next first token is drafted with


def test_capture_keeps_the_drafters_vocabulary_unless_told_to_keep_all(monkeypatch):
    """The runtime asks the drafter once for the ids its loss reads (EAGLE-3: the draft vocabulary);
    `--tts-canvas-vocab full` keeps every id, and a drafter without the method keeps every id."""
    ids = torch.tensor([0, 3, 5])
    covered = torch.zeros(core.VOCAB, dtype=torch.bool)
    covered[ids] = True
    asked = []

    class Reduced(core.TinyDrafter):
        def teacher_vocab(self, device):
            asked.append(torch.device(device))
            return TeacherVocab(ids=ids.to(device), covered=covered.to(device))

    config = TTSConfig(update_stride=1, lr=1e-3, reg_lambda=0.0, log_interval=0, sync=True)
    runtime = TTSRuntime(Reduced(), config, None, "cpu")
    assert torch.equal(runtime.teacher_vocab.ids, ids) and asked == [torch.device("cpu")]
    assert TTSRuntime(Reduced(), replace(config, canvas_vocab="full"), None, "cpu").teacher_vocab is None
    assert TTSRuntime(core.TinyDrafter(), config, None, "cpu").teacher_vocab is None
    with pytest.raises(TTSConfigError, match="--tts-canvas-vocab"):
        replace(config, canvas_vocab="half").validate()
