"""`--tts-update-window`: an update trains on the last rounds of its stride, in a real SGLang server
(CPU, tiny models). Lossless, the drafts are the published weights' (fallback self-check), each
update takes about `window` rounds of every request it trains, and the drafter learns at least as
much per update as from the latest round alone (the Qwen replay measures the size of it:
docs/update-cost.md, "Which rounds an update trains on"). Without the flag an EAGLE-3 server trains
on every round of its stride (up to DEFAULT_WINDOW_ROWS rows), per-request adapters and hybrid
drafting included."""

from __future__ import annotations

import statistics
from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang_tts.bench.server import sglang_server
from sglang_tts.config import DEFAULT_UPDATE_WINDOW, DEFAULT_WINDOW_ROWS
from sglang_tts.testing.reference import generate_ids, hf_greedy

PROMPTS = [[4, 454, 607, 82, 343, 14, 357, 315, 3, 5], [4, 100, 200, 300, 3, 5]]
NEW_TOKENS = 240
CHAIN = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
DETAILS = {"tts_return_accept_lengths": True}


def _serve(llama, eagle3, extra: tuple[str, ...], together: bool = False) -> list[dict]:
    """together: the prompts in flight at once (each update stacks both requests' rounds)."""
    args = [
        "--speculative-algorithm", "TTS", "--speculative-draft-model-path", str(eagle3), *CHAIN,
        "--tts-update-stride", "4", "--tts-lr", "1e-2", *extra,
    ]  # fmt: skip
    with sglang_server(str(llama), args, env={"SGLANG_TTS_CHECK_FALLBACK": "1"}) as server:
        with ThreadPoolExecutor(len(PROMPTS) if together else 1) as pool:
            return list(
                pool.map(lambda p: generate_ids(server.base_url, p, NEW_TOKENS, custom_params=DETAILS), PROMPTS)
            )


@pytest.fixture(scope="module")
def runs(loopy_llama, loopy_eagle3):
    return {window: _serve(loopy_llama, loopy_eagle3, ("--tts-update-window", str(window))) for window in (1, 4)}


def test_outputs_are_the_targets_greedy_output(runs, loopy_llama):
    for window in runs:
        for prompt, result in zip(PROMPTS, runs[window]):
            assert result["output_ids"] == hf_greedy(str(loopy_llama), prompt, NEW_TOKENS)


def test_each_update_trains_on_the_rounds_of_its_window_and_drafts_stay_exact(runs):
    for window, results in runs.items():
        for result in results:
            meta = result["meta_info"]
            assert meta["tts_fallback_checked"] > 0 and meta["tts_fallback_mismatches"] == 0
            updates, trained = meta["tts_num_updates"], meta["tts_trained_rounds"]
            assert updates > 5
            if window == 1:
                assert trained == updates
            else:  # 4 rounds per update, less the windows cut short by the request's first rounds
                assert 3 * updates < trained <= 4 * updates


@pytest.fixture(scope="module")
def default_run(loopy_llama, loopy_eagle3):
    """No --tts-update-window: the EAGLE-3 default, with per-request adapters and hybrid drafting."""
    extra = ("--tts-scope", "request", "--tts-adapter-lr", "1e-2", "--tts-hybrid", "on")
    return _serve(loopy_llama, loopy_eagle3, extra, together=True)


def test_the_default_window_serves_adapters_and_the_hybrid_exactly(default_run, loopy_llama):
    assert DEFAULT_UPDATE_WINDOW > 1 and DEFAULT_WINDOW_ROWS >= len(PROMPTS) * 4  # 2 requests x S = 4 rounds
    for prompt, result in zip(PROMPTS, default_run):
        assert result["output_ids"] == hf_greedy(str(loopy_llama), prompt, NEW_TOKENS)
        meta = result["meta_info"]
        assert meta["tts_num_skipped_updates"] == 0
        assert meta["tts_fallback_checked"] > 0 and meta["tts_fallback_mismatches"] == 0  # drafts: its adapter
        updates, trained = meta["tts_num_updates"], meta["tts_trained_rounds"]
        assert updates > 5
        assert 3 * updates < trained <= 4 * updates  # the whole stride of 4 per update


def test_a_window_learns_at_least_as_much_per_update(runs):
    def late(result):
        lengths = result["meta_info"]["tts_accept_lengths"]
        return statistics.mean(lengths[len(lengths) // 2 :])

    assert statistics.mean(map(late, runs[4])) >= statistics.mean(map(late, runs[1])) - 0.05
