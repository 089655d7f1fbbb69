"""`--tts-controller` end to end: a TTS server whose policy switches the draft chain length and the
update stride mid-request stays token-for-token equal to the target's greedy output."""

from __future__ import annotations

import collections

import pytest

from sglang_tts.bench.server import ServerStartError, sglang_server
from sglang_tts.control import Action, ControllerConfig, feature_names, make_policy, read_trace, save_policy
from sglang_tts.testing.reference import generate_ids, hf_greedy

PROMPTS = [[4, 454, 607, 82, 343, 14, 357, 315, 3, 5], [4, 100, 200, 300, 3, 5]]
NEW_TOKENS = 160
# Scripted: chain 1 / stride 1, then chain 3 / stride 3, then no drafting, ... every 3 verify rounds.
ACTIONS = [Action(1, 1), Action(3, 3), Action(0, 1)]
PERSISTENCE = 3


@pytest.fixture(scope="module")
def controlled(loopy_llama, loopy_eagle3, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("controller")
    policy = make_policy("round_robin", ACTIONS, len(feature_names(3)))
    path = save_policy(tmp / "policy.json", policy, ControllerConfig(persistence=PERSISTENCE))
    trace = tmp / "trace.jsonl"
    args = [
        "--speculative-algorithm", "TTS", "--speculative-draft-model-path", str(loopy_eagle3),
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
        "--tts-lr", "1e-2", "--tts-controller", str(path), "--tts-controller-trace", str(trace),
    ]  # fmt: skip
    details = {"tts_return_accept_lengths": True}
    with sglang_server(str(loopy_llama), args) as server:
        results = [generate_ids(server.base_url, p, NEW_TOKENS, custom_params=details) for p in PROMPTS]
        log = server.log_path.read_text(errors="replace")
    return results, read_trace(trace), log


def test_switching_chains_and_strides_mid_request_is_lossless(loopy_llama, controlled):
    results, _, _ = controlled
    for prompt, result in zip(PROMPTS, results):
        assert result["output_ids"] == hf_greedy(str(loopy_llama), prompt, NEW_TOKENS)


def test_the_switches_really_happened(controlled):
    results, (header, records), log = controlled
    assert header["actions"] == [a.to_dict() for a in ACTIONS]
    assert "Switch adaptive runtime state" in log
    # every action ran in turn, for a window of PERSISTENCE rounds each
    assert len(records) >= 2 * NEW_TOKENS // (4 * PERSISTENCE)
    assert [r["action_index"] for r in records[:6]] == [0, 1, 2, 0, 1, 2]
    windows = collections.defaultdict(list)
    for r in records:
        assert r["window"]["rounds"] == PERSISTENCE and r["reward"] > 0
        windows[r["action_index"]].append(r["window"])
    # the engine ran the chosen chain length (a window's first round may still run the previous one)
    for index, ws in windows.items():
        ran = sum(w["num_steps"] * w["rounds"] for w in ws) / sum(w["rounds"] for w in ws)
        assert abs(ran - ACTIONS[index].num_steps) <= 3 / PERSISTENCE
        assert all(w["update_stride"] == ACTIONS[index].update_stride for w in ws)
    # no-drafting rounds commit exactly one token; chain-1 rounds at most two
    for result in results:
        lengths = result["meta_info"]["tts_accept_lengths"]
        assert min(lengths) == 1 and max(lengths) <= 4
        assert result["meta_info"]["tts_num_updates"] > 0


def test_a_corrupt_policy_stops_the_launch_with_a_clear_message(loopy_llama, loopy_eagle3, tmp_path):
    bad = tmp_path / "bad-policy.json"
    bad.write_text('{"format": "sglang-tts-controller-policy", "version": 1, "kind": "linucb"')
    args = ["--speculative-algorithm", "TTS", "--speculative-draft-model-path", str(loopy_eagle3)]
    with pytest.raises(ServerStartError, match="bad-policy.json is not valid JSON"):
        with sglang_server(str(loopy_llama), [*args, "--tts-controller", str(bad)], timeout_s=120):
            pass


def test_sglangs_own_adaptive_rule_runs_tts_losslessly(loopy_llama, loopy_eagle3, tmp_path):
    """`--speculative-adaptive` without a controller: SGLang's acceptance-EMA rule picks the chain length
    of a TTS server (the controller's baseline), with TTS updating the drafter, and stays lossless."""
    config = tmp_path / "adaptive.json"
    config.write_text('{"1": {"candidate_steps": [1, 3], "warmup_batches": 2, "update_interval": 2}}')
    args = [
        "--speculative-algorithm", "TTS", "--speculative-draft-model-path", str(loopy_eagle3),
        "--speculative-num-steps", "1", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2",
        "--tts-lr", "1e-2", "--tts-update-stride", "2", "--tts-cpu-thread",
        "--speculative-adaptive", "--speculative-adaptive-config", str(config),
    ]  # fmt: skip
    details = {"tts_return_accept_lengths": True}
    with sglang_server(str(loopy_llama), args) as server:
        result = generate_ids(server.base_url, PROMPTS[0], NEW_TOKENS, custom_params=details)
        log = server.log_path.read_text(errors="replace")
    assert result["output_ids"] == hf_greedy(str(loopy_llama), PROMPTS[0], NEW_TOKENS)
    # the loopy target is predictable, so the rule lengthens the chain from 1 to 3: rounds of 4 tokens
    assert "Switch adaptive runtime state" in log
    assert max(result["meta_info"]["tts_accept_lengths"]) > 2
    assert result["meta_info"]["tts_num_updates"] > 0
