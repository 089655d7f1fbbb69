"""Seeded sampling on CPU (sglang_tts/platform/cpu/seeded_sampling.py): real SGLang servers, tiny models.

A request's seed makes its sampled answer reproducible, and the seeded verify makes it the same
answer with or without speculation, whatever the drafter drafted: so a sampled benchmark can
compare configurations on the same text, and check it as greedy runs are checked.
"""

from __future__ import annotations

import pytest
import torch

from sglang_tts.bench.server import sglang_server
from sglang_tts.platform.cpu import seeded_sampling
from sglang_tts.testing.reference import assert_sampling_keeps_target_distribution, post_json

PROMPTS = [[4, 454, 607, 82, 343, 14, 357, 315, 3, 5], [4, 100, 200, 300, 3, 5]]
NEW_TOKENS = 64
SEEDS = [11, 12]
# temperature alone (the sampler's noise by token id), with top-p / top-k (by rank), and a low
# temperature at which the loopy target repeats itself, so that the suffix proposer's drafts are accepted
MODES = {
    "t0.8": {"temperature": 0.8},
    "t0.7-top_p0.9-top_k40": {"temperature": 0.7, "top_p": 0.9, "top_k": 40},
    "t0.3-top_k20": {"temperature": 0.3, "top_k": 20},
}
CHAIN = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
TREE = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6"]


def _answers(server, rounds: dict | None = None) -> dict[tuple[str, int, int], list[int]]:
    """Every mode x prompt x seed, one request at a time (batches of equal options are exact too,
    one at a time is what the benchmarks send); each answer's verify rounds appended to `rounds`."""
    out = {}
    for mode, sampling in MODES.items():
        for p, prompt in enumerate(PROMPTS):
            for seed in SEEDS:
                params = {**sampling, "max_new_tokens": NEW_TOKENS, "ignore_eos": True, "sampling_seed": seed}
                res = post_json(server.base_url + "/generate", {"input_ids": prompt, "sampling_params": params})
                out[(mode, p, seed)] = res["output_ids"]
                if rounds is not None:
                    rounds[(mode, p, seed)] = res["meta_info"].get("spec_verify_ct", 0)
    return out


@pytest.fixture(scope="module")
def no_spec_answers(loopy_llama):
    with sglang_server(str(loopy_llama), []) as server:
        first = _answers(server)
        again = _answers(server)
    return first, again


@pytest.fixture(scope="module")
def tts_server(loopy_llama, loopy_eagle3):
    args = ["--speculative-algorithm", "TTS", "--speculative-draft-model-path", str(loopy_eagle3), *CHAIN]
    args += ["--tts-update-stride", "1", "--tts-lr", "1e-2"]  # the drafter changes every round
    args += ["--tts-hybrid", "on"]  # and the suffix proposer drafts what repeats
    with sglang_server(str(loopy_llama), args) as server:
        yield server


@pytest.fixture(scope="module")
def tts_answers(tts_server):
    rounds: dict = {}
    return _answers(tts_server, rounds), rounds


@pytest.fixture(scope="module")
def eagle3_tree_answers(loopy_llama, loopy_eagle3):
    args = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(loopy_eagle3), *TREE]
    with sglang_server(str(loopy_llama), args) as server:
        return _answers(server)


def test_a_seed_makes_a_sampled_answer_reproducible(no_spec_answers):
    first, again = no_spec_answers
    assert first == again
    for mode in MODES:
        for p in range(len(PROMPTS)):
            texts = {tuple(first[(mode, p, s)]) for s in SEEDS}
            assert len(texts) == len(SEEDS)  # other seeds, other samples


def test_seeded_tts_answers_equal_no_speculation_token_for_token(no_spec_answers, tts_answers):
    reference, _ = no_spec_answers
    answers, _ = tts_answers
    assert answers == reference


def test_seeded_eagle3_tree_answers_equal_no_speculation(no_spec_answers, eagle3_tree_answers):
    reference, _ = no_spec_answers
    assert eagle3_tree_answers == reference


def test_seeded_tts_drafted_and_accepted(tts_answers):
    """The equality above is not speculation being idle: at the low temperature, where the text
    repeats, TTS's rounds (hybrid: suffix or drafter) accepted drafted tokens, and the answers of
    every mode went through verify rounds."""
    answers, rounds = tts_answers
    assert rounds.keys() == answers.keys() and min(rounds.values()) > 0
    low = [key for key in answers if key[0] == "t0.3-top_k20"]
    tokens = sum(len(answers[key]) for key in low)
    assert tokens / sum(rounds[key] for key in low) > 1.5, (tokens, [rounds[key] for key in low])


def test_seeds_sample_the_targets_distribution(loopy_llama, tts_server, tts_answers):
    """Over 400 seeds, (t1, t2) of the adapting hybrid TTS server (t2 from the seeded verify, after the
    answers above have moved its drafter) follow the target's exact P(t1, t2) under top-p 0.9."""
    assert_sampling_keeps_target_distribution(tts_server.base_url, loopy_llama, PROMPTS[1], top_p=0.9, first_seed=1000)


def test_a_request_without_a_seed_draws_one_and_keeps_it():
    class Params:
        sampling_seed = None

    class Req:
        sampling_params = Params()

    req, other = Req(), Req()
    seed = seeded_sampling.request_seed(req)
    assert seeded_sampling.request_seed(req) == seed  # kept for the request's life
    assert seeded_sampling.request_seed(other) != seed
    Params.sampling_seed = 7
    assert seeded_sampling.request_seed(Req()) == 7


def test_seeded_target_tokens_follow_the_seed_and_position(monkeypatch):
    from types import SimpleNamespace

    from sglang_tts.platform import cpu

    monkeypatch.syspath_prepend(str(cpu.SHIM_DIR))  # SGLang's seeded noise imports sgl_kernel on CPU

    logits = torch.randn(2 * 3, 50, generator=torch.Generator().manual_seed(0))
    info = SimpleNamespace(
        temperatures=torch.ones(2, 1),
        top_ps=torch.ones(2),
        top_ks=torch.full((2,), 50),
        min_ps=torch.zeros(2),
        sampling_seed=torch.tensor([5, 5]),
        need_top_p_sampling=False,
        need_top_k_sampling=False,
        need_min_p_sampling=False,
    )
    positions = torch.tensor([9, 10, 11, 9, 10, 11])
    a = seeded_sampling.seeded_target_tokens(logits, info, positions, 3)
    assert torch.equal(a, seeded_sampling.seeded_target_tokens(logits, info, positions, 3))
    # the same seed, position and distribution give the same token in any row
    same = logits.clone()
    same[3:] = logits[:3]
    b = seeded_sampling.seeded_target_tokens(same, info, positions, 3)
    assert torch.equal(b[:3], b[3:])
    info.temperatures = torch.full((2, 1), 1e-4)  # near-greedy: the argmax
    assert torch.equal(seeded_sampling.seeded_target_tokens(logits, info, positions, 3), logits.argmax(-1))


def test_a_seeded_sample_that_fails_falls_back_to_the_targets_distribution(monkeypatch, caplog):
    """A seeded verify whose seeded draw raises (here: a batch without seeds) walks against unseeded
    samples of the same distributions instead: the round goes on, its tokens are still the target's
    samples, and the failure is counted and logged once with its traceback."""
    from types import SimpleNamespace

    from sglang_tts.platform import cpu

    monkeypatch.syspath_prepend(str(cpu.SHIM_DIR))
    failures = seeded_sampling.FailureLog()
    monkeypatch.setattr(seeded_sampling, "FAILURES", failures)
    # one request, 2 nodes; over 3 tokens the target puts 0.75 / 0.25 / 0 on tokens 0 / 1 / 2
    logits = torch.log(torch.tensor([[0.75, 0.25, 1e-12], [0.75, 0.25, 1e-12]]))
    info = SimpleNamespace(
        temperatures=torch.ones(1, 1),
        top_ps=torch.ones(1),
        top_ks=torch.full((1,), 3),
        min_ps=torch.zeros(1),
        sampling_seed=None,  # the seeded draw cannot run
        need_top_p_sampling=False,
        need_top_k_sampling=False,
        need_min_p_sampling=False,
    )
    verify = seeded_sampling.SeededVerify(logits=logits, info=info, positions=torch.tensor([4, 5]), width=2)
    with caplog.at_level("ERROR", logger="sglang_tts.sglang.failures"):
        draws = torch.stack([verify.sample() for _ in range(2000)])  # [2000, 2]
    assert failures.counts[seeded_sampling.SITE] == 2000
    assert "TypeError" in failures.last_error[seeded_sampling.SITE]
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1 and "seeded_verify failed" in tracebacks[0].getMessage()
    assert set(draws.unique().tolist()) <= {0, 1}
    share = (draws == 1).float().mean().item()
    assert abs(share - 0.25) < 0.04, share  # 4.5 standard deviations of 4,000 draws
