"""Tests for sglang_tts.data.split: the hash-ranked held-out split and the balanced sample."""

from __future__ import annotations

import pytest

from sglang_tts.data.prompts import Prompt
from sglang_tts.data.split import balanced_sample, held_out_count, interleave, rank_key, split_prompts


def _prompts(dataset: str, n: int) -> list[Prompt]:
    return [Prompt(f"{dataset}-{i}", dataset, f"question {i} of {dataset}") for i in range(n)]


def test_held_out_count_rounds_and_keeps_both_sides() -> None:
    assert held_out_count(100, 0.25) == 25
    assert held_out_count(10, 0.25) == 2  # round(2.5) == 2 (banker's rounding), still a quarter
    assert held_out_count(2, 0.25) == 1 and held_out_count(2, 0.9) == 1
    assert held_out_count(1, 0.5) == 0 and held_out_count(0, 0.5) == 0
    with pytest.raises(ValueError, match="fraction"):
        held_out_count(10, 1.0)


def test_split_is_per_group_disjoint_and_complete() -> None:
    prompts = _prompts("a", 40) + _prompts("b", 8) + _prompts("c", 1)
    split = split_prompts(prompts, 0.25, seed=0)
    held_in, held_out = {p.id for p in split.held_in}, {p.id for p in split.held_out}
    assert not held_in & held_out
    assert held_in | held_out == {p.id for p in prompts}
    assert sum(p.dataset == "a" for p in split.held_out) == 10
    assert sum(p.dataset == "b" for p in split.held_out) == 2
    assert [p.dataset for p in split.held_in].count("c") == 1  # a group of one is never held out
    # Both sides keep the input order.
    assert list(split.held_in) == [p for p in prompts if p.id in held_in]
    # The held-out prompts of a group are those with the lowest hash ranks.
    ranks = sorted(_prompts("a", 40), key=lambda p: rank_key(0, p.id))
    assert {p.id for p in ranks[:10]} == {p.id for p in split.held_out if p.dataset == "a"}


def test_split_depends_on_seed_and_ids_only() -> None:
    prompts = _prompts("a", 30) + _prompts("b", 30)
    split = split_prompts(prompts, 0.3, seed=7)
    shuffled = list(reversed(prompts))
    again = split_prompts(shuffled, 0.3, seed=7)
    assert {p.id for p in again.held_out} == {p.id for p in split.held_out}
    assert {p.id for p in split_prompts(prompts, 0.3, seed=8).held_out} != {p.id for p in split.held_out}
    # Growing one group never moves a prompt of another group.
    grown = split_prompts(prompts + _prompts("c", 12), 0.3, seed=7)
    assert {p.id for p in grown.held_out if p.dataset != "c"} == {p.id for p in split.held_out}
    # A custom grouping stratifies by it instead of the dataset.
    by_parity = split_prompts(prompts, 0.5, seed=7, group=lambda p: str(int(p.id.rsplit("-", 1)[1]) % 2))
    assert sum(int(p.id.rsplit("-", 1)[1]) % 2 for p in by_parity.held_out) == 15


def test_split_refuses_repeated_ids() -> None:
    with pytest.raises(ValueError, match="unique"):
        split_prompts(_prompts("a", 3) + _prompts("a", 1), 0.25, seed=0)


def test_balanced_sample_shares_evenly_and_interleaves() -> None:
    prompts = _prompts("big", 50) + _prompts("mid", 10) + _prompts("small", 3)
    sample = balanced_sample(prompts, 30, seed=1)
    counts = {name: sum(p.dataset == name for p in sample) for name in ("big", "mid", "small")}
    # 30 over three sets: 10 each, but small has only 3, so big also takes the 7 left over.
    assert counts == {"big": 17, "mid": 10, "small": 3}
    assert [p.dataset for p in sample[:6]] == ["big", "mid", "small", "big", "mid", "small"]
    assert len({p.id for p in sample}) == 30
    assert sample == balanced_sample(prompts, 30, seed=1)
    assert sample != balanced_sample(prompts, 30, seed=2)
    assert balanced_sample(prompts, 0, seed=1) == []
    assert sorted(p.id for p in balanced_sample(prompts, 63, seed=1)) == sorted(p.id for p in prompts)
    with pytest.raises(ValueError, match="only 63"):
        balanced_sample(prompts, 64, seed=1)


def test_interleave() -> None:
    assert interleave([[1, 2, 3], ["a"], []]) == [1, "a", 2, 3]
    assert interleave([]) == []
