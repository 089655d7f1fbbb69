"""`--tts-hybrid on` end to end: real SGLang servers on CPU, tiny models.

The loopy target's greedy output settles into a short cycle after ~40 tokens: text the suffix
proposer drafts whole once it has seen one cycle, while the random drafter accepts ~1 token per
round. The hybrid must stay lossless (greedy: the target's tokens; sampled: the target's
distribution, in a batch that mixes proposers), take the suffix chain there, report both
proposers per request, and keep training the drafter.
"""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang_tts.bench.runner import flush_cache
from sglang_tts.bench.server import sglang_server
from sglang_tts.sglang.hybrid import SPLIT_ENV
from sglang_tts.testing.reference import assert_sampling_keeps_target_distribution, generate_ids, hf_greedy

PROMPTS = [[4, 454, 607, 82, 343, 14, 357, 315, 3, 5], [4, 100, 200, 300, 3, 5]]
NEW_TOKENS = 200
CHAIN = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
HYBRID_KEYS = ("tts_suffix_rounds", "tts_suffix_accepted", "tts_drafter_rounds", "tts_drafter_accepted")


def _args(drafter, *extra):
    return ["--speculative-algorithm", "TTS", "--speculative-draft-model-path", str(drafter), *CHAIN, *extra]


def _run(server, prompt):
    return generate_ids(server.base_url, prompt, NEW_TOKENS, custom_params={"tts_return_accept_lengths": True})


@pytest.fixture(scope="module")
def hybrid_frozen(loopy_llama, loopy_eagle3):
    env = {"SGLANG_TTS_CHECK_FALLBACK": "1"}  # re-predicts the drafter's rows (the suffix rows are left out)
    args = _args(loopy_eagle3, "--tts-freeze", "--tts-hybrid", "on", "--enable-metrics")
    with sglang_server(str(loopy_llama), args, env=env) as server:
        results = [_run(server, p) for p in PROMPTS]
        with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as response:
            prom = response.read().decode()
        return results, prom


@pytest.fixture(scope="module")
def frozen(loopy_llama, loopy_eagle3):
    with sglang_server(str(loopy_llama), _args(loopy_eagle3, "--tts-freeze")) as server:
        return [_run(server, p) for p in PROMPTS]


def test_hybrid_output_is_the_targets_and_reports_both_proposers(loopy_llama, hybrid_frozen, frozen):
    results, prom = hybrid_frozen
    for prompt, out, base in zip(PROMPTS, results, frozen):
        assert out["output_ids"] == hf_greedy(str(loopy_llama), prompt, NEW_TOKENS)
        meta = out["meta_info"]
        assert all(key in meta for key in HYBRID_KEYS)
        assert meta["tts_suffix_rounds"] + meta["tts_drafter_rounds"] == meta["spec_verify_ct"]
        assert meta["tts_suffix_rounds"] > 0 and meta["tts_drafter_rounds"] > 0
        # On the cycle the suffix chain is accepted whole, the random drafter's about never.
        suffix_rate = meta["tts_suffix_accepted"] / meta["tts_suffix_rounds"]
        drafter_rate = meta["tts_drafter_accepted"] / meta["tts_drafter_rounds"]
        assert suffix_rate > 2.0 > drafter_rate + 1
        assert meta["tts_fallback_checked"] > 0 and meta["tts_fallback_mismatches"] == 0
        # Fewer verify rounds for the same tokens than the frozen drafter alone.
        assert meta["spec_verify_ct"] < 0.6 * base["meta_info"]["spec_verify_ct"]
        assert "tts_suffix_rounds" not in base["meta_info"]  # only hybrid servers report proposers
    assert 'sglang_tts:proposer_rounds_total{proposer="suffix"}' in prom
    assert 'sglang_tts:proposer_accepted_tokens_total{proposer="drafter"}' in prom


def test_hybrid_tts_keeps_training_and_stays_lossless(loopy_llama, loopy_eagle3):
    """At stride 1 every round is a stride: by default (idle updates skipped) only the rounds the drafter
    drafted train, and once the output cycles the suffix proposer drafts the rest; with `run` the
    suffix proposer's rounds train too; with `--tts-hybrid-train drafter` they make no canvas. The first
    server weighs the suffix side by the chain's score (`--tts-hybrid-score chain`), the others by its
    moving average (the default)."""
    for train, idle, score in (("all", "skip", "chain"), ("all", "run", "average"), ("drafter", "run", "average")):
        args = _args(loopy_eagle3, "--tts-hybrid", "on", "--tts-hybrid-train", train, "--tts-update-stride", "1")
        args += ["--tts-hybrid-score", score]
        with sglang_server(str(loopy_llama), [*args, "--tts-hybrid-idle-updates", idle]) as server:
            out = _run(server, PROMPTS[0])
        assert out["output_ids"] == hf_greedy(str(loopy_llama), PROMPTS[0], NEW_TOKENS)
        meta = out["meta_info"]
        assert meta["tts_suffix_rounds"] > 0
        assert meta["tts_num_updates"] > 0 and meta["tts_failures"] == 0
        if idle == "skip":
            assert meta["tts_num_updates"] <= meta["tts_drafter_rounds"]
            assert 0 < meta["tts_idle_updates"] <= meta["spec_verify_ct"] - meta["tts_num_updates"]
        else:
            assert meta["tts_idle_updates"] == 0
        if train == "all" and idle == "run":  # the suffix proposer's rounds are trained on as well
            assert meta["tts_num_updates"] > meta["tts_drafter_rounds"]
        if train == "drafter":  # only the drafter's rounds make canvases: fewer updates than rounds
            assert meta["tts_num_updates"] <= meta["tts_drafter_rounds"]


def test_weighing_round_costs_stays_lossless_and_reports_the_measured_rounds(loopy_llama, loopy_eagle3):
    args = _args(loopy_eagle3, "--tts-hybrid", "on", "--tts-hybrid-cost", "on", "--enable-metrics")
    with sglang_server(str(loopy_llama), args) as server:
        outs = [_run(server, p) for p in PROMPTS]
        with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as response:
            prom = response.read().decode()
    for prompt, out in zip(PROMPTS, outs):
        assert out["output_ids"] == hf_greedy(str(loopy_llama), prompt, NEW_TOKENS)
        meta = out["meta_info"]
        assert meta["tts_suffix_rounds"] + meta["tts_drafter_rounds"] == meta["spec_verify_ct"]
        assert meta["tts_failures"] == 0
    seconds = {
        kind: float(line.split()[-1])
        for line in prom.splitlines()
        for kind in ("suffix", "drafter")
        if line.startswith(f'sglang_tts:hybrid_round_seconds{{kind="{kind}"}}')
    }
    assert set(seconds) == {"suffix", "drafter"} and all(0 < v < 30 for v in seconds.values())


def test_a_retired_drafter_stops_drafting_extending_and_training_and_output_stays_the_targets(
    loopy_llama, loopy_eagle3
):
    """The random drafter accepts under 1 token a round, below a retirement bar of 5: after its 4th
    round (the rule's priors give a fresh server's request to the drafter first) each request verifies
    suffix chains only, its draft-extend stops (one request at a time:
    every round's batch is all retired) and no canvas of it is trained on; two requests at once
    retire at their own rounds, so some batches mix retired and drafting requests."""
    retire = ["--tts-hybrid-retire-below", "5", "--tts-hybrid-retire-after", "4"]
    args = _args(loopy_eagle3, "--tts-hybrid", "on", "--tts-update-stride", "1", *retire, "--enable-metrics")
    with sglang_server(str(loopy_llama), args) as server:
        alone = []
        for prompt in PROMPTS:  # a flush between requests: each starts from the rule's priors
            alone.append(_run(server, prompt))
            flush_cache(server.base_url)  # waits until the server is idle (a flush while busy is refused: 400)
        with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as response:
            prom = response.read().decode()
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda p: _run(server, p), PROMPTS))
    for prompt, a, b in zip(PROMPTS, alone, together):
        expected = hf_greedy(str(loopy_llama), prompt, NEW_TOKENS)
        assert a["output_ids"] == expected and b["output_ids"] == expected
        for meta in (a["meta_info"], b["meta_info"]):
            assert meta["tts_drafter_retired"] == 1 and meta["tts_failures"] == 0
            assert meta["tts_drafter_rounds"] == 4  # judged at its 4th round, never drafted again
            assert meta["tts_suffix_rounds"] + 4 == meta["spec_verify_ct"]
            assert meta["tts_suffix_rounds"] > 20
        # Stride 1 trains on every round with a canvas: only the rounds before retirement have one.
        assert 0 < a["meta_info"]["tts_num_updates"] <= 4
    assert _prom_value(prom, "sglang_tts:hybrid_retired_requests_total") == len(PROMPTS)
    skipped = _prom_value(prom, "sglang_tts:hybrid_skipped_extends_total")
    rounds_retired = sum(out["meta_info"]["tts_suffix_rounds"] for out in alone)
    assert rounds_retired - len(PROMPTS) <= skipped <= rounds_retired  # every round after the retiring one


def _prom_value(prom: str, name: str) -> float:
    values = [float(line.split()[-1]) for line in prom.splitlines() if line.split(" ")[0] == name]
    assert values, f"{name} not exported"
    return sum(values)


def test_sampling_in_a_batch_that_mixes_proposers_keeps_the_targets_distribution(loopy_llama, loopy_eagle3):
    """Every other request verifies the suffix proposer's chain from its first round (test hook), the
    others the drafter's, in one batch: t2, out of that first round, must follow the target's P(t1, t2),
    plain and under top-p / top-k."""
    args = _args(loopy_eagle3, "--tts-freeze", "--tts-hybrid", "on")
    with sglang_server(str(loopy_llama), args, env={SPLIT_ENV: "1"}) as server:
        assert_sampling_keeps_target_distribution(server.base_url, loopy_llama, PROMPTS[1])
        assert_sampling_keeps_target_distribution(server.base_url, loopy_llama, PROMPTS[1], top_p=0.9, top_k=20)
        meta = generate_ids(server.base_url, PROMPTS[0], 64, temperature=0.7)["meta_info"]
    assert meta["completion_tokens"] == 64


def test_hybrid_refuses_a_tree_at_launch(loopy_llama, loopy_eagle3):
    tree = ["--speculative-num-steps", "2", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "4"]
    args = ["--speculative-algorithm", "TTS", "--speculative-draft-model-path", str(loopy_eagle3), *tree]
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(loopy_llama), "--device", "cpu"]
    out = subprocess.run([*cmd, *args, "--tts-hybrid", "on"], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "--tts-hybrid on needs --speculative-eagle-topk 1 (a chain), got 2" in out.stdout + out.stderr


def test_a_controller_that_chooses_the_proposer_and_the_chain_stays_lossless(loopy_llama, loopy_eagle3, tmp_path):
    """Scripted windows of 3 rounds: the suffix proposer alone at chain 3, the rule at chain 1, the drafter
    alone at chain 3. Each mode must really draft its windows, and the output stay the target's."""
    from sglang_tts.control import Action, ControllerConfig, feature_names, make_policy, read_trace, save_policy

    actions = [Action(3, 2, "suffix"), Action(1, 2, "hybrid"), Action(3, 2, "drafter")]
    policy = make_policy("round_robin", actions, len(feature_names(3, suffix=True)))
    path = save_policy(tmp_path / "policy.json", policy, ControllerConfig(persistence=3))
    trace = tmp_path / "trace.jsonl"
    controller = ["--tts-controller", str(path), "--tts-controller-trace", str(trace)]
    args = _args(loopy_eagle3, "--tts-hybrid", "on", *controller)
    with sglang_server(str(loopy_llama), args) as server:
        results = [_run(server, p) for p in PROMPTS]
        log = server.log_path.read_text(errors="replace")
    assert "Switch adaptive runtime state" in log
    for prompt, out in zip(PROMPTS, results):
        assert out["output_ids"] == hf_greedy(str(loopy_llama), prompt, NEW_TOKENS)
        meta = out["meta_info"]
        rounds = meta["spec_verify_ct"]
        assert meta["tts_suffix_rounds"] + meta["tts_drafter_rounds"] == rounds
        # a third of the windows each: the rule alone would give the cycle to the suffix proposer
        assert meta["tts_drafter_rounds"] >= 0.25 * rounds and meta["tts_suffix_rounds"] >= 0.25 * rounds
        assert meta["tts_failures"] == 0 and meta["tts_num_updates"] > 0
    header, records = read_trace(trace)
    assert header["feature_names"][-2:] == ["suffix_offer", "suffix_expected"]
    assert [Action.from_dict(r["action"]).proposer for r in records[:3]] == ["suffix", "hybrid", "drafter"]
    assert all(r["window"]["mean_suffix_offer"] is not None for r in records)
    assert max(r["window"]["mean_suffix_offer"] for r in records) > 0.5  # the cycle is offered


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "drafter"])
def test_sglangs_batch_size_tiers_switch_the_chain_losslessly(loopy_llama, loopy_eagle3, tmp_path, hybrid):
    """`--speculative-adaptive` with a config of batch-size tiers (SGLang's own: chain 3 alone, chain 1
    from 2 requests): two requests at once, one shorter, so the batch shrinks from 2 to 1 mid-request
    and the chain length switches between rounds. The round TTS plans must have the chain SGLang
    drafts (this once killed the server: the hybrid planned 1-token suffix chains for a 3-token round)."""
    tiers = tmp_path / "tiers.json"
    tiers.write_text('{"1": {"candidate_steps": [3]}, "2": {"candidate_steps": [1]}}')
    adaptive = ["--speculative-adaptive", "--speculative-adaptive-config", str(tiers)]
    # the hybrid launches at chain 1: its suffix chains must still be as long as the longest tier's. The
    # loopy drafter does not draft this prompt until TTS has taught it the loop: synchronous updates every
    # 2 rounds, so that it has learned it by the time the long request runs alone, whatever the timing
    launch = ["--speculative-num-steps", "1", "--speculative-num-draft-tokens", "2"]
    extra = ["--tts-hybrid", "on", *launch] if hybrid else []
    learn = ["--tts-lr", "1e-2", "--tts-update-stride", "2", "--tts-sync"]
    lengths = [NEW_TOKENS, NEW_TOKENS // 4]
    with sglang_server(str(loopy_llama), _args(loopy_eagle3, *learn, *extra, *adaptive)) as server:
        with ThreadPoolExecutor(2) as pool:
            runs = [
                pool.submit(generate_ids, server.base_url, p, n, custom_params={"tts_return_accept_lengths": True})
                for p, n in zip(PROMPTS, lengths)
            ]
            results = [r.result() for r in runs]
        log = server.log_path.read_text(errors="replace")
    assert "Switch adaptive runtime state: steps 1 -> 3" in log and "Scheduler hit an exception" not in log
    for prompt, n, out in zip(PROMPTS, lengths, results):
        assert out["output_ids"] == hf_greedy(str(loopy_llama), prompt, n)
        meta = out["meta_info"]
        assert meta["tts_failures"] == 0
    long = results[0]["meta_info"]["tts_accept_lengths"]
    assert results[0]["meta_info"]["tts_num_updates"] > 0  # TTS trained across the switches
    assert max(long) > 2  # chain-3 rounds ran once it was alone (a chain-1 round commits at most 2 tokens)
    if hybrid:  # whole 3-token suffix chains of the cycle accepted once alone
        assert results[0]["meta_info"]["tts_suffix_rounds"] > 0 and max(long) == 4
