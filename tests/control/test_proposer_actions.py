"""The controller's proposer axis: actions that choose who drafts (the drafter, the hybrid rule, the
suffix proposer), the state features that let a policy choose it, policy files and trace analysis."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sglang_tts.control import (
    Action,
    Controller,
    ControllerConfig,
    Observation,
    PolicyFileError,
    StateTracker,
    action_grid,
    feature_names,
    load_policy,
    make_policy,
    save_policy,
)
from sglang_tts.control.actions import MODES, uses_suffix
from sglang_tts.control.training import context_headroom, load_traces, static_grid
from sglang_tts.core import hybrid


def test_the_modes_are_the_hybrids():
    assert MODES == hybrid.MODES


def test_actions_carry_a_proposer_and_old_dicts_mean_the_drafter():
    a = Action(3, 8, "suffix")
    assert a.to_dict() == {"num_steps": 3, "update_stride": 8, "proposer": "suffix"}
    assert Action.from_dict(a.to_dict()) == a and str(a) == "steps=3,S=8,suffix"
    old = Action.from_dict({"num_steps": 3, "update_stride": 8})
    assert old.proposer == "drafter" and old.to_dict() == {"num_steps": 3, "update_stride": 8}
    assert str(old) == "steps=3,S=8"
    with pytest.raises(ValueError, match="proposer"):
        Action(3, 8, "ngram")


def test_the_grid_has_one_no_drafting_arm_and_every_proposer_per_chain():
    grid = action_grid([0, 1, 3], [8], ["suffix", "drafter", "hybrid"])
    assert [str(a) for a in grid] == [
        "steps=0,S=8",
        "steps=1,S=8", "steps=1,S=8,hybrid", "steps=1,S=8,suffix",
        "steps=3,S=8", "steps=3,S=8,hybrid", "steps=3,S=8,suffix",
    ]  # fmt: skip
    assert uses_suffix(grid) and not uses_suffix(action_grid([1, 3], [2, 8]))
    with pytest.raises(ValueError, match="unknown proposers"):
        action_grid([3], [8], ["drafter", "eagle"])


def test_suffix_only_chains_join_the_grid_in_order_without_duplicates():
    grid = action_grid([1, 3], [8, 16], ["drafter", "hybrid", "suffix"], suffix_steps=[8, 3, 6])
    assert [str(a) for a in grid if a.num_steps > 3] == [
        "steps=6,S=8,suffix", "steps=6,S=16,suffix", "steps=8,S=8,suffix", "steps=8,S=16,suffix",
    ]  # fmt: skip
    assert len(grid) == len(set(grid)) == 2 * 2 * 3 + 4  # chain 3's suffix arms are not repeated
    assert grid == sorted(grid, key=lambda a: (a.num_steps, a.update_stride, MODES.index(a.proposer)))
    # without the suffix proposer in `proposers`, its chain 3 arm comes from suffix_steps alone
    assert action_grid([3], [8], suffix_steps=[3]) == [Action(3, 8), Action(3, 8, "suffix")]
    with pytest.raises(ValueError, match="suffix_steps"):
        action_grid([3], [8], suffix_steps=[0])


def test_the_state_carries_the_suffix_proposers_offers_only_with_the_axis():
    assert feature_names(3, suffix=True) == [*feature_names(3), "suffix_offer", "suffix_expected"]
    plain, with_suffix = StateTracker(3), StateTracker(3, suffix=True)
    assert with_suffix.dim == plain.dim + 2
    for offered, expected in [(1.0, 0.9), (1.0, 1.0), (0.0, 0.1)]:
        obs = Observation([2, 1], 3, 2, 10.0, 0.1, 0.0, suffix_offered=offered, suffix_expected=expected)
        plain.observe(obs)
        with_suffix.observe(obs)
    x = with_suffix.features()
    assert np.allclose(x[: plain.dim], plain.features())  # the other features are untouched
    offer, exp = x[with_suffix.index("suffix_offer")], x[with_suffix.index("suffix_expected")]
    assert offer == pytest.approx(0.8 * 1.0 + 0.2 * 0.0) and exp == pytest.approx(0.8 * (0.8 * 0.9 + 0.2) + 0.02)
    # rounds without the hybrid (None) leave them where they are
    with_suffix.observe(Observation([1], 3, 1, 11.0, 0.1, 0.0))
    assert with_suffix.features()[with_suffix.index("suffix_offer")] == pytest.approx(offer)


def test_a_policy_with_the_axis_saves_its_features_and_reloads(tmp_path):
    actions = action_grid([1, 3], [8], ["drafter", "hybrid", "suffix"])
    dim = len(feature_names(3, suffix=True))
    policy = make_policy("linucb", actions, dim)
    rng = np.random.default_rng(0)
    for _ in range(20):
        policy.update(rng.random(dim), int(rng.integers(len(actions))), float(rng.uniform(5, 50)))
    config = ControllerConfig(persistence=4, explore=False, initial_action=Action(3, 8, "hybrid"))
    path = save_policy(tmp_path / "p.json", policy, config)
    document = json.loads(path.read_text())
    assert document["feature_names"][-2:] == ["suffix_offer", "suffix_expected"]
    bundle = load_policy(path)
    assert bundle.actions == actions and bundle.config.initial_action == Action(3, 8, "hybrid")
    controller = bundle.make_controller()
    assert controller.tracker.dim == dim and controller.current == Action(3, 8, "hybrid")
    # a file whose features lack the suffix pair, with proposer actions, is refused
    document["feature_names"] = feature_names(3)
    (tmp_path / "bad.json").write_text(json.dumps(document))
    with pytest.raises(PolicyFileError, match="do not match"):
        load_policy(tmp_path / "bad.json")


def test_the_window_records_the_suffix_offer(tmp_path):
    actions = [Action(3, 8, "hybrid"), Action(3, 8, "suffix")]
    policy = make_policy("round_robin", actions, len(feature_names(3, suffix=True)))
    controller = Controller(policy, ControllerConfig(persistence=2), 3)
    controller.observe(Observation([4], 3, 1, 5.0, 0.1, 0.0, suffix_offered=1.0, suffix_expected=0.9))
    assert controller.observe(Observation([2], 3, 1, 9.0, 0.1, 0.0, suffix_offered=0.0)) == actions[1]
    assert controller.trace[-1]["window"]["mean_suffix_offer"] == pytest.approx(0.5)
    drafter_only = Controller(make_policy("round_robin", [Action(3, 8)], len(feature_names(3))), ControllerConfig(1), 3)
    drafter_only.observe(Observation([4], 3, 1, 5.0, 0.1, 0.0))
    assert drafter_only.trace[-1]["window"]["mean_suffix_offer"] is None


def _trace(path, actions, records):
    header = {
        "type": "header", "format": "sglang-tts-controller-trace", "version": 1, "max_steps": 3,
        "feature_names": feature_names(3, suffix=True), "actions": [a.to_dict() for a in actions],
        "persistence": 8, "reward": "tokens_per_second", "policy_kind": "uniform",
    }  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in [header, *records]) + "\n")
    return path


def test_headroom_splits_contexts_by_the_suffix_proposers_record_at_the_decision(tmp_path):
    drafter, suffix = Action(3, 8), Action(3, 8, "suffix")
    names = feature_names(3, suffix=True)

    def windows(action, tokens_per_s, expected, n=3):
        features = [0.0] * len(names)
        features[names.index("suffix_expected")] = expected
        w = {"tokens": tokens_per_s, "seconds": 1.0, "mean_batch_size": 1, "mean_output_position": 10,
             "mean_suffix_offer": 1.0}  # fmt: skip
        return [{"type": "decision", "action": action.to_dict(), "features": features, "window": w}] * n

    records = [
        # text the prompt holds (a strong suffix record): the suffix proposer 3x the drafter;
        # new text (a weak record): the drafter 2x
        *windows(drafter, 10, 0.9), *windows(suffix, 30, 0.95),
        *windows(drafter, 20, 0.1), *windows(suffix, 10, 0.0),
    ]  # fmt: skip
    traces = load_traces([_trace(tmp_path / "t.jsonl", [drafter, suffix], records)])
    assert static_grid(traces)["1"]["best"] == "steps=3,S=8,suffix"  # 40 tokens / 6 s vs 30 / 6
    headroom = context_headroom(traces, static="steps=3,S=8,suffix")
    rows = {r["suffix"]: r for r in headroom["contexts"]}
    assert set(rows) == {"suffix<1/3", "suffix>=2/3"}
    assert rows["suffix>=2/3"]["ratio"] == pytest.approx(1.0)
    assert rows["suffix<1/3"]["best"] == "steps=3,S=8" and rows["suffix<1/3"]["ratio"] == pytest.approx(2.0)
    assert headroom["overall"] == pytest.approx(2.0**0.5)
