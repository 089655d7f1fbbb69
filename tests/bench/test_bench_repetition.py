"""Distinct n-gram share: how the benchmark flags outputs that loop."""

from __future__ import annotations

import pytest

from sglang_tts.bench.repetition import distinct_by_quarter, distinct_ngram_share


def test_distinct_share_is_one_for_new_text_and_period_over_length_for_a_loop():
    assert distinct_ngram_share("the cat sat on the mat and then slept".split()) == 1.0
    loop = "a b c d e".split() * 20  # period 5: 97 four-grams, 5 distinct
    assert distinct_ngram_share(loop) == pytest.approx(5 / 97)
    assert distinct_ngram_share("too short".split()) is None


def test_quarters_separate_an_answer_from_the_loop_after_it():
    answer = " ".join(f"step{i}" for i in range(60))
    text = answer + " " + " ".join(["so the answer is 4 ."] * 4)  # 60 words, then 24 looping ones
    quarters = distinct_by_quarter(text)
    assert quarters[:2] == [1.0, 1.0]
    assert quarters[3] is not None and quarters[3] < 0.5
    assert distinct_by_quarter("") == [None, None, None, None]
