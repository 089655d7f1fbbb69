"""Trained tiny drafters agree with their target more than at initialisation.

The random tiny target of the other tests answers with nearly random tokens, which no tiny drafter
can predict; the loopy target (tests/conftest.py: nearly a bigram model, its greedy answers run
into repetitions and cycles) has structure a drafter can pick up in the tiny configuration's few
steps. Both recipes must raise the held-out agreement with the target's greedy tokens and the
greedy acceptance length well above what the untrained drafter gets.
"""

from __future__ import annotations

import pytest

from sglang_tts.training import tiny_request, train_drafters


@pytest.fixture(scope="module")
def loopy_run(loopy_llama, data_config, tmp_path_factory):
    out = tmp_path_factory.mktemp("loopy-run")
    request = tiny_request(
        target=loopy_llama, out=out, data=data_config, cache_dir=out / "data", eval_sequences=2, progress=False
    )
    return train_drafters(request)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_trained_drafter_agrees_with_its_target_more_than_at_init(loopy_run, kind):
    result = loopy_run[kind]
    before, after = result.eval_before, result.eval_after
    # Held-out chains / blocks were actually evaluated.
    assert (before.get("chains") or before.get("blocks") or 0) > 10
    # First draft position: the drafter's greedy pick equals the target's greedy token more often.
    assert after["acc"][0] >= before["acc"][0] + 0.15, (before, after)
    # Every later position improves too, and so does the greedy acceptance length.
    assert all(a > b for a, b in zip(after["acc"], before["acc"])), (before, after)
    assert after["accept_len"] >= before["accept_len"] + 0.25, (before, after)
    assert after["loss"] < 0.5 * before["loss"]
