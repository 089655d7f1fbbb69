"""Reference outputs from Hugging Face transformers, and small HTTP helpers for SGLang servers."""

from __future__ import annotations

import functools
import json
import urllib.request
from typing import Any

import torch


@functools.lru_cache(maxsize=4)
def _hf_model(model_path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    return model


def hf_greedy(model_path: str, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by HF transformers (fp32, KV cache), without EOS stopping."""
    model = _hf_model(str(model_path))
    ids = torch.tensor([input_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(input_ids) :].tolist()


def post_json(url: str, payload: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def generate_ids(base_url: str, input_ids: list[int], max_new_tokens: int, **sampling: Any) -> dict[str, Any]:
    """SGLang native /generate with token ids; greedy unless sampling params say otherwise.
    `ignore_eos` keeps lengths comparable with the HF reference."""
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **sampling}
    return post_json(base_url + "/generate", {"input_ids": input_ids, "sampling_params": params})
