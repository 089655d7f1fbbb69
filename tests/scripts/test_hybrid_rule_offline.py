"""scripts/hybrid_rule_offline.py: the drafter's accepted lengths are read from the row that drafts a round's
tokens, every rule commits the whole answer in its own rounds (the verify's greedy output does not depend
on who proposed), the oracle is never slower than either proposer alone, the chain score takes a copied
span from its first round where the moving average waits, and the report is written."""

from __future__ import annotations

import json

import pytest
import torch
from scripts_testing import load_script

from sglang_tts.core.hybrid import DRAFTER, SUFFIX, HybridChooser
from sglang_tts.sglang.suffix import SuffixProposer


@pytest.fixture(scope="module")
def script():
    return load_script("hybrid_rule_offline")


def test_the_drafters_accepted_length_comes_from_the_row_that_drafts_the_rounds_tokens(script):
    # prompt of 3 tokens, answer of 3: a round at answer position i has a context of 3 + i tokens, and
    # chain_hits row t drafts the tokens at t + 2 on, so it reads row 3 + i - 2.
    hits = torch.tensor(
        [
            [True, True, True],  # row 0
            [True, False, True],  # row 1: answer position 0 -> 1 accepted
            [False, True, True],  # row 2: position 1 -> 0 accepted (the first draft misses)
            [True, True, False],  # row 3: position 2 -> 2 accepted
            [False, False, False],
        ]
    )
    assert script.drafter_accepts(hits, 3, 3) == [1, 0, 2]


PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
ANSWER = [5, 6, 7, 8, *PROMPT, 9, 9, 8]  # new text, then a copy of the prompt


def _walk(script, rule, drafter, ratio=1.11):
    chooser = HybridChooser(script.rule_for(rule, 3))
    return script.walk(rule, "p", "ds", PROMPT, ANSWER, drafter, SuffixProposer(3), chooser, ratio)


def test_every_rule_commits_the_whole_answer_and_the_oracle_is_never_slower(script):
    drafter = [1] * len(ANSWER)  # the drafter lands one token of three everywhere
    walks = {rule: _walk(script, rule, drafter) for rule in script.RULES}
    for w in walks.values():
        assert w.tokens == len(ANSWER)
        assert w.accepted[SUFFIX] + w.accepted[DRAFTER] + w.total_rounds == len(ANSWER)
    assert walks["drafter"].rounds[SUFFIX] == 0 and walks["suffix"].rounds[DRAFTER] == 0
    # One token drafted right per drafter round: 2 tokens a round, the last round cut by the answer's end.
    assert walks["drafter"].total_rounds == (len(ANSWER) + 1) // 2
    for rule in script.RULES:
        assert walks["oracle"].speed(1.11) >= walks[rule].speed(1.11) - 1e-9
    # The copy of the prompt: suffix chains land all three tokens there.
    assert walks["suffix"].accepted[SUFFIX] >= len(PROMPT) - 4


def test_the_chain_score_takes_a_copied_span_before_the_average_does(script):
    drafter = [1] * len(ANSWER)
    chain, average = _walk(script, "chain", drafter), _walk(script, "average", drafter)
    # The average rule starts from a suffix expectation of 0 against the drafter's 1 and needs a round in
    # which the suffix chain's tokens were committed before it trusts it; the copied span's chains score 3.
    assert chain.rounds[SUFFIX] >= 1
    assert chain.total_rounds < average.total_rounds
    assert chain.speed(1.11) > average.speed(1.11)


def test_the_report_is_written(script, tmp_path):
    drafter = [1] * len(ANSWER)
    walks = [_walk(script, rule, drafter) for rule in ("drafter", "average", "chain", "oracle")]
    answers = {"p": {"dataset": "ds", "prompt_tokens": 12, "answer_tokens": 19, "distinct": [1.0] * 4, "loops": False}}
    meta = {
        "model": "m",
        "drafter": "d",
        "chain": 3,
        "answer_tokens": 19,
        "datasets": ["ds"],
        "cost_ratios": [1.11, 1.3],
        "command": "python scripts/hybrid_rule_offline.py",
    }
    script.write_report(tmp_path, meta, walks, answers)
    data = json.loads((tmp_path / "hybrid_rule.json").read_text())
    assert [w["rule"] for w in data["walks"]] == ["drafter", "average", "chain", "oracle"]
    text = (tmp_path / "hybrid_rule.md").read_text()
    assert "| p |" in text and "pooled, answers that do not loop" in text and "at 1.3" in text
    assert (tmp_path / "hybrid_rule.png").stat().st_size > 0
