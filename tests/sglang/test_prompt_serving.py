"""`--tts-prompt-adapt`: the drafter learns each request's prompt; real SGLang servers on CPU, tiny models.

The prompts carry the loopy target's own greedy continuation (its cycle), so the answer continues
text the prompt already shows: a drafter that learned the prompt drafts the answer's first rounds
better than the frozen one, before any verify round could have taught it.
"""

from __future__ import annotations

import statistics
from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang_tts.bench.server import sglang_server
from sglang_tts.testing.reference import generate_ids, hf_greedy

SEEDS = [[4, 454, 607, 82, 343, 14, 357, 315, 3, 5], [4, 100, 200, 300, 3, 5]]
LEAD = 80  # tokens of the target's own continuation put into the prompt
NEW_TOKENS = 48
CHAIN = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
DETAILS = {"tts_return_accept_lengths": True, "tts_return_weight_digest": True}
PROMPT_FAST = ["--tts-prompt-steps", "20", "--tts-prompt-lr", "1e-2", "--tts-update-stride", "2"]
PROMPT_FAST += ["--tts-prompt-min-positions", "8"]  # these prompts are ~90 tokens


def _args(drafter, *extra):
    return [
        "--speculative-algorithm", "TTS", "--speculative-draft-model-path", str(drafter), "--tts-allow-weight-digest",
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def prompts(loopy_llama):
    return [seed + hf_greedy(str(loopy_llama), seed, LEAD) for seed in SEEDS]


def _serve(model, args, prompts, parallel: bool = False):
    with sglang_server(str(model), args) as server:
        run = lambda p: generate_ids(server.base_url, p, NEW_TOKENS, custom_params=DETAILS)  # noqa: E731
        if parallel:
            with ThreadPoolExecutor(len(prompts)) as pool:
                return list(pool.map(run, prompts))
        return [run(p) for p in prompts]


# One server at a time on 2 cores: each fixture starts its server, runs its requests, stops it.
@pytest.fixture(scope="module")
def frozen(loopy_llama, loopy_eagle3, prompts):
    return _serve(loopy_llama, _args(loopy_eagle3, *CHAIN, "--tts-freeze"), prompts)


@pytest.fixture(scope="module")
def prompt_only(loopy_llama, loopy_eagle3, prompts):
    """The prompts, then the first one again (a prefix-cache hit of all but a few positions), then
    the first one followed by 30 new tokens (a hit on its prefix, the new tokens computed)."""
    args = _args(loopy_eagle3, *CHAIN, "--tts-prompt-adapt", "only", *PROMPT_FAST)
    return _serve(loopy_llama, args, [*prompts, prompts[0], prompts[0] + prompts[1][:30]])


def _accept(result) -> float:
    return statistics.mean(result["meta_info"]["tts_accept_lengths"])


def test_prompt_adaptation_is_lossless(loopy_llama, prompts, frozen, prompt_only):
    for prompt, f, p in zip(prompts, frozen, prompt_only):
        reference = hf_greedy(str(loopy_llama), prompt, NEW_TOKENS)
        assert f["output_ids"] == reference
        assert p["output_ids"] == reference


def test_the_prompt_update_is_reported_and_is_the_only_update(prompts, prompt_only):
    for prompt, result in zip(prompts, prompt_only):
        meta = result["meta_info"]
        # every prompt position this prefill computed (under 512) but the first, which has no token
        # before it on the device (EAGLE-3); a prefix-cache hit's positions were not computed
        assert meta["tts_prompt_positions"] == len(prompt) - meta["cached_tokens"] - 1
        assert meta["tts_prompt_steps"] == 20
        assert meta["tts_prompt_ms"] > 0
        assert meta["tts_num_updates"] == 0 and meta["tts_num_skipped_updates"] == 0


def test_a_prefix_cache_hit_trains_on_the_positions_the_prefill_computed(prompts, prompt_only):
    again, longer = (r["meta_info"] for r in prompt_only[2:4])
    # the same prompt again: the few positions computed are under --tts-prompt-min-positions (8)
    assert again["cached_tokens"] > 0 and len(prompts[0]) - again["cached_tokens"] - 1 < 8
    assert again["tts_prompt_positions"] == 0 and again["tts_prompt_steps"] == 0
    assert again["tts_weight_digest_end"] == again["tts_weight_digest_start"]
    assert prompt_only[2]["output_ids"] == prompt_only[0]["output_ids"]
    # a longer prompt over a cached prefix: it learns the positions it computed, not the cached ones
    assert longer["cached_tokens"] >= len(prompts[0]) - 8
    computed = len(prompts[0]) + 30 - longer["cached_tokens"] - 1
    assert computed >= 8 and longer["tts_prompt_positions"] == computed
    assert longer["tts_prompt_steps"] == 20


def test_the_learned_prompt_changes_the_drafter_and_resets_with_the_request(prompt_only):
    a, b = (r["meta_info"] for r in prompt_only[:2])
    assert a["tts_weight_digest_end"] != a["tts_weight_digest_start"]
    assert b["tts_weight_digest_start"] == a["tts_weight_digest_start"], "scope 'batch' resets to base"
    assert b["tts_weight_digest_end"] != b["tts_weight_digest_start"]


def test_a_drafter_that_learned_the_prompt_drafts_the_answer_better(frozen, prompt_only):
    for f, p in zip(frozen, prompt_only):
        assert f["meta_info"]["tts_prompt_positions"] == 0
        # Measured: frozen ~1.0-1.1 tokens per round on these answers, prompt-adapted ~2-3.
        assert _accept(p) > _accept(f) + 0.5


def test_dflash_learns_the_prompt_too(loopy_llama, loopy_dflash, prompts):
    args = _args(loopy_dflash, "--tts-prompt-adapt", "on", *PROMPT_FAST)
    results = _serve(loopy_llama, args, prompts)
    for prompt, result in zip(prompts, results):
        assert result["output_ids"] == hf_greedy(str(loopy_llama), prompt, NEW_TOKENS)
        meta = result["meta_info"]
        assert meta["tts_prompt_positions"] == len(prompt) - meta["cached_tokens"]
        assert meta["tts_prompt_steps"] == 20
        assert meta["tts_num_updates"] > 0  # "on": verify rounds update too


def test_per_request_adapters_learn_their_own_prompts_side_by_side(loopy_llama, loopy_eagle3, prompts):
    args = _args(loopy_eagle3, *CHAIN, "--tts-scope", "request", "--tts-prompt-adapt", "on", *PROMPT_FAST)
    results = _serve(loopy_llama, args, prompts, parallel=True)
    for prompt, result in zip(prompts, results):
        assert result["output_ids"] == hf_greedy(str(loopy_llama), prompt, NEW_TOKENS)
        meta = result["meta_info"]
        assert meta["tts_prompt_positions"] == len(prompt) - meta["cached_tokens"] - 1
        assert meta["tts_prompt_steps"] == 20
        assert meta["tts_failures"] == 0
