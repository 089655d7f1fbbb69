"""Every request is answered: a battery of ordinary and malformed requests against one TTS server
per drafter shape (EAGLE-3 chain, EAGLE-3 tree, DFlash).

Each server adapts all the time (`--tts-scope global`, stride 1, a large learning rate), so the
battery runs against a drafter that keeps changing. After every request `/health` must answer
200; after the battery, sampling with top-p and with top-k must keep the target's truncated
distribution (now with an updated drafter), greedy output must still equal the target's token for
token, and the server log must hold no traceback.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from sglang_tts.bench.server import sglang_server
from sglang_tts.testing.reference import assert_sampling_keeps_target_distribution, generate_ids, hf_greedy

PROMPT = [4, 100, 200, 300, 3, 5]
GREEDY_TOKENS = 60
STEPS, TOPK, DRAFT_TOKENS = "--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens"
SHAPES = {
    "eagle3-chain": [STEPS, "3", TOPK, "1", DRAFT_TOKENS, "4"],
    "eagle3-tree": [STEPS, "3", TOPK, "2", DRAFT_TOKENS, "6"],
    "dflash": [],
}
ADAPT_ALWAYS = ["--tts-scope", "global", "--tts-update-stride", "1", "--tts-lr", "1e-2"]
READY = "The server is fired up and ready to roll!"


def _post(base_url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """(HTTP status, parsed JSON or the raw SSE text) without raising on 4xx/5xx."""
    req = urllib.request.Request(
        base_url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            raw = r.read().decode()
            return r.status, (raw if body.get("stream") else json.loads(raw))
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode() or "{}")


def _cases(model: str) -> dict[str, tuple[str, dict[str, Any]]]:
    chat = {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16}
    sampled = {**chat, "temperature": 0.7}
    ids = {"input_ids": [4, 5, 6, 7, 8]}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    return {
        "top_p": ("/v1/chat/completions", {**sampled, "top_p": 0.9}),
        "top_k": ("/v1/chat/completions", {**sampled, "top_k": 20}),
        "top_p_top_k_min_p": ("/v1/chat/completions", {**sampled, "top_p": 0.8, "top_k": 5, "min_p": 0.05}),
        "stream_top_p": ("/v1/chat/completions", {**sampled, "top_p": 0.95, "stream": True}),
        "penalties": (
            "/v1/chat/completions",
            {**sampled, "frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.2},
        ),
        "logit_bias": ("/v1/chat/completions", {**sampled, "logit_bias": {"5": 10.0}}),
        "min_tokens": ("/generate", {**ids, "sampling_params": {"max_new_tokens": 16, "min_new_tokens": 12}}),
        "stop_string": ("/v1/chat/completions", {**chat, "stop": ["a", "e"]}),
        "n_2": ("/v1/chat/completions", {**sampled, "top_p": 0.9, "n": 2}),
        "logprobs": ("/v1/chat/completions", {**sampled, "logprobs": True, "top_logprobs": 3}),
        "input_logprobs": (
            "/generate",
            {**ids, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
             "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}},
        ),
        "json_schema": (
            "/v1/chat/completions",
            {**chat, "max_tokens": 24,
             "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}},
        ),
        "empty_text": ("/generate", {"text": "", "sampling_params": {"max_new_tokens": 4}}),
        "empty_ids": ("/generate", {"input_ids": [], "sampling_params": {"max_new_tokens": 4}}),
        "empty_completion": ("/v1/completions", {"model": model, "prompt": "", "max_tokens": 4}),
        "custom_params_list": ("/generate", {**ids, "sampling_params": {"max_new_tokens": 12, "custom_params": ["x"]}}),
        "custom_params_bad_value": (
            "/generate",
            {**ids, "sampling_params": {"max_new_tokens": 12, "custom_params": {"tts_return_accept_lengths": "yes"}}},
        ),
        "digest_not_allowed": (
            "/generate",
            {**ids, "sampling_params": {"max_new_tokens": 12, "custom_params": {"tts_return_weight_digest": True}}},
        ),
    }  # fmt: skip


@pytest.fixture(scope="module", params=list(SHAPES))
def battery(request, loopy_llama, loopy_eagle3, loopy_dflash):
    shape = request.param
    drafter = loopy_dflash if shape == "dflash" else loopy_eagle3
    args = ["--speculative-algorithm", "TTS", "--speculative-draft-model-path", str(drafter), *SHAPES[shape]]
    out: dict[str, Any] = {"shape": shape, "answers": {}, "health": {}}
    with sglang_server(str(loopy_llama), [*args, *ADAPT_ALWAYS]) as server:
        for name, (path, body) in _cases(str(loopy_llama)).items():
            out["answers"][name] = _post(server.base_url, path, body)
            out["health"][name] = server.healthy()
        updated = generate_ids(server.base_url, PROMPT, GREEDY_TOKENS)  # adapts the drafter further
        out["distribution_errors"] = {}
        for truncation in ({"top_p": 0.5}, {"top_k": 3}):
            try:
                assert_sampling_keeps_target_distribution(server.base_url, loopy_llama, PROMPT, **truncation)
            except AssertionError as e:
                out["distribution_errors"][str(truncation)] = str(e)
        out["greedy"] = generate_ids(server.base_url, PROMPT, GREEDY_TOKENS)
        out["updates_before_sampling"] = updated["meta_info"].get("tts_num_updates", 0)
        out["alive"] = server.alive()
        log_path = server.log_path
    out["log"] = log_path.read_text(errors="replace")
    return out


def test_every_request_is_answered_and_the_server_stays_healthy(battery):
    unhealthy = [name for name, ok in battery["health"].items() if not ok]
    assert not unhealthy, f"{battery['shape']}: /health failed after {unhealthy}"
    assert battery["alive"]
    statuses = {name: status for name, (status, _) in battery["answers"].items()}
    rejected = {"empty_text", "empty_ids", "empty_completion"}
    assert {name for name, status in statuses.items() if status != 200} == rejected, statuses
    for name in rejected:
        status, body = battery["answers"][name]
        assert status == 400, (name, status, body)
        assert "empty" in json.dumps(body), (name, body)  # the 400 names the problem


def test_sampling_options_answer_what_they_ask_for(battery):
    answers = {name: body for name, (_, body) in battery["answers"].items()}
    assert len(answers["n_2"]["choices"]) == 2
    assert answers["logprobs"]["choices"][0]["logprobs"]["content"]
    meta = answers["input_logprobs"]["meta_info"]
    assert len(meta["input_token_logprobs"]) == 5 and len(meta["output_token_logprobs"]) == 8
    assert len(answers["min_tokens"]["output_ids"]) >= 12
    stream = answers["stream_top_p"]
    assert stream.rstrip().endswith("data: [DONE]") and stream.count("data: ") > 3
    for name in ("top_p", "top_k", "top_p_top_k_min_p", "penalties", "logit_bias", "json_schema", "stop_string"):
        assert answers[name]["choices"][0]["finish_reason"] in ("stop", "length"), name


def test_malformed_custom_params_are_ignored_with_one_warning_and_tts_still_reports(battery):
    for name in ("custom_params_list", "custom_params_bad_value", "digest_not_allowed"):
        meta = battery["answers"][name][1]["meta_info"]
        assert "tts_num_updates" in meta and meta["tts_failures"] == 0, (name, meta)
        assert "tts_accept_lengths" not in meta and meta.get("tts_weight_digest_start") is None, name
    warnings = [line for line in battery["log"].splitlines() if "ignored in custom_params" in line]
    assert len(warnings) == 3, warnings  # one per request, not one per round
    assert any("--tts-allow-weight-digest" in line for line in warnings)


def test_sampling_keeps_the_truncated_target_distribution_after_updates(battery):
    assert battery["updates_before_sampling"] > 0  # the drafter had been adapting all along
    assert not battery["distribution_errors"], battery["distribution_errors"]


def test_greedy_output_stays_exact_and_the_log_holds_no_traceback(battery, loopy_llama):
    assert battery["greedy"]["output_ids"] == hf_greedy(str(loopy_llama), PROMPT, GREEDY_TOKENS)
    assert battery["greedy"]["meta_info"]["tts_num_updates"] > 0
    serving = battery["log"].split(READY, 1)[-1]  # SGLang's own start-up warm-up race is not ours
    assert "Traceback" not in serving, serving[serving.index("Traceback") - 2000 :][:4000]


def test_an_empty_prompt_is_a_400_without_speculation_too(loopy_llama):
    with sglang_server(str(loopy_llama)) as server:
        status, body = _post(server.base_url, "/generate", {"text": "", "sampling_params": {"max_new_tokens": 4}})
        assert status == 400 and "prompt is empty" in json.dumps(body)
        assert server.healthy()
        again = generate_ids(server.base_url, PROMPT, 8)
        assert again["output_ids"] == hf_greedy(str(loopy_llama), PROMPT, 8)
