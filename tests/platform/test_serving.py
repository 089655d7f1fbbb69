"""Real SGLang server processes on CPU serve the tiny fixture models exactly like HF transformers.

Each module-scoped fixture starts one `python -m sglang.launch_server` (the plugin loads through
the entry point, nothing else is injected) and stops it at the end, checking no process survives.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from sglang_tts.bench.server import group_alive, sglang_server
from sglang_tts.testing.reference import generate_ids, hf_greedy, post_json

PROMPTS = ["def hello(name):", "import os\nimport sys\n\nclass Config:", '# Copyright 2024\n"""Utilities for']
NEW_TOKENS = 48


def _prompt_ids(model_path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    return [tok.encode(p) for p in PROMPTS]


def _assert_greedy_equals_hf(base_url: str, model_path, new_tokens: int = NEW_TOKENS) -> list[dict]:
    metas = []
    for ids in _prompt_ids(model_path):
        out = generate_ids(base_url, ids, new_tokens)
        assert out["output_ids"] == hf_greedy(str(model_path), ids, new_tokens)
        metas.append(out["meta_info"])
    return metas


@pytest.fixture(scope="module")
def llama_server(tiny_llama):
    with sglang_server(str(tiny_llama)) as server:
        yield server
    assert not group_alive(server.proc.pid), "server processes survived shutdown"


def test_plain_decoding_matches_hf_llama(llama_server, tiny_llama):
    metas = _assert_greedy_equals_hf(llama_server.base_url, tiny_llama)
    assert all(m["completion_tokens"] == NEW_TOKENS for m in metas)


def test_chat_completions_and_streaming(llama_server, tiny_llama):
    body = {
        "model": str(tiny_llama),
        "messages": [{"role": "user", "content": "Say hello"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    out = post_json(llama_server.base_url + "/v1/chat/completions", body)
    assert out["object"] == "chat.completion"
    assert out["usage"]["completion_tokens"] > 0
    full_text = out["choices"][0]["message"]["content"]

    req = urllib.request.Request(
        llama_server.base_url + "/v1/chat/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    pieces = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:") :])
            for choice in chunk.get("choices", []):
                pieces.append(choice.get("delta", {}).get("content") or "")
    assert len(pieces) > 1, "streaming returned a single chunk"
    assert "".join(pieces) == full_text


def test_plain_decoding_matches_hf_qwen3(tiny_qwen3):
    with sglang_server(str(tiny_qwen3)) as server:
        _assert_greedy_equals_hf(server.base_url, tiny_qwen3, new_tokens=32)


def test_stock_eagle3_tree_is_lossless(tiny_llama, tiny_eagle3):
    args = [
        "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", str(tiny_eagle3),
        "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "2",
        "--speculative-num-draft-tokens", "4",
    ]  # fmt: skip
    with sglang_server(str(tiny_llama), args) as server:
        metas = _assert_greedy_equals_hf(server.base_url, tiny_llama)
    # Speculation really ran: every request went through verify rounds.
    assert all(m["spec_verify_ct"] > 0 for m in metas)
    assert all(m["spec_verify_ct"] <= NEW_TOKENS for m in metas)


def test_real_smollm2_greedy_matches_hf():
    """The default real model (SmolLM2-135M-Instruct, fp32) served on CPU, against HF greedy."""
    from transformers import AutoTokenizer

    from sglang_tts.assets import prepare_default_model

    model = prepare_default_model(progress=False)
    tok = AutoTokenizer.from_pretrained(model)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True
    )
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    with sglang_server(str(model), ["--context-length", "2048"]) as server:
        out = generate_ids(server.base_url, ids, 24)
    assert out["output_ids"] == hf_greedy(str(model), ids, 24)
    assert "Paris" in tok.decode(out["output_ids"])


def test_stock_dflash_block_drafting_is_lossless(tiny_llama, tmp_path):
    import json

    from sglang_tts.drafters.checkpoints import write_tiny_dflash

    target_config = json.loads((tiny_llama / "config.json").read_text())
    drafter = write_tiny_dflash(tmp_path / "dflash", target_config, block_size=4)
    args = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(drafter)]
    with sglang_server(str(tiny_llama), args) as server:
        metas = _assert_greedy_equals_hf(server.base_url, tiny_llama, new_tokens=32)
    assert all(m["spec_verify_ct"] > 0 for m in metas)
