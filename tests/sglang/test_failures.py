"""TTS failures on the scheduler thread: absorbed, counted per site and request, logged once."""

from __future__ import annotations

import logging

import pytest

from sglang_tts.sglang.failures import FAULT_SITES_ENV, FailureLog, InjectedFault, fault_sites_from_env


def test_a_failure_is_absorbed_counted_and_logged_with_a_traceback_once(caplog):
    log = FailureLog(log_every=10)
    charged = []
    log.on_failure = lambda site, rids: charged.append((site, rids))
    ran_after = []
    with caplog.at_level(logging.WARNING, logger="sglang_tts.sglang.failures"):
        for _ in range(25):  # a failure every round
            with log.absorb("capture", ["a", "b"]):
                raise RuntimeError("boom")
            ran_after.append(True)  # the caller goes on
    assert len(ran_after) == 25
    assert log.counts["capture"] == 25 and log.total == 25
    assert charged == [("capture", ["a", "b"])] * 25
    with_traceback = [r for r in caplog.records if r.exc_info]
    assert len(with_traceback) == 1
    assert len(caplog.records) == 3  # the first, then the 10th and 20th as one line each


def test_a_body_that_succeeds_is_untouched():
    log = FailureLog()
    with log.absorb("barrier"):
        value = 41 + 1
    assert value == 42 and log.total == 0


def test_a_failing_counter_does_not_escape():
    log = FailureLog()

    def broken(site, rids):
        raise KeyError(site)

    log.on_failure = broken
    with log.absorb("report", ["a"]):
        raise ValueError("x")
    assert log.counts["report"] == 1


def test_injected_faults_fire_on_every_nth_call(monkeypatch):
    monkeypatch.setenv(FAULT_SITES_ENV, "capture:3, barrier")
    sites = fault_sites_from_env()
    assert sites == {"capture": 3, "barrier": 1}
    log = FailureLog(inject=sites)
    ran = 0
    for _ in range(9):
        with log.absorb("capture"):
            ran += 1
    assert ran == 9 and log.counts["capture"] == 3  # raised at the end of every 3rd call
    with log.absorb("barrier"):
        pass
    assert log.counts["barrier"] == 1
    monkeypatch.setenv(FAULT_SITES_ENV, "nowhere:2")
    with pytest.raises(ValueError, match="unknown site 'nowhere'"):
        fault_sites_from_env()
    assert issubclass(InjectedFault, RuntimeError)
