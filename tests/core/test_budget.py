"""The update budget: the cost of updates measured from round times, and the stride that keeps it."""

from __future__ import annotations

import math

import pytest

from sglang_tts.core.budget import StrideGovernor


def _serve(gov: StrideGovernor, rounds: int, round_s: float, update_s: float, inline: bool = False) -> None:
    """Rounds at `gov.stride`: an async update slows the round it is submitted in and the next by
    update_s / 2 each (it shares the cores); an inline one blocks the submitting round for update_s."""
    for r in range(rounds):
        submits = r % gov.stride == 0
        in_flight = r % gov.stride == 1 % gov.stride and gov.stride > 1 and not inline
        extra = (update_s if inline else update_s / 2) if submits else 0.0
        extra += update_s / 2 if in_flight else 0.0
        gov.round_done(round_s + extra, batch_size=1, touched=submits or in_flight)
        if submits:
            gov.update_done(run_s=update_s, blocked_s=update_s if inline else 0.0)


def test_cost_is_measured_from_the_rounds_an_update_touches():
    gov = StrideGovernor(stride=4, budget=0.1)
    _serve(gov, 80, round_s=0.040, update_s=0.030)
    assert gov.base_round_s == pytest.approx(0.040, rel=1e-6)
    assert gov.cost_s == pytest.approx(0.030, rel=1e-2)
    assert gov.share == pytest.approx(0.030 / (0.030 + 4 * 0.040), rel=1e-2)


def test_the_stride_keeps_the_budget():
    gov = StrideGovernor(stride=1, budget=0.1, max_stride=32)
    _serve(gov, 10, round_s=0.040, update_s=0.030)  # S = 1: every round beside an update, no base
    assert math.isnan(gov.base_round_s) and gov.decide() == 2  # so the stride lengthens until there is one
    for _ in range(20):
        _serve(gov, 40, round_s=0.040, update_s=0.030)
        gov.decide()
    # share(S) = 30 / (30 + 40 S) <= 0.1  ->  S >= 6.75: the shortest is 7, and stable acceptance lets
    # it grow to at most twice that.
    assert gov.budget_stride() == 7
    assert 7 <= gov.stride <= 14
    gov.observe_tokens(2.0)
    for _ in range(30):
        gov.observe_tokens(1.4)  # acceptance falls: update as often as the budget allows
    assert gov.trend < 0 and gov.decide() == 7


def test_inline_updates_cost_their_whole_run():
    gov = StrideGovernor(stride=2, budget=0.25)
    _serve(gov, 20, round_s=0.040, update_s=0.020, inline=True)
    assert gov.cost_s == pytest.approx(0.020, rel=1e-3)
    assert gov.budget_stride() == 2  # 20 / (20 + 40 S) <= 0.25 -> S >= 1.5


def test_auto_budget_follows_the_measured_gain():
    gov = StrideGovernor(stride=5, budget=None, initial_budget=0.1, min_budget=0.02)
    assert gov.budget == 0.1  # no gain measured yet
    gov.observe_gain(-0.5, settled=False)
    assert gov.budget == 0.1  # the drafter's first updates: not yet its gain to show
    gov.observe_gain(0.25)
    assert gov.budget == pytest.approx(0.2)  # g / (1 + g): (1 + g)(1 - share) >= 1
    gov.observe_tokens(2.0)  # half of a round's tokens are drafts: +25% acceptance is +12.5% per round
    assert gov.round_gain == pytest.approx(0.125)
    assert gov.budget == pytest.approx(0.125 / 1.125)
    gov.observe_tokens(1.0)  # (the slow EMA moves a little)
    assert gov.budget < 0.125 / 1.125
    gov.observe_gain(0.25, bound=-0.05)  # what the budget spends is the gain's lower bound
    assert gov.gain == 0.25 and gov.budget == 0.02
    gov.observe_gain(-0.1)
    assert gov.budget == 0.02  # a drafter that does not gain updates rarely (the guard watches it)
    gov.observe_gain(None)
    assert gov.budget == 0.02


def test_with_the_hybrid_the_drafters_gain_pays_only_on_the_rounds_it_drafts():
    gov = StrideGovernor(stride=5, budget=None, initial_budget=0.1, min_budget=0.02)
    gov.observe_drafted(drafter_rounds=1, rounds=4)  # the suffix proposer drafted 3 of 4 requests' rounds
    assert gov.drafter_share == pytest.approx(0.25)
    assert gov.budget == pytest.approx(0.025)  # the warm-up's budget too
    gov.observe_drafted(0, 4)
    assert gov.drafter_share == pytest.approx(0.25 - 0.02 * 0.25)  # a slow EMA
    gov.observe_drafted(5, 4)
    gov.observe_drafted(0, 0)  # nothing to learn from
    assert gov.drafter_share == pytest.approx(0.245) and gov.state().drafter_share == gov.drafter_share
    gov.observe_gain(0.5)
    gov.observe_tokens(2.0)
    assert gov.round_gain == pytest.approx(0.5 * 0.5 * 0.245)
    assert gov.budget == pytest.approx(gov.round_gain / (1 + gov.round_gain))
    for _ in range(400):
        gov.observe_drafted(0, 4)  # the suffix drafts every round: the drafter's gain is worth nothing
    assert gov.budget == pytest.approx(0.02, abs=1e-3)
    plain = StrideGovernor(stride=5, budget=None)
    assert math.isnan(plain.drafter_share) and plain.budget == 0.1  # without the hybrid: as before


def test_a_scale_keeps_part_of_the_gain_as_speed():
    """--tts-update-budget-scale K: the auto budget, warm-up included, is K times what it would be;
    the floor stays, and a fixed budget is not scaled."""
    full = StrideGovernor(stride=5, budget=None, initial_budget=0.1, min_budget=0.02)
    half = StrideGovernor(stride=5, budget=None, initial_budget=0.1, min_budget=0.02, scale=0.5)
    assert half.budget == pytest.approx(0.05)  # the warm-up's 10%, halved
    for gov in (full, half):
        gov.observe_gain(0.25)
    assert half.budget == pytest.approx(full.budget / 2)
    assert half.budget == pytest.approx(0.1)
    for gov in (full, half):
        for _ in range(20):
            gov.round_done(0.040, batch_size=1, touched=False)
        gov.round_done(0.070, batch_size=1, touched=True)
        gov.update_done(run_s=0.030, blocked_s=0.0)
    assert full.cost_s == pytest.approx(half.cost_s)
    assert half.budget_stride() > full.budget_stride()  # half the share: fewer, longer strides
    half.observe_gain(0.03)
    assert half.budget == 0.02  # never below the floor
    assert StrideGovernor(stride=5, budget=0.1, scale=0.5).budget == 0.1
    for bad in (0.0, -0.5, 1.5, math.nan):
        with pytest.raises(ValueError, match="budget scale"):
            StrideGovernor(stride=5, scale=bad)


def _measured(gov: StrideGovernor, batch_size: int, round_s: float, update_s: float) -> StrideGovernor:
    """One untouched base at `batch_size` and one update that cost `update_s` of serving time."""
    for _ in range(20):
        gov.round_done(round_s, batch_size=batch_size, touched=False)
    gov.round_done(round_s + update_s, batch_size=batch_size, touched=True)
    gov.update_done(run_s=update_s, blocked_s=0.0)
    gov.observe_gain(0.25)  # auto budget 0.2 at K = 1, 0.1 at K = 0.5
    return gov


def test_the_stride_stops_at_the_rounds_the_window_holds():
    """A window of 64 rounds in 32 rows holds 8 rounds at a batch of 4: a longer stride would drop its
    earlier rounds, so K < 1 lengthens the stride only that far -- unless the whole gain (K = 1) cannot
    pay for updates that often."""

    def governor(batch_size: int, update_s: float, **window) -> StrideGovernor:
        gov = StrideGovernor(stride=5, budget=None, scale=0.5, min_budget=0.02, **window)
        return _measured(gov, batch_size, round_s=0.040, update_s=update_s)

    window = {"window": 64, "window_rows": 32}
    # 60 ms an update: K = 0.5 asks S >= 60 x 0.9 / (0.1 x 40) = 13.5, K = 1 only S >= 6.
    four = governor(4, 0.060, **window)
    assert four.held_rounds == 8 and four.budget_stride() == 14 and four.budget_stride(1.0) == 6
    for _ in range(5):
        assert four.decide() == 8
    assert governor(4, 0.060).decide() == 14  # the latest round only (window 1): no cap
    one = governor(1, 0.060, **window)
    assert one.held_rounds == 32 and one.decide() == 14  # one at a time the window holds the stride
    # 150 ms an update: even K = 1 needs S >= 15, so the stride does not come down to the window's 8.
    dear = governor(4, 0.150, **window)
    assert dear.budget_stride(1.0) == 15 and dear.decide() == 15
    wide = governor(64, 0.060, **window)
    assert wide.held_rounds == 1  # more rows than the window: the latest round only
    with pytest.raises(ValueError, match="window"):
        StrideGovernor(stride=5, window=0)


def test_untouched_rounds_set_the_base_per_batch_size_and_gaps_are_ignored():
    gov = StrideGovernor(stride=3, budget=0.1)
    for _ in range(10):
        gov.round_done(0.040, batch_size=1, touched=False)
        gov.round_done(0.100, batch_size=8, touched=False)
    assert gov.base_round_s == pytest.approx(0.100)
    gov.round_done(0.040, batch_size=1, touched=False)
    assert gov.base_round_s == pytest.approx(0.040)
    gov.round_done(30.0, batch_size=1, touched=False)  # the server sat idle in between
    assert gov.base_round_s == pytest.approx(0.040)
    gov.round_done(0.030, batch_size=1, touched=True)  # quicker with an update in flight: base too high
    assert gov.base_round_s < 0.040


def test_nothing_is_decided_before_anything_is_measured():
    gov = StrideGovernor(stride=5, budget=0.1, min_stride=2, max_stride=9)
    assert gov.decide() == 5 and gov.budget_stride() is None
    assert math.isnan(gov.state().share)
    with pytest.raises(ValueError):
        StrideGovernor(stride=5, budget=1.5)
    with pytest.raises(ValueError):
        StrideGovernor(stride=5, min_stride=4, max_stride=2)


def test_a_base_from_slow_first_rounds_does_not_hide_what_an_inline_update_costs():
    """The first round after a long prefill is slow (412 ms) and sets the base; the rounds after it take
    150 ms, and an inline update blocks its round for 100 ms more. Touched rounds (250 ms) then show no
    excess over that base, so the cost read ~0 and the stride 1, where every round is touched and the
    base recovers only slowly (a fresh long-context server: 23 updates in 50 rounds). An update costs
    at least the time the serving thread was blocked on it."""
    gov = StrideGovernor(stride=1, budget=0.04)
    gov.round_done(0.412, batch_size=1, touched=False)
    since, strides = 0, []
    for _ in range(200):
        since += 1
        submits = since >= gov.stride
        gov.round_done(0.150 + (0.100 if submits else 0.0), batch_size=1, touched=submits)
        if submits:
            since = 0
            gov.update_done(run_s=0.100, blocked_s=0.100)
            strides.append(gov.decide())
    assert gov.cost_s == pytest.approx(0.100)
    assert strides[0] >= 8  # not 1 or 2: the first update's cost is known at once
    assert gov.budget_stride() == 16  # 100 x 0.96 / (0.04 x 150)
    assert gov.num_updates <= 12  # 17 when the cost read ~0 at first
