"""ControlledSteps: SGLang's adaptive-policy interface answered by a Controller (no server)."""

from __future__ import annotations

import pytest

from sglang_tts.control import Action, Controller, ControllerConfig, feature_names, make_policy, read_trace
from sglang_tts.sglang.adaptive_steps import ControlledSteps

ACTIONS = [Action(1, 1), Action(3, 4), Action(0, 1)]


def _adapter(tmp_path, persistence=2):
    policy = make_policy("round_robin", ACTIONS, len(feature_names(3)))
    strides = []
    adapter = ControlledSteps(Controller(policy, ControllerConfig(persistence=persistence), 3), strides.append,
                              str(tmp_path / "trace.jsonl"))  # fmt: skip
    return adapter, strides


def _round(adapter, accepted, steps, prefill_before=False):
    if prefill_before:
        adapter.forward_started()
    adapter.forward_started()
    adapter.round_done(steps, forward_seconds=0.5, tts_seconds=0.1, output_position=7.0, tts_loss=1.5)
    return adapter.on_verify_complete(accepted, len(accepted))


def test_actions_reach_sglang_and_the_distiller(tmp_path):
    adapter, strides = _adapter(tmp_path)
    assert adapter.candidate_steps == [0, 1, 3]
    assert adapter.get_steps_for_batch(1) == 1 and strides == [1]
    adapter.set_cuda_graph_bs([4, 1, 2])
    assert adapter.cuda_graph_bs_for_step(3) == [1, 2, 4]
    assert _round(adapter, [1], 1) is None
    assert _round(adapter, [0], 1) == 3  # window closed: next action (3 steps, stride 4)
    assert strides == [1, 4] and adapter.get_steps_for_batch(8) == 3 and adapter.switches == 1
    assert adapter.on_verify_complete([], 0) is None  # idle batches are ignored
    _round(adapter, [2, 3], 3)
    assert _round(adapter, [3, 3], 3) == 0
    header, records = read_trace(tmp_path / "trace.jsonl")
    assert header["actions"] == [a.to_dict() for a in ACTIONS]
    assert [r["action"] for r in records] == [ACTIONS[0].to_dict(), ACTIONS[1].to_dict()]
    assert records[1]["window"]["tokens"] == 3 + 4 + 4 + 4 and records[1]["window"]["mean_tts_loss"] == 1.5


def test_round_time_is_measured_between_consecutive_verifies(tmp_path):
    adapter, _ = _adapter(tmp_path, persistence=100)
    _round(adapter, [1], 1)  # the first round: its forward's own time
    _round(adapter, [1], 1)  # contiguous: the time since the previous verify (tiny here)
    _round(adapter, [1], 1, prefill_before=True)  # a prefill ran in between: the forward's time again
    seconds = adapter.controller._window.seconds
    assert 1.0 <= seconds < 1.1


def test_a_failing_controller_keeps_the_current_chain_length_and_is_counted():
    """SGLang calls on_verify_complete on the scheduler thread: a policy that raises must not stop it."""
    from types import SimpleNamespace

    from sglang_tts.sglang.adaptive_steps import ControlledSteps

    def broken_observe(obs):
        raise FloatingPointError("policy state went bad")

    controller = SimpleNamespace(
        current=SimpleNamespace(num_steps=3, update_stride=2), observe=broken_observe, keep_trace=lambda n: None
    )
    steps = ControlledSteps(controller, set_stride=lambda stride: None)
    assert steps.on_verify_complete([1, 2], batch_size=2) is None
    assert steps.failures.counts["controller"] == 1


def test_a_served_trace_goes_to_its_file_and_memory_keeps_only_the_latest_record(tmp_path):
    adapter, _ = _adapter(tmp_path, persistence=1)
    for _ in range(50):
        _round(adapter, [1], adapter.get_steps_for_batch(1))
    assert len(adapter.controller.trace) == 1
    assert len(read_trace(tmp_path / "trace.jsonl")[1]) == 50  # every record is in the file
    policy = make_policy("round_robin", ACTIONS, len(feature_names(3)))
    untraced = ControlledSteps(Controller(policy, ControllerConfig(persistence=1), 3), lambda stride: None)
    for _ in range(5):
        _round(untraced, [1], untraced.get_steps_for_batch(1))
    assert len(untraced.controller.trace) == 0


def test_the_proposer_reaches_the_hybrid_and_the_offers_reach_the_state(tmp_path):
    actions = [Action(3, 4, "hybrid"), Action(1, 4, "suffix"), Action(3, 4)]
    policy = make_policy("round_robin", actions, len(feature_names(3, suffix=True)))
    adapter = ControlledSteps(Controller(policy, ControllerConfig(persistence=1), 3), lambda stride: None,
                              str(tmp_path / "trace.jsonl"))  # fmt: skip
    modes = []
    adapter.set_proposer = modes.append
    adapter.apply_proposer()
    for offered in (1.0, 0.5):
        adapter.forward_started()
        adapter.round_done(3, 0.5, 0.0, 7.0, None, suffix_offered=offered, suffix_expected=0.8)
        adapter.on_verify_complete([3], 1)
    assert modes == ["hybrid", "suffix", "drafter"]
    _, records = read_trace(tmp_path / "trace.jsonl")
    assert [r["window"]["mean_suffix_offer"] for r in records] == [1.0, 0.5]
    tracker = adapter.controller.tracker
    assert tracker.features()[tracker.index("suffix_expected")] == pytest.approx(0.8)
    # a policy without the axis never touches the hybrid's mode (its rule decides)
    plain = ControlledSteps(Controller(make_policy("round_robin", ACTIONS, len(feature_names(3))),
                                       ControllerConfig(persistence=1), 3), lambda stride: None)  # fmt: skip
    plain.set_proposer = modes.append
    plain.apply_proposer()
    assert modes == ["hybrid", "suffix", "drafter"]
