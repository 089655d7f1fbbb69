"""The hybrid rule (core/hybrid.py): which proposer's chain a request verifies, learned per request."""

from __future__ import annotations

import pytest

from sglang_tts.core.hybrid import (
    DRAFTER,
    SUFFIX,
    HybridChooser,
    HybridRule,
    RoundCosts,
    as_text,
    chain_score,
    common_prefix,
)


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


def test_round_costs_are_medians_per_shape_and_bounded():
    costs = RoundCosts(window=4, keys=2, min_rounds=2)
    assert costs.ratio(1, 3) == 1.0  # nothing measured: the plain rule
    for seconds in (0.06, 0.06, 5.0):  # one round with an inline update in it
        costs.record(SUFFIX, 1, 3, seconds)
    assert costs.seconds(SUFFIX, 1, 3) == 0.06 and costs.ratio(1, 3) == 1.0  # no drafter round yet
    for seconds in (0.08, 0.08, 0.09, 0.08, 0.08):
        costs.record(DRAFTER, 1, 3, seconds)
    assert costs.ratio(1, 3) == pytest.approx(0.08 / 0.06)
    assert len(costs._seconds[(1, 3)][DRAFTER]) == 4  # the window
    costs.record(DRAFTER, 2, 3, 0.1)
    costs.record(DRAFTER, 4, 3, 0.1)
    assert list(costs._seconds) == [(2, 3), (4, 3)]  # the least recently used shape went


def test_the_cost_rule_takes_a_cheaper_suffix_round_and_gives_the_drafter_a_round_to_stay_current():
    rule = HybridRule(steps=3, cost=True, explore=3)
    chooser = HybridChooser(rule, prior_suffix=0.8, prior_drafter=0.9)
    # Plain rule: 0.8 < 0.9, the drafter. Cost ratio 1.3: (1 + 0.8) * 1.3 = 2.34 > 1.9, the suffix.
    assert chooser.choose_batch(["r"], [[7, 8, 9]], [[1]], cost_ratio=1.0) == [False]
    chooser.accepted("r", 1)  # drafter 0.9 -> 0.95; the chain offered scores 1 of [7, 5]: 0.8 -> 0.9
    assert chooser.choose_batch(["r"], [[7, 8, 9]], [[1, 7, 5]], cost_ratio=1.3) == [True]
    chooser.accepted("r", 2)  # an offered chain: learned (0.9 -> 1.45)
    assert chooser.requests["r"].expected[SUFFIX] == pytest.approx(1.45)
    # No chain offered: the whole batch on (empty) suffix chains still pays when the drafter is weak.
    weak = HybridChooser(rule, prior_suffix=0.0, prior_drafter=0.1)
    picks = []
    for n in range(5):
        picks.append(weak.choose_batch(["w"], [[5]], [[1] * (n + 1)], cost_ratio=1.3)[0])
        weak.accepted("w", 1 if picks[-1] else 0)  # the short chain's token was accepted: counted only
    assert picks == [True, True, True, False, True]  # the 4th round: the drafter's, to stay current
    assert weak.requests["w"].expected[SUFFIX] == 0.0  # never learned from chains it was not offered
    assert weak.counts("w") == ({SUFFIX: 4, DRAFTER: 1}, {SUFFIX: 4, DRAFTER: 0})
    # A strong drafter keeps the round, whatever it costs; so does a rule without costs.
    strong = HybridChooser(rule, prior_suffix=0.0, prior_drafter=1.5)
    assert strong.choose_batch(["s"], [[]], [[1]], cost_ratio=1.3) == [False]
    plain = HybridChooser(HybridRule(steps=3), prior_suffix=0.0, prior_drafter=0.1)
    assert plain.choose_batch(["p"], [[]], [[1]], cost_ratio=1.3) == [False]


def test_the_cost_rule_weighs_the_whole_batch():
    rule = HybridRule(steps=3, cost=True)
    chooser = HybridChooser(rule, prior_suffix=2.0, prior_drafter=1.0)
    # "a" has a full chain (expected 2), "b" none: all-suffix 3 + 1 = 4 tokens at 1/1.3 of the time
    # (5.2) against a + drafter-b = 3 + 2 = 5: the whole batch goes to the suffix chains.
    assert chooser.choose_batch(["a", "b"], [[1, 2, 3], []], [[0], [0]], cost_ratio=1.3) == [True, True]
    # At ratio 1.2: 4.8 < 5, b keeps its drafter.
    assert chooser.choose_batch(["a", "b"], [[1, 2, 3], []], [[0], [0]], cost_ratio=1.2) == [True, False]
    assert chooser.choose_batch(["a"], [[1, 2, 3]], [[0]], mode="drafter", cost_ratio=2.0) == [False]


def test_a_drafter_that_accepts_too_little_is_retired_for_the_rest_of_the_request():
    rule = HybridRule(steps=3, retire_below=0.5, retire_after=4)
    chooser = HybridChooser(rule)
    for _ in range(3):  # 3 drafter rounds at 0 accepted: not judged yet
        assert not chooser.choose("weak", [], [1])
        chooser.accepted("weak", 0)
    assert not chooser.retired("weak")
    assert not chooser.choose("weak", [], [1])
    chooser.accepted("weak", 1)  # 1 token in 4 drafter rounds: 0.25 < 0.5
    assert chooser.retired("weak")
    # From now on the suffix chain, however short, in every mode; a short one teaches nothing.
    prior = dict(chooser.prior)
    for mode in ("hybrid", "drafter", "suffix"):
        assert chooser.choose("weak", [7], [1, 5], mode=mode)
        assert chooser.accepted("weak", 0) == SUFFIX
    assert chooser.prior == prior and chooser.retired("weak")
    rounds, _ = chooser.counts("weak")
    assert rounds == {SUFFIX: 3, DRAFTER: 4}
    # A drafter that accepts enough is kept; a retired request is forgotten with its state.
    for _ in range(8):
        chooser.choose("good", [], [1])
        chooser.accepted("good", 2)
    assert not chooser.retired("good")
    chooser.forget("weak")
    assert not chooser.retired("weak")


def test_retirement_is_off_by_default():
    chooser = HybridChooser(HybridRule(steps=3))
    for _ in range(100):
        chooser.choose("r", [], [1])
        chooser.accepted("r", 0)
    assert not chooser.retired("r")


def test_chain_score_counts_how_the_contexts_deepest_earlier_match_continued():
    # "1 2 3 4" occurred twice before, continued by 5 6 both times and then once by 7, once by 9.
    text = as_text([1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 9, 0, 8, 3, 4])
    # The deepest earlier match of the context's end is "3 4" (the "8 3 4" never occurred before).
    assert chain_score(text, [5, 6, 7]) == pytest.approx(1 + 1 + 0.5)
    assert chain_score(text, [5, 6, 9]) == pytest.approx(2.5)
    assert chain_score(text, [5, 1, 9]) == pytest.approx(1.0)  # a miss ends the chain: nothing after it counts
    assert chain_score(text, [7, 6, 7]) == 0.0
    assert chain_score(text, []) == 0.0
    # A context whose last token never occurred before scores nothing, however the chain goes.
    assert chain_score(as_text([1, 2, 3, 4, 5]), [1, 2, 3]) == 0.0
    # The deepest match wins over a shallower one that continued differently more often.
    text = as_text([9, 4, 1, 0, 9, 4, 1, 0, 7, 4, 2, 0, 7, 4])
    assert chain_score(text, [2, 0, 7]) == pytest.approx(3.0)  # "7 4" -> 2 0 7 (its one earlier occurrence)
    assert chain_score(text, [1, 0, 9]) == 0.0
    # At most `depth` tokens are matched: with depth 1 only "4" counts (3 earlier occurrences: 1, 1, 2).
    assert chain_score(text, [1, 0, 9], depth=1) == pytest.approx(2 / 3 + 2 / 3 + 1 / 3)


def test_as_text_takes_a_large_vocabulary():
    ids = [0, 151_935, 0xD800, 262_143]  # ids in the surrogate range are characters too
    assert [ord(c) for c in as_text(ids)] == ids


def test_the_chain_score_replaces_the_suffix_average_in_the_choice():
    chooser = HybridChooser(HybridRule(steps=3, score="chain"), prior_suffix=0.0, prior_drafter=1.0)
    # The average says the drafter (0 < 1); a chain the context continued this way twice says the suffix.
    assert chooser.choose("r", [7, 8, 9], [1, 2], score=2.0)
    assert chooser.requests["r"].estimate == 2.0
    chooser.accepted("r", 3)
    assert not chooser.choose("r", [7, 8, 9], [1, 2, 7, 8, 9, 5], score=0.5)  # a weak chain: the drafter
    chooser.accepted("r", 1)
    # Without a score the moving average decides, and so it does under score="average" (the default).
    average = HybridChooser(HybridRule(steps=3), prior_suffix=0.0, prior_drafter=1.0)
    assert not average.choose("r", [7, 8, 9], [1, 2], score=2.0)
    assert not chooser.choose("s", [7, 8, 9], [1, 2])
    with pytest.raises(ValueError, match="hybrid score"):
        HybridRule(steps=3, score="best")


def test_the_context_text_follows_the_request_and_is_rebuilt_when_it_changes():
    chooser = HybridChooser(HybridRule(steps=3))
    prompt = [1, 2, 3, 4, 5, 6, 1, 2]
    assert chooser.score("r", prompt, [], [3, 4, 5]) == pytest.approx(3.0)
    assert chooser.requests["r"].text == as_text(prompt)
    assert chooser.score("r", prompt, [3, 4], [5, 6, 1]) == pytest.approx(3.0)  # extended by the new tokens
    assert chooser.requests["r"].text == as_text(prompt + [3, 4])
    # Retracted and run again with another output: the text is rebuilt, not extended.
    assert chooser.score("r", prompt, [9], [1, 2, 3]) == 0.0
    assert chooser.requests["r"].text == as_text(prompt + [9])
    chooser.forget("r")
    assert "r" not in chooser.requests
    assert chooser.score("e", [], [], [1]) == 0.0 and chooser.requests["e"].text == ""  # nothing to read yet


def test_the_cost_rule_weighs_each_chains_score():
    rule = HybridRule(steps=3, cost=True, score="chain")
    chooser = HybridChooser(rule, prior_suffix=0.0, prior_drafter=1.0)
    # Two requests whose chains score 0.9 (the drafter expects 1.0): the rule gives both the drafter, but
    # the whole batch on suffix chains yields 2 x 1.9 tokens at a round 1.2x cheaper than 2 x 2.0.
    take = chooser.choose_batch(["a", "b"], [[1, 2, 3], [4, 5, 6]], [[0], [0]], cost_ratio=1.2, scores=[0.9, 0.9])
    assert take == [True, True]
    chooser = HybridChooser(rule, prior_suffix=0.0, prior_drafter=1.0)
    take = chooser.choose_batch(["a", "b"], [[1, 2, 3], [4, 5, 6]], [[0], [0]], cost_ratio=1.2, scores=[0.1, 0.1])
    assert take == [False, False]
