"""The controller's state: per-position acceptance estimates, their ageing, and the expected tokens."""

from __future__ import annotations

import math

import numpy as np

from sglang_tts.control import Action, Controller, ControllerConfig, Observation
from sglang_tts.control.observation import RATE_PRIOR, StateTracker, expected_tokens


def _round(accept_lengths, num_steps, position=100.0):
    return Observation(
        accept_lengths=list(accept_lengths),
        num_steps=num_steps,
        batch_size=len(accept_lengths),
        output_position=position,
        round_seconds=0.1,
        update_seconds=0.0,
    )


def test_expected_tokens_of_a_chain():
    assert expected_tokens(np.array([1.0, 1.0, 1.0])).tolist() == [1.0, 2.0, 3.0, 4.0]
    # Position 2 only counts when position 1 was accepted: 1 + 0.5 + 0.5 * 0.5.
    assert expected_tokens(np.array([0.5, 0.5])).tolist() == [1.0, 1.5, 1.75]


def test_rates_are_the_conditional_acceptance_of_each_position():
    tracker = StateTracker(max_steps=3)
    for _ in range(200):
        # Four requests: every first draft accepted, half of the second ones, no third one.
        tracker.observe(_round([3, 3, 2, 2], num_steps=3))
    rates = tracker.rates()
    assert rates[0] > 0.98 and abs(rates[1] - 0.5) < 0.02 and rates[2] < 0.02


def test_evidence_ages_back_to_the_prior_when_nothing_is_drafted():
    tracker = StateTracker(max_steps=3)
    for _ in range(100):
        tracker.observe(_round([1], num_steps=3))  # nothing accepted
    accept = tracker.features()[tracker.index("accept_ema")]
    assert tracker.rates()[0] < 0.05
    for _ in range(150):
        tracker.observe(_round([1], num_steps=0))  # no drafting: no new evidence
    assert abs(tracker.rates()[0] - RATE_PRIOR) < 0.05
    # The accepted-length EMA only moves on drafting rounds (a no-drafting round commits 1 by construction).
    assert tracker.features()[tracker.index("accept_ema")] == accept


class _DraftWhenWorthIt:
    """A fixed rule standing in for a fitted policy: draft one token when the state predicts more than
    1.3 tokens per round at chain length 1, else do not draft."""

    actions = [Action(0, 1), Action(1, 1)]

    def __init__(self, max_steps):
        self.scale = math.log(max_steps + 1)
        self.index = StateTracker(max_steps).index("log_tokens_1")

    def select(self, features, explore):
        return int(math.exp(features[self.index] * self.scale) > 1.3)

    def update(self, features, action_index, reward):
        pass


def test_a_greedy_controller_that_stopped_drafting_probes_again():
    policy = _DraftWhenWorthIt(max_steps=1)
    controller = Controller(policy, ControllerConfig(persistence=8, learn=False, explore=False), max_steps=1)
    chosen = [controller.current.num_steps]
    for _ in range(400):
        n = controller.current.num_steps
        # The drafter is poor (no draft ever accepted): drafting costs, but the controller cannot know
        # that forever without trying.
        action = controller.observe(_round([1], num_steps=n))
        if action is not None:
            chosen.append(action.num_steps)
    stops = [i for i in range(1, len(chosen)) if chosen[i - 1] == 1 and chosen[i] == 0]
    probes = [i for i in range(1, len(chosen)) if chosen[i - 1] == 0 and chosen[i] == 1]
    assert stops and probes and probes[0] > stops[0]
    # Mostly it does not draft: the probes are short.
    assert chosen.count(0) > 2 * chosen.count(1)
