"""Policy files: round trip, and every kind of corrupt or mismatched file is a clear PolicyFileError."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sglang_tts.control import (
    Action,
    ControllerConfig,
    PolicyFileError,
    action_grid,
    feature_names,
    load_policy,
    make_policy,
    save_policy,
)
from sglang_tts.control.cost import CostModel

ACTIONS = action_grid([0, 1, 3], [1, 4])
DIM = len(feature_names(3))


def _trained(kind):
    policy = make_policy(kind, ACTIONS, DIM, seed=3)
    rng = np.random.default_rng(0)
    for _ in range(30):
        x = rng.random(DIM)
        policy.update(x, int(rng.integers(len(ACTIONS))), float(rng.uniform(10, 100)))
    return policy


@pytest.mark.parametrize("kind", ["linucb", "thompson", "softmax"])
def test_round_trip_keeps_the_policys_decisions(tmp_path, kind):
    policy = _trained(kind)
    config = ControllerConfig(persistence=4, explore=False, learn=False, initial_action=Action(1, 4))
    path = save_policy(tmp_path / "p.json", policy, config, meta={"trained_on": "test"})
    bundle = load_policy(path, expected_actions=ACTIONS)
    assert bundle.actions == ACTIONS and bundle.max_steps == 3 and bundle.meta == {"trained_on": "test"}
    assert bundle.config.persistence == 4 and bundle.config.initial_action == Action(1, 4)
    xs = np.random.default_rng(1).random((20, DIM))
    assert [bundle.policy.select(x, False) for x in xs] == [policy.select(x, False) for x in xs]
    controller = bundle.make_controller(learn=True)
    assert controller.config.learn and not controller.config.explore and controller.current == Action(1, 4)


def test_scripted_kinds_and_cost_model_round_trip(tmp_path):
    rr = make_policy("round_robin", ACTIONS, DIM, order=[4, 1])
    cost = CostModel(0.01, 0.002, 0.0, 0.0001, 0.02)
    config = ControllerConfig(persistence=1, reward="cost_model", cost_model=cost)
    bundle = load_policy(save_policy(tmp_path / "rr.json", rr, config))
    assert [bundle.policy.select(None, True) for _ in range(3)] == [4, 1, 4]
    assert bundle.config.cost_model == cost and bundle.config.reward == "cost_model"
    static = load_policy(save_policy(tmp_path / "s.json", make_policy("static", ACTIONS, DIM, index=2)))
    assert static.policy.select(None, True) == 2


def _document(tmp_path):
    path = save_policy(tmp_path / "p.json", _trained("linucb"))
    return path, json.loads(path.read_text())


def _write(path, document):
    path.write_text(json.dumps(document))
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(format="something-else"), "format"),
        (lambda d: d.update(version=99), "version 99"),
        (lambda d: d.pop("state"), "missing keys"),
        (lambda d: d.update(kind="ppo"), "unknown policy kind 'ppo'"),
        (lambda d: d.update(actions=[]), "non-empty"),
        (lambda d: d["actions"].append({"num_steps": -1, "update_stride": 1}), "bad action"),
        (lambda d: d["actions"].append(dict(d["actions"][0])), "duplicate actions"),
        (lambda d: d.update(max_steps=2), "drafts 3 steps"),
        (lambda d: d["feature_names"].reverse(), "do not match"),
        (lambda d: d["controller"].update(persistence=0), "persistence"),
        (lambda d: d["controller"].update(speed="fast"), "unknown controller settings"),
        (
            lambda d: d["controller"].update(initial_action={"num_steps": 7, "update_stride": 1}),
            "not in the action set",
        ),
        (lambda d: d["state"]["b"].pop(), "bad linucb state"),
        (lambda d: d["state"]["a_inv"][0][0].__setitem__(0, float("nan")), "NaN"),
        (lambda d: d["state"]["config"].update(dim=5), "has 5 features"),
        (
            lambda d: d["state"].update(noise_var=float("inf")),
            r"NaN or Inf in the policy's state at state\['noise_var'\]",
        ),
        (lambda d: d["state"].update(y_sum=float("nan")), r"state at state\['y_sum'\]"),
        (lambda d: d["state"]["config"].update(ridge=float("-inf")), r"state at state\['config'\]\['ridge'\]"),
    ],
)
def test_corrupt_or_mismatched_files_are_clear_errors(tmp_path, edit, message):
    path, document = _document(tmp_path)
    edit(document)
    with pytest.raises(PolicyFileError, match=message) as err:
        load_policy(_write(path, document))
    assert str(path) in str(err.value)


def test_unreadable_files_and_other_action_sets(tmp_path):
    with pytest.raises(PolicyFileError, match="does not exist"):
        load_policy(tmp_path / "missing.json")
    path, document = _document(tmp_path)
    truncated = tmp_path / "truncated.json"
    truncated.write_text(path.read_text()[:200])
    with pytest.raises(PolicyFileError, match="not valid JSON"):
        load_policy(truncated)
    with pytest.raises(PolicyFileError, match="expected a JSON object"):
        load_policy(_write(tmp_path / "list.json", [1, 2]))
    with pytest.raises(PolicyFileError, match="expected"):
        load_policy(path, expected_actions=action_grid([1, 3], [1, 4]))
