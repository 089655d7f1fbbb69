"""scripts/sibling_context_offline.py: the round-by-round simulation of the suffix proposer keeps exactly
the chain tokens an answer confirms, and each context's trie holds what its docstring says (a sample alone,
its siblings in flight, its queued siblings' whole answers, or every earlier prompt's)."""

from __future__ import annotations

import pytest
from scripts_testing import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("sibling_context_offline")


PROMPT = [1, 2, 3]
SHARED = list(range(100, 130))  # a 30-token phrase both siblings write


def tokens_per_sample(rows, pid="p"):
    (row,) = [r for r in rows if r.prompt == pid]
    return row


def test_a_sample_alone_drafts_only_from_its_prompt_and_its_own_answer(script):
    prompt = [1, 2, 3, 4, 5, 6]
    answer = [7, 8, 9, 1, 2, 3, 4, 5]  # new tokens, then a copy of the prompt
    (row,) = script.simulate([("p", prompt, [answer])], "request", chain=3)
    # 7, 8, 9 and 1 one round each (nothing in the trie continues them); after "1" the prompt's n-grams
    # draft 2 3 4, all kept, and the target's own token 5 ends the answer: 5 rounds for 8 tokens
    assert (row.rounds, row.tokens, row.samples) == (5, 8, 1)
    assert row.per_sample == [1.6] and row.tokens_per_round == pytest.approx(1.6)
    assert 0 < row.full_chain_share < 1


def test_siblings_in_flight_share_what_they_have_written_so_far(script):
    a = [50, *SHARED]
    b = [60, 61, 62, 63, 64, *SHARED]  # writes the phrase 4 rounds after its sibling
    groups = [("p", PROMPT, [a, b])]
    alone = tokens_per_sample(script.simulate(groups, "request", chain=3))
    shared = tokens_per_sample(script.simulate(groups, "group", chain=3))
    assert alone.per_sample == [1.0, 1.0]  # nothing repeats within an answer: one token a round
    assert shared.per_sample[0] == 1.0  # the leader has nothing to copy
    # the follower drafts the phrase up to where its sibling has written it: it catches up (4 rounds saved),
    # then both write one new token a round
    assert shared.per_sample[1] == pytest.approx(len(b) / (len(b) - 4), abs=1e-3)


def test_queued_siblings_draft_from_earlier_whole_answers(script):
    a = [50, *SHARED]
    b = [60, *SHARED]
    groups = [("p", PROMPT, [a, b])]
    in_flight = tokens_per_sample(script.simulate(groups, "group", chain=3))
    queued = tokens_per_sample(script.simulate(groups, "group-slots", chain=3, slots=1))
    assert queued.per_sample[0] == 1.0  # the first runs alone
    # the second: its own first token, then the phrase's first, one round each; then the rest of the phrase
    # from the first's whole answer, 4 tokens a round (29 tokens in 8 rounds): 31 tokens in 10 rounds
    assert queued.per_sample[1] == pytest.approx(len(b) / 10)
    assert queued.per_sample[1] > max(in_flight.per_sample)


def test_the_server_context_keeps_earlier_prompts_answers_and_pooling_weighs_rounds(script):
    groups = [("p", PROMPT, [[50, *SHARED]]), ("q", [9, 9], [[70, *SHARED]])]
    rows = script.simulate(groups, "server", chain=3)
    assert tokens_per_sample(rows, "p").per_sample == [1.0]
    assert tokens_per_sample(rows, "q").per_sample[0] > 3.0  # q's answer repeats p's, from another prompt
    request = script.simulate(groups, "request", chain=3)
    assert tokens_per_sample(request, "q").per_sample == [1.0]
    total = script.pooled(rows, "server")
    assert total.rounds == sum(r.rounds for r in rows) and total.tokens == sum(r.tokens for r in rows)
    assert total.tokens_per_round == pytest.approx(total.tokens / total.rounds)
