"""The do-no-harm guard: paired scores, its reset rule, and the Distiller resetting a drafter that
learns to draft worse than base (and keeping one that learns to draft better)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from core_testing import TinyDrafter, TinyTeacher, agreement

from sglang_tts.config import TTSConfig, TTSConfigError
from sglang_tts.core.distiller import Distiller
from sglang_tts.core.executor import SyncExecutor
from sglang_tts.core.guard import SCOPE_UNIT, DoNoHarmGuard, greedy_scores


def _config(**overrides: Any) -> TTSConfig:
    base = {"update_stride": 1, "lr": 1e-3, "reg_lambda": 0.0, "log_interval": 0, "guard_window": 8}
    return TTSConfig(**{**base, **overrides})


def test_greedy_scores_count_leading_top_token_matches():
    teacher = torch.tensor([[[0.9, 0.1], [0.8, 0.2], [0.3, 0.7]]])  # one row, three positions
    agrees = torch.tensor([[[2.0, 1.0], [5.0, -5.0], [0.0, 0.1]]])  # top token right everywhere
    wrong_first = torch.tensor([[[-9.0, 9.0], [9.0, -9.0], [-9.0, 9.0]]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert greedy_scores(agrees, teacher, mask).item() == 3.0
    assert greedy_scores(wrong_first, teacher, mask).item() == 0.0  # a miss ends the chain
    assert greedy_scores(agrees, teacher, torch.tensor([[True, False, True]])).item() == 1.0
    # Sharper or softer logits with the same top token score the same.
    assert greedy_scores(10 * agrees, teacher, mask).item() == greedy_scores(agrees / 10, teacher, mask).item()


def test_guard_resets_only_a_clear_and_full_window_of_losses():
    guard = DoNoHarmGuard(window=8, margin=0.02)
    for _ in range(7):  # clearly worse, but the window is not full yet
        assert guard.observe([SCOPE_UNIT], [1.0], [1.5]).reset_units == []
    assert guard.observe([SCOPE_UNIT], [1.0], [1.5]).reset_units == [SCOPE_UNIT]
    assert guard.num_resets == 1 and guard.num_units == 0  # the window starts afresh
    # Noise around equality (as often better as worse) never resets.
    noisy = DoNoHarmGuard(window=8, margin=0.02)
    for i in range(200):
        delta = 0.4 if i % 2 else -0.4
        assert noisy.observe([3], [1.5 + delta], [1.5]).reset_units == []
    assert noisy.num_resets == 0
    assert noisy.gain() == pytest.approx(0.0, abs=0.02)


def test_guard_units_are_separate_and_bounded():
    guard = DoNoHarmGuard(window=4, margin=0.0, max_units=2)
    for _ in range(4):
        verdict = guard.observe([0, 1, 1, 2], [1.0, 2.0, 2.0, 1.0], [2.0, 1.0, 1.0, 2.0])
    assert verdict.reset_units == [0]  # unit 1 gains (two rows summed), unit 2 is beyond max_units
    assert guard.num_units == 1 and guard.gain() == pytest.approx(17 / 9 - 1)  # unit 1: (16 + 1) / (8 + 1) - 1
    guard.forget(1)
    assert guard.gain() is None


def _run(distiller: Distiller, teacher: TinyTeacher, generator: torch.Generator, updates: int) -> None:
    for _ in range(updates):
        distiller.barrier()
        distiller.observe(teacher.canvas(generator))
    distiller.barrier(force=True)


def test_a_drafter_learning_to_draft_worse_is_reset_to_base_and_counted(generator, caplog):
    """A drafter that starts as the teacher's own model (it drafts the target's top token everywhere)
    and a learning rate far too high (each Adam step moves every weight by 0.1): it drafts worse
    than base on the next canvases, and the guard resets it, bitwise to base, counted and logged
    once per reset."""
    drafter = TinyDrafter(seed=1234)  # the weights of TinyTeacher's model
    base = {n: p.detach().clone() for n, p in drafter.trainable_named_parameters()}
    teacher = TinyTeacher()
    distiller = Distiller(drafter, _config(lr=1e-1), executor=SyncExecutor())
    _run(distiller, teacher, generator, 30)
    stats = distiller.stats
    assert stats.num_guard_resets >= 1
    assert distiller.guard.num_resets == stats.num_guard_resets
    messages = [r.message for r in caplog.records if "do-no-harm guard" in r.message]
    assert len(messages) == stats.num_guard_resets
    # Right after a reset the serving drafter is the base drafter, bitwise.
    distiller.guard.window = 10**6  # no further resets
    distiller._guard_resets = {SCOPE_UNIT}
    assert distiller.barrier()
    assert all(torch.equal(p, base[n]) for n, p in drafter.trainable_named_parameters())
    assert distiller.last_guard_resets == [SCOPE_UNIT]


def test_a_drafter_learning_to_draft_better_is_kept_and_its_gain_measured(generator):
    drafter = TinyDrafter()
    teacher = TinyTeacher()
    distiller = Distiller(drafter, _config(lr=1e-2), executor=SyncExecutor())
    held_out = [teacher.canvas(torch.Generator().manual_seed(99)) for _ in range(4)]
    before = agreement(drafter, held_out)
    _run(distiller, teacher, generator, 60)
    assert distiller.stats.num_guard_resets == 0
    assert agreement(drafter, held_out) > before
    assert distiller.stats.guard_gain > 0.05 and math.isfinite(distiller.stats.guard_gain)


def test_guard_off_scores_nothing(generator):
    distiller = Distiller(TinyDrafter(), _config(guard=False), executor=SyncExecutor())
    _run(distiller, TinyTeacher(), generator, 3)
    assert distiller.guard is None and math.isnan(distiller.stats.guard_gain)
    assert distiller.stats.num_updates == 3


def test_reset_and_freed_slots_clear_the_guard(generator):
    distiller = Distiller(TinyDrafter(), _config(), executor=SyncExecutor())
    _run(distiller, TinyTeacher(), generator, 3)
    assert distiller.guard.num_units == 1
    distiller.reset()
    assert distiller.guard.num_units == 0 and distiller.guard.gain() is None


def test_guard_interval_scores_every_kth_update(generator):
    distiller = Distiller(TinyDrafter(), _config(guard_interval=3), executor=SyncExecutor())
    scored = []
    score = distiller._score
    distiller._score = lambda *args: (scored.append(1), score(*args))
    _run(distiller, TinyTeacher(), generator, 9)
    assert distiller.stats.num_updates == 9 and len(scored) == 3


def test_a_reset_unit_trains_at_a_backed_off_rate_until_its_life_ends(generator):
    """After a guard reset the shared drafter trains at lr x guard_backoff per reset; a new scope
    (reset()) gives it its learning rate back."""
    distiller = Distiller(TinyDrafter(seed=1234), _config(lr=1e-1, guard_backoff=0.1), executor=SyncExecutor())
    _run(distiller, TinyTeacher(), generator, 30)
    resets = distiller.stats.num_guard_resets
    assert resets >= 1
    [group] = distiller.optimizer.param_groups
    assert group["lr"] == pytest.approx(1e-1 * 0.1**resets)
    distiller.reset()
    assert group["lr"] == pytest.approx(1e-1)


def test_backoff_one_keeps_the_rate_and_the_config_refuses_nonsense():
    distiller = Distiller(TinyDrafter(), _config(guard_backoff=1.0), executor=SyncExecutor())
    distiller._guard_resets = {SCOPE_UNIT}
    distiller.barrier()
    assert distiller.stats.num_guard_resets == 1
    assert distiller.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(TTSConfigError, match="--tts-guard-backoff"):
            _config(guard_backoff=bad).validate()


def test_the_gain_bound_is_below_the_gain_by_its_uncertainty():
    guard = DoNoHarmGuard(window=64)
    assert guard.gain_bound() is None
    for a, b in [(1.0, 0.0), (0.0, 0.0)]:  # two scores: one match more than base, a gain of +100%...
        guard.observe([SCOPE_UNIT], [a], [b])
    assert guard.gain() == pytest.approx(1.0)
    assert guard.gain_bound() <= 0.0  # ...that two scores do not establish
    for i in range(60):  # a steady +1 match in 4 over 62 scores: the bound approaches the gain
        guard.observe([SCOPE_UNIT], [1.0 if i % 4 else 0.0], [1.0 if i % 2 else 0.0])
    assert 0.0 < guard.gain_bound() < guard.gain()
