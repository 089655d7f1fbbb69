"""Scopes decide when the adapted drafter returns to base weights."""

from __future__ import annotations

import pytest

from sglang_tts.core.scope import BatchScope, GlobalScope, make_scope


def test_batch_scope_resets_once_every_contributor_has_left():
    scope = BatchScope()
    assert scope.before_round(["a"]) is False  # nothing adapted yet
    scope.contributed(["a"])
    assert scope.before_round(["a"]) is False
    assert scope.before_round(["a", "b"]) is False
    scope.contributed(["b"])
    assert scope.before_round(["b", "c"]) is False  # b still running: the shared drafter stays
    assert scope.before_round(["c"]) is True  # a and b gone: reset before c drafts
    assert scope.before_round(["c"]) is False  # and only once


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
