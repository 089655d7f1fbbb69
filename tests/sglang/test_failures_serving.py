"""Nothing TTS does inside SGLang's scheduler can take it down: with faults injected at every
scheduler-thread site, the server answers every request with exactly the target's output, counts
the failures per site (Prometheus) and per request (meta_info), and logs one traceback per site."""

from __future__ import annotations

import json
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang_tts.bench.server import sglang_server
from sglang_tts.sglang.failures import FAULT_SITES_ENV
from sglang_tts.testing.reference import generate_ids, hf_greedy

PROMPTS = [[4, 454, 607, 82, 343, 14, 357, 315, 3, 5], [4, 100, 200, 300, 3, 5]]
NEW_TOKENS = 80
CHAIN = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
PROMPT = ["--tts-prompt-adapt", "on", "--tts-prompt-min-positions", "1"]  # these prompts are 6-10 tokens
SETUPS = {
    # per-request adapters: the adapter map and the hooks inside SGLang's draft forward run too
    # with prompt adaptation: the prompt windows at prefill and the prompt update's submission
    "eagle3-request": (
        "eagle3",
        [*CHAIN, "--tts-scope", "request", "--tts-adapter-lr", "1e-2", *PROMPT],
        "barrier:5,capture:4,report:7,prefill_anchor:1,adapter_map:1,adapter_hook:9,prompt_capture:1",
    ),
    "dflash-batch": (
        "dflash",
        PROMPT,
        "barrier:5,capture:4,report:7,prompt:1",
    ),
}


@pytest.fixture(scope="module", params=list(SETUPS))
def faulty(request, loopy_llama, loopy_eagle3, loopy_dflash):
    kind, extra, sites = SETUPS[request.param]
    drafter = loopy_eagle3 if kind == "eagle3" else loopy_dflash
    args = [
        "--speculative-algorithm", "TTS", "--speculative-draft-model-path", str(drafter), *extra,
        "--tts-update-stride", "2", "--tts-lr", "1e-2", "--enable-metrics",
    ]  # fmt: skip
    with sglang_server(str(loopy_llama), args, env={FAULT_SITES_ENV: sites}) as server:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # batched: failures hit both requests' rounds
            results = list(pool.map(lambda p: generate_ids(server.base_url, p, NEW_TOKENS), PROMPTS))
        with urllib.request.urlopen(server.base_url + "/metrics", timeout=60) as r:
            metrics = r.read().decode()
        healthy = server.healthy()
        log_path = server.log_path
    return {"sites": dict(s.split(":") for s in sites.split(",")), "results": results, "metrics": metrics,
            "healthy": healthy, "log": log_path.read_text(errors="replace")}  # fmt: skip


def test_outputs_stay_the_targets_and_the_server_healthy(faulty, loopy_llama):
    assert faulty["healthy"]
    for prompt, result in zip(PROMPTS, faulty["results"]):
        assert result["output_ids"] == hf_greedy(str(loopy_llama), prompt, NEW_TOKENS)
        assert result["meta_info"]["tts_failures"] > 0
        assert result["meta_info"]["tts_num_updates"] > 0  # TTS went on adapting between failures


def test_failures_are_counted_per_site(faulty):
    counted = {}
    for line in faulty["metrics"].splitlines():
        match = re.match(r'sglang_tts:failures_total\{.*site="(\w+)".*\} ([0-9.e+]+)', line)
        if match:
            counted[match.group(1)] = counted.get(match.group(1), 0.0) + float(match.group(2))
    assert set(faulty["sites"]) <= {site for site, n in counted.items() if n > 0}, counted


def test_one_traceback_per_failing_site(faulty):
    first = re.findall(r"sglang-tts: (\w+) failed; TTS skips it", faulty["log"])
    assert sorted(first) == sorted(faulty["sites"]), first
    assert faulty["log"].count("InjectedFault") >= len(faulty["sites"])
    serving = faulty["log"].split("The server is fired up and ready to roll!", 1)[-1]
    assert serving.count("Traceback") == len(faulty["sites"]), json.dumps(first)
