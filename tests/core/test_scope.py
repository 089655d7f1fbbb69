"""Scopes decide when the adapted drafter returns to base weights."""

from __future__ import annotations

from collections import deque

import pytest

from sglang_tts.core.scope import BatchScope, GlobalScope, make_scope


def test_batch_scope_resets_once_its_generation_has_finished():
    scope = BatchScope()
    assert scope.before_round(["a"]) is False  # nothing adapted yet; generation {a} begins
    scope.contributed(["a"])
    assert scope.before_round(["a", "b"]) is False  # b arrived later: the next generation
    scope.contributed(["a", "b"])
    assert scope.before_round(["b", "c"]) is True  # a gone: reset before b and c draft
    assert scope.generation == {"b", "c"}
    scope.contributed(["b", "c"])
    assert scope.before_round(["c", "d"]) is False  # c still running
    assert scope.before_round(["d"]) is True
    assert scope.before_round(["d"]) is False  # and only once: nothing adapted since
    assert scope.before_round(["e"]) is False


def test_rolling_traffic_resets_once_per_request_lifetime():
    """Continuous batching: one request joins and one leaves every round, so the batch is never
    empty and no set of contributors ever leaves all at once."""
    scope = BatchScope()
    lifetime = 4
    live = deque(f"r{i}" for i in range(lifetime))
    reset_rounds = []
    for round_index in range(10_000):
        if scope.before_round(list(live)):
            reset_rounds.append(round_index)
        scope.contributed(live)
        assert len(scope.generation) <= lifetime
        live.popleft()
        live.append(f"r{round_index + lifetime}")
    assert reset_rounds == list(range(lifetime, 10_000, lifetime))


def test_sequential_requests_at_batch_one_reset_between_requests():
    scope = BatchScope()
    scope.contributed(["r1"])
    assert scope.before_round(["r2"]) is True


def test_global_scope_never_resets():
    scope = GlobalScope()
    scope.contributed(["a"])
    assert scope.before_round(["b"]) is False


def test_make_scope_names():
    assert isinstance(make_scope("batch"), BatchScope)
    assert isinstance(make_scope("global"), GlobalScope)
    assert isinstance(make_scope("request"), GlobalScope)  # per-request adapters: base never resets
    with pytest.raises(ValueError, match="unknown TTS scope"):
        make_scope("sequence")
