"""--tts-* flags: parsed by SGLang's own parser, validated at parse time, passed on via the env."""

from __future__ import annotations

import argparse

import pytest

from sglang_tts.config import TTSConfigError
from sglang_tts.sglang import flags


@pytest.fixture()
def parser(monkeypatch):
    monkeypatch.delenv(flags.ENV_VAR, raising=False)
    p = argparse.ArgumentParser(prog="sglang serve")
    flags.add_tts_cli_args(p)
    yield p
    flags.reset_env()


def test_defaults_without_flags(parser):
    parser.parse_args([])
    cfg = flags.tts_config_from_env()
    assert (cfg.update_stride, cfg.lr, cfg.scope, cfg.freeze, cfg.canvas) == (5, 1e-4, "batch", False, "accepted")


def test_flags_reach_the_config(parser):
    parser.parse_args(
        ["--tts-update-stride", "2", "--tts-lr", "3e-5", "--tts-scope", "global", "--tts-freeze",
         "--tts-position-weights", "1,0.5", "--tts-trainable", "fc,layers", "--tts-sync",
         "--tts-adapter-rank", "full", "--tts-adapter-kv", "on"]
    )  # fmt: skip
    cfg = flags.tts_config_from_env()
    assert cfg.adapter_rank == "full" and cfg.adapter_kv
    assert cfg.update_stride == 2 and cfg.lr == 3e-5 and cfg.scope == "global"
    assert cfg.freeze and cfg.sync
    assert cfg.position_weights == (1.0, 0.5) and cfg.trainable == ("fc", "layers")
    assert cfg.update_budget_scale == 0.5


def test_the_budget_scale_reaches_the_config(parser):
    parser.parse_args(["--tts-update-budget-scale", "1"])
    assert flags.tts_config_from_env().update_budget_scale == 1.0


def test_the_hybrids_suffix_score_reaches_the_config(parser):
    parser.parse_args([])
    assert flags.tts_config_from_env().hybrid_score == "average"
    parser.parse_args(["--tts-hybrid-score", "chain"])
    assert flags.tts_config_from_env().hybrid_score == "chain"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tts-update-stride", "0"], "must be an integer >= 1"),
        (["--tts-update-stride", "x"], "expected an integer"),
        (["--tts-lr", "-1"], "--tts-lr must be > 0"),
        (["--tts-scope", "batchy"], "invalid choice"),
        (["--tts-reg-lambda", "-0.5"], "--tts-reg-lambda must be >= 0"),
        (["--tts-adapter-rank", "0"], "must be an integer >= 1"),
        (["--tts-adapter-rank", "half"], "expected an integer"),
        (["--tts-adapter-kv", "yes"], "expected 'on' or 'off'"),
        (["--tts-reg-lambda", "nan"], "--tts-reg-lambda must be a finite number"),
        (["--tts-reg-lambda", "inf"], "--tts-reg-lambda must be a finite number"),
        (["--tts-max-grad-norm", "nan"], "--tts-max-grad-norm must be a finite number"),
        (["--tts-max-grad-norm", "inf"], "--tts-max-grad-norm must be a finite number"),
        (["--tts-position-weights", "1,nan"], "--tts-position-weights must be a finite number"),
        (["--tts-position-weights", "inf,1"], "--tts-position-weights must be a finite number"),
        (["--tts-adapter-alpha", "inf"], "--tts-adapter-alpha must be a finite number"),
        (["--tts-adapter-alpha", "nan"], "--tts-adapter-alpha must be a finite number"),
        (["--tts-lr", "nan"], "--tts-lr must be a finite number"),
        (["--tts-update-budget-scale", "0"], "--tts-update-budget-scale must be in (0, 1]"),
        (["--tts-update-budget-scale", "1.5"], "--tts-update-budget-scale must be in (0, 1]"),
        (["--tts-adapter-lr", "inf"], "--tts-adapter-lr must be a finite number"),
        (["--tts-hybrid-score", "best"], "invalid choice"),
    ],
)
def test_bad_values_are_argparse_errors_naming_the_flag(parser, argv, message, capsys):
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_new_parse_starts_from_defaults(monkeypatch):
    monkeypatch.delenv(flags.ENV_VAR, raising=False)
    first = argparse.ArgumentParser()
    flags.add_tts_cli_args(first)
    first.parse_args(["--tts-update-stride", "7"])
    second = argparse.ArgumentParser()
    flags.add_tts_cli_args(second)  # building the parser clears the previous record
    second.parse_args([])
    assert flags.tts_config_from_env().update_stride == 5
    flags.reset_env()


@pytest.mark.parametrize(("field", "value"), [("weight_decay", float("nan")), ("adam_betas", [0.9, float("inf")])])
def test_settings_without_a_flag_must_be_finite_too(field, value):
    with pytest.raises(TTSConfigError, match="must be a finite number"):
        flags.config_from_values({field: value})
