"""The learners find the known best action per context of a synthetic environment (online and from
logged traces), and the controller's window/trace bookkeeping."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest

from sglang_tts.control import (
    Action,
    Controller,
    ControllerConfig,
    Observation,
    feature_names,
    load_policy,
    make_policy,
    read_trace,
    save_policy,
)
from sglang_tts.control.synthetic import SyntheticConfig, SyntheticEnv
from sglang_tts.control.training import fit_traces, greedy_choice_per_context, load_traces, train_synthetic

# Two chain lengths x two strides, four contexts (batch 1/16 x early/late in the output) whose best
# actions differ in both axes, each at least ~12% better than the runner-up in expectation.
ENV = SyntheticConfig(
    accept_rate=(("high", 0.8),),
    steps=(1, 4),
    strides=(1, 16),
    late_drift=0.4,
    t_update=0.01,
    batch_sizes=(1, 16),
    noise_sigma=0.05,
)


def _mode(values):
    return collections.Counter(values).most_common(1)[0][0]


def test_the_environment_is_not_trivial():
    actions = ENV.actions()
    table = ENV.reward_table()
    best = {c: int(np.argmax(r)) for c, r in table.items()}
    assert len(set(best.values())) >= 3
    assert {actions[i].num_steps for i in best.values()} == {1, 4}
    assert {actions[i].update_stride for i in best.values()} == {1, 16}
    for r in table.values():
        top, second = np.sort(r)[::-1][:2]
        assert top / second > 1.1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_online_learner_finds_the_best_action_per_context(seed):
    dim = len(feature_names(ENV.max_steps))
    policy = make_policy("thompson", ENV.actions(), dim, seed=seed)
    train_synthetic(policy, windows=600, config=ENV, seed=seed, episode_rounds=160)
    for context, picked in greedy_choice_per_context(policy, ENV).items():
        assert _mode(picked) == ENV.best_action_index(context), (str(context), picked)


@pytest.mark.parametrize("logging_kind", ["round_robin", "uniform"])
def test_offline_fit_from_a_logged_trace_finds_the_best_action(tmp_path, logging_kind):
    actions = ENV.actions()
    dim = len(feature_names(ENV.max_steps))
    logger = Controller(make_policy(logging_kind, actions, dim), ControllerConfig(persistence=8), ENV.max_steps)
    env = SyntheticEnv(ENV, episode_rounds=160, seed=5)
    while logger.stats["decisions"] < 800:
        logger.observe(env.step(logger.current))
    trace = tmp_path / "trace.jsonl"
    assert logger.write_trace(trace) == 800
    traces = load_traces([trace])
    assert traces.actions == actions and len(traces.records) == 800

    policy = make_policy("linucb", actions, dim)
    report = fit_traces(policy, traces)
    assert report.used == 800 and len(report.per_action) == 4
    if logging_kind == "round_robin":
        assert set(report.per_action.values()) == {200}
    else:  # random, not a cycle: every action about a quarter of the time
        assert all(150 < n < 250 for n in report.per_action.values()), report.per_action
    for context, picked in greedy_choice_per_context(policy, ENV).items():
        assert _mode(picked) == ENV.best_action_index(context), (str(context), picked)


def test_offline_fit_refuses_on_policy_learners_and_other_feature_sets(tmp_path):
    actions = ENV.actions()
    c = Controller(make_policy("static", actions, 0), ControllerConfig(persistence=2), ENV.max_steps)
    env = SyntheticEnv(ENV, seed=0)
    for _ in range(10):
        c.observe(env.step(c.current))
    c.write_trace(tmp_path / "t.jsonl")
    traces = load_traces([tmp_path / "t.jsonl"])
    with pytest.raises(ValueError, match="cannot be fitted offline"):
        fit_traces(make_policy("softmax", actions, len(traces.feature_names)), traces)
    with pytest.raises(ValueError, match="features"):
        fit_traces(make_policy("linucb", actions, len(traces.feature_names) + 2), traces)


def test_round_robin_cycles_and_the_trace_records_each_window(tmp_path):
    actions = [Action(1, 1), Action(3, 4), Action(0, 1)]
    dim = len(feature_names(3))
    c = Controller(make_policy("round_robin", actions, dim, order=[1, 2, 0]), ControllerConfig(persistence=2), 3)
    seen = [c.current]
    for i in range(12):
        obs = Observation([c.current.num_steps + 1], c.current.num_steps, 1, 10.0 + i, 0.01, 0.001, 0.5)
        nxt = c.observe(obs)
        if nxt is not None:
            seen.append(nxt)
    assert seen == [actions[i] for i in [1, 2, 0, 1, 2, 0, 1]]
    c.write_trace(tmp_path / "t.jsonl")
    header, records = read_trace(tmp_path / "t.jsonl")
    assert header["feature_names"] == feature_names(3)
    assert [r["action"] for r in records] == [a.to_dict() for a in seen[:-1]]
    # tokens/s of whole rounds: 2 rounds of (steps + 1) tokens in 2 x 0.01 s
    assert records[0]["reward"] == pytest.approx(2 * 4 / 0.02)
    assert all(r["window"]["mismatched_rounds"] == 0 for r in records)


def test_uniform_logging_is_random_seeded_and_resumes_its_sequence(tmp_path):
    actions = [Action(0, 1), Action(1, 2), Action(3, 2), Action(3, 5)]
    policy = make_policy("uniform", actions, 0, seed=7)
    picks = [policy.select(None, True) for _ in range(400)]
    assert set(picks) == {0, 1, 2, 3}
    # not a cycle: some action repeats back to back, and successors of an action vary
    assert any(a == b for a, b in zip(picks, picks[1:]))
    assert len({b for a, b in zip(picks, picks[1:]) if a == 0}) == 4
    same_seed = make_policy("uniform", actions, 0, seed=7)
    assert [same_seed.select(None, True) for _ in range(400)] == picks
    other_seed = make_policy("uniform", actions, 0, seed=8)
    assert [other_seed.select(None, True) for _ in range(400)] != picks
    # saved mid-sequence, a reloaded policy continues where this one is
    bundle = load_policy(save_policy(tmp_path / "u.json", policy, ControllerConfig()))
    assert [bundle.policy.select(None, True) for _ in range(20)] == [policy.select(None, True) for _ in range(20)]


def write_uniform_trace(path, actions, records):
    """A trace file as the server writes it (header, then one record per window), max_steps 3."""
    header = {
        "type": "header", "format": "sglang-tts-controller-trace", "version": 1, "max_steps": 3,
        "feature_names": feature_names(3), "actions": [a.to_dict() for a in actions], "persistence": 8,
        "reward": "tokens_per_second", "policy_kind": "uniform",
    }  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in [header, *records]) + "\n")
    return path


def test_static_grid_pools_each_actions_windows_per_batch_size(tmp_path):
    from sglang_tts.control.training import static_grid

    a, b = Action(1, 2), Action(3, 2)

    def window(action, tokens, seconds, batch):
        w = {"tokens": tokens, "seconds": seconds, "mean_batch_size": batch}
        return {"type": "decision", "action": action.to_dict(), "reward": tokens / seconds, "window": w}

    records = [
        window(a, 10, 1.0, 1), window(a, 30, 1.0, 1),  # a at batch 1: 40 tokens / 2 s = 20 tok/s
        window(b, 25, 1.0, 1.2),  # b at batch 1: 25 tok/s (1.2 rounds to 1)
        window(a, 60, 1.0, 3.6), window(b, 40, 1.0, 4),  # batch 2-4: a 60, b 40
        window(b, 90, 1.0, 8),  # batch 5-8: only b ran, so that bucket is left out of "overall"
    ]  # fmt: skip
    path = write_uniform_trace(tmp_path / "t.jsonl", [a, b], records)
    grid = static_grid(load_traces([path]))
    assert grid["1"]["actions"]["steps=1,S=2"] == {"windows": 2, "tokens_per_s": 20.0}
    assert grid["1"]["best"] == "steps=3,S=2" and grid["2-4"]["best"] == "steps=1,S=2"
    assert grid["5-8"]["actions"] == {"steps=3,S=2": {"windows": 1, "tokens_per_s": 90.0}}
    overall = grid["overall"]
    assert overall["buckets"] == ["1", "2-4"]
    assert overall["geomean_tokens_per_s"]["steps=1,S=2"] == pytest.approx((20 * 60) ** 0.5)
    assert overall["geomean_tokens_per_s"]["steps=3,S=2"] == pytest.approx((25 * 40) ** 0.5)
    assert overall["best"] == "steps=1,S=2"


def test_context_headroom_compares_each_contexts_best_action_with_the_static_one(tmp_path):
    from sglang_tts.control.training import context_headroom

    a, b = Action(1, 2), Action(3, 2)

    def windows(action, tokens_per_s, batch, position, n=3):
        w = {"tokens": tokens_per_s, "seconds": 1.0, "mean_batch_size": batch, "mean_output_position": position}
        return [{"type": "decision", "action": action.to_dict(), "window": w}] * n

    records = [
        # batch 1, early: a 20, b 10; late (position 300 -> bucket 256): a 10, b 40
        *windows(a, 20, 1, 10), *windows(b, 10, 1, 100), *windows(a, 10, 1, 300), *windows(b, 40, 1, 400),
        # batch 5-8, early: both 30 (static b is already the best there)
        *windows(a, 30, 8, 0), *windows(b, 30, 7.6, 50),
        # a context where b ran too few windows to compare is left out
        *windows(a, 99, 4, 0), *windows(b, 1, 4, 0, n=2),
    ]  # fmt: skip
    path = write_uniform_trace(tmp_path / "t.jsonl", [a, b], records)
    traces = load_traces([path])
    headroom = context_headroom(traces, static="steps=3,S=2")
    rows = {(r["batch"], r["position"]): r for r in headroom["contexts"]}
    assert set(rows) == {("1", 0), ("1", 256), ("5-8", 0)}
    assert rows[("1", 0)]["best"] == "steps=1,S=2" and rows[("1", 0)]["ratio"] == pytest.approx(2.0)
    assert rows[("1", 256)]["best"] == "steps=3,S=2" and rows[("1", 256)]["ratio"] == pytest.approx(1.0)
    assert rows[("5-8", 0)]["ratio"] == pytest.approx(1.0)
    # windows-weighted geometric mean: 6 windows at 2.0, 6 at 1.0 in batch 1; 6 more at 1.0 overall
    assert headroom["by_batch"]["1"]["ratio"] == pytest.approx(2.0**0.5)
    assert headroom["overall"] == pytest.approx(2.0 ** (1 / 3))
    # by default the static action is static_grid's overall best (here a, by its 99 tok/s at batch 2-4,
    # though b wins at batch 1), and a context never gains less than 1x over it
    default = context_headroom(traces)
    assert default["static"] == "steps=1,S=2"
    assert all(r["ratio"] >= 1.0 for r in default["contexts"])
    assert default["by_batch"]["1"]["ratio"] == pytest.approx(4.0**0.5)
