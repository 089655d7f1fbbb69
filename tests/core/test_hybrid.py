"""The hybrid rule (core/hybrid.py): which proposer's chain a request verifies, learned per request."""

from __future__ import annotations

import pytest

from sglang_tts.core.hybrid import DRAFTER, SUFFIX, HybridChooser, HybridRule, common_prefix


def test_common_prefix_counts_what_verify_would_accept():
    assert common_prefix([5, 6, 7], [5, 6, 9, 1]) == 2
    assert common_prefix([5, 6, 7], [1]) == 0
    assert common_prefix([5, 6, 7], [5, 6]) == 2  # all committed tokens match: a lower bound
    assert common_prefix([], [1, 2]) == 0


def test_min_match_defaults_to_the_whole_chain():
    assert HybridRule(steps=3).min_match == 3
    assert HybridRule(steps=3, min_match=2).min_match == 2
    assert HybridRule(steps=3, min_match=7).min_match == 3


def _round(chooser, rid, chain, output, accepted_drafts):
    """One round: choose, then SGLang's verify commits `accepted_drafts` drafted tokens + the bonus."""
    take = chooser.choose(rid, chain, output)
    chooser.accepted(rid, accepted_drafts)
    return take


def test_a_suffix_chain_that_would_have_been_accepted_wins_the_next_round():
    chooser = HybridChooser(HybridRule(steps=3))
    output = [1, 2]
    # The drafter drafts (the suffix proposer starts with no credit) and gets 1 token; the suffix
    # chain offered, [7, 8, 9], is what the target then commits: it is scored counterfactually.
    assert not _round(chooser, "r", [7, 8, 9], output, 1)
    output += [7, 8]  # 1 accepted + the bonus
    # Suffix expectation 0 -> 1 (2 of [7, 8, 9] matched [7, 8]); the drafter's 1 -> 1: a tie goes to
    # the suffix chain, which costs no drafter forward.
    assert chooser.choose("r", [9, 10, 11], output)
    rounds, accepted = chooser.counts("r")
    assert rounds == {SUFFIX: 0, DRAFTER: 1} and accepted == {SUFFIX: 0, DRAFTER: 1}
    assert chooser.accepted("r", 3) == SUFFIX
    rounds, accepted = chooser.counts("r")
    assert rounds[SUFFIX] == 1 and accepted[SUFFIX] == 3
    assert chooser.requests["r"].expected[SUFFIX] == 2.0


def test_a_short_chain_is_never_taken_and_a_failing_suffix_gives_way():
    chooser = HybridChooser(HybridRule(steps=3), prior_suffix=5.0)
    assert not chooser.choose("r", [7, 8], [1])  # shorter than min_match
    chooser.accepted("r", 0)
    assert chooser.choose("r", [7, 8, 9], [1, 5])  # the prior favours the suffix proposer
    for _ in range(4):  # its chains are rejected at the first token
        chooser.accepted("r", 0)
        took = chooser.choose("r", [7, 8, 9], [1, 5])
    assert not took
    assert chooser.requests["r"].expected[SUFFIX] < 1.0


def test_margin_favours_the_cheaper_proposer():
    chooser = HybridChooser(HybridRule(steps=3, margin=0.5), prior_suffix=0.6, prior_drafter=1.0)
    assert chooser.choose("r", [1, 2, 3], [0])  # 0.6 >= 1.0 - 0.5
    strict = HybridChooser(HybridRule(steps=3), prior_suffix=0.6, prior_drafter=1.0)
    assert not strict.choose("r", [1, 2, 3], [0])


def test_new_requests_start_from_what_other_requests_taught():
    chooser = HybridChooser(HybridRule(steps=3))
    output: list[int] = []
    for _ in range(40):  # request "a": the drafter drafts 0, every suffix chain would have been accepted
        chooser.choose("a", [1, 2, 3], output)
        chooser.set_drafter("a")
        chooser.accepted("a", 0)
        output += [1, 2, 3, 4][:1]  # the target commits the bonus token, 1: the chain's first token
    assert chooser.prior[SUFFIX] > chooser.prior[DRAFTER]
    assert chooser.choose("b", [5, 6, 7], [9])  # a new request takes the suffix chain at once


def test_state_is_per_live_request():
    chooser = HybridChooser(HybridRule(steps=3))
    for rid in ("a", "b"):
        chooser.choose(rid, [1, 2, 3], [0])
    chooser.set_drafter("a")
    assert chooser.accepted("a", 1) == DRAFTER
    chooser.forget("a")
    chooser.forget("b")
    chooser.forget("never-seen")
    assert chooser.requests == {}
    assert chooser.accepted("a", 1) is None


def test_the_drafter_mode_drafts_every_round_and_still_scores_the_suffix_offers():
    chooser = HybridChooser(HybridRule(steps=3))
    output = [1, 2]
    for _ in range(3):  # every offer would have been accepted whole
        assert not chooser.choose("r", [9, 10, 11], output, mode="drafter")
        chooser.accepted("r", 0)
        output = [*output, 9, 10, 11, 12]
    chooser.choose("r", [], output, mode="drafter")  # scores the last offer
    assert chooser.expected("r") > 2.0 and chooser.counts("r")[0][SUFFIX] == 0
    assert chooser.choose("r", [9, 10, 11], output)  # back in the rule's hands: the suffix chain


def test_the_suffix_mode_takes_any_chain_and_a_round_may_be_shorter():
    chooser = HybridChooser(HybridRule(steps=3), prior_suffix=0.0, prior_drafter=5.0)
    assert chooser.choose("r", [], [1], mode="suffix")  # nothing offered: an empty (0-padded) chain
    chooser.accepted("r", 0)
    assert not chooser.choose("r", [7, 8], [1, 2])  # the rule: shorter than the chain of 3
    chooser.accepted("r", 0)
    rule_min = HybridChooser(HybridRule(steps=3), prior_suffix=5.0)
    assert rule_min.choose("r", [7, 8], [1], min_match=2)  # a round of 2 steps: a chain of 2 is whole
    assert rule_min.expected("new") == 5.0  # a request not seen yet: the prior
    with pytest.raises(ValueError, match="hybrid mode"):
        rule_min.choose("r", [7], [1], mode="ngram")
