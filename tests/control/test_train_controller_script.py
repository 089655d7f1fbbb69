"""scripts/train_controller.py: scripted, trace-fitted and synthetic policies come out loadable."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

from sglang_tts.control import Action, load_policy
from sglang_tts.control.synthetic import SyntheticConfig, SyntheticEnv

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "train_controller.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_controller", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_collect_with_round_robin_then_fit_the_traces(script, tmp_path, capsys):
    rr = tmp_path / "rr.json"
    assert script.main(["--kind", "round_robin", "--steps", "1,3", "--strides", "1,4", "--out", str(rr)]) == 0
    controller = load_policy(rr).make_controller()
    env = SyntheticEnv(SyntheticConfig(steps=(1, 3), strides=(1, 4)), seed=0)
    while controller.stats["decisions"] < 40:
        controller.observe(env.step(controller.current))
    controller.write_trace(tmp_path / "trace.jsonl")
    capsys.readouterr()  # the first call's summary

    out = tmp_path / "fit.json"
    argv = ["--kind", "linucb", "--trace", str(tmp_path / "trace.jsonl"), "--reward", "cost_model", "--out", str(out)]
    assert script.main([*argv, "--initial-steps", "3", "--initial-stride", "4"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["trace_records_used"] == 40
    # the grid-search baseline: per batch-size bucket of the synthetic environment, the actions that ran
    grid = summary["static_grid"]
    actions = {"steps=1,S=1", "steps=1,S=4", "steps=3,S=1", "steps=3,S=4"}
    buckets = [label for label in grid if label != "overall"]
    assert buckets and all(set(grid[b]["actions"]) <= actions and grid[b]["best"] in actions for b in buckets)
    assert sum(c["windows"] for b in buckets for c in grid[b]["actions"].values()) == 40
    bundle = load_policy(out)
    assert bundle.actions == [Action(1, 1), Action(1, 4), Action(3, 1), Action(3, 4)]
    assert bundle.config.reward == "cost_model" and bundle.config.cost_model is not None
    assert bundle.config.initial_action == Action(3, 4) and int(sum(bundle.policy.counts)) == 40


def test_synthetic_training_and_bad_inputs(script, tmp_path, capsys):
    out = tmp_path / "syn.json"
    assert script.main(["--kind", "thompson", "--synthetic-windows", "50", "--evaluate", "20", "--out", str(out)]) == 0
    assert "synthetic_eval_oracle_ratio" in capsys.readouterr().out
    assert load_policy(out).policy.kind == "thompson"
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert script.main(["--init", str(bad), "--out", str(tmp_path / "x.json")]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert script.main(["--kind", "linucb", "--steps", "1", "--reward", "cost_model", "--out", str(out)]) == 2


def test_a_logging_policy_over_proposers(script, tmp_path, capsys):
    out = tmp_path / "log.json"
    argv = ["--kind", "uniform", "--steps", "0,3", "--strides", "8", "--proposers", "drafter,suffix", "--out", str(out)]
    assert script.main([*argv, "--initial-steps", "3", "--initial-proposer", "suffix"]) == 0
    bundle = load_policy(out)
    assert bundle.actions == [Action(0, 8), Action(3, 8), Action(3, 8, "suffix")]
    assert bundle.config.initial_action == Action(3, 8, "suffix")
    assert bundle.make_controller().tracker.names[-2:] == ["suffix_offer", "suffix_expected"]
    capsys.readouterr()
    assert script.main(["--kind", "uniform", "--proposers", "ngram", "--out", str(tmp_path / "x.json")]) == 2
    assert "unknown proposers" in capsys.readouterr().err


def test_longer_chains_for_the_suffix_proposer_alone(script, tmp_path, capsys):
    out = tmp_path / "log.json"
    argv = ["--kind", "uniform", "--steps", "0,3", "--strides", "16", "--proposers", "hybrid,suffix"]
    assert script.main([*argv, "--suffix-steps", "8", "--out", str(out)]) == 0
    bundle = load_policy(out)
    assert bundle.actions == [Action(0, 16), Action(3, 16, "hybrid"), Action(3, 16, "suffix"), Action(8, 16, "suffix")]
    assert bundle.max_steps == 8  # the state's acceptance features span the longest chain
    capsys.readouterr()
    assert script.main([*argv, "--suffix-steps", "0", "--out", str(out)]) == 2
    assert "suffix_steps" in capsys.readouterr().err
