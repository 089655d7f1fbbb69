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


def truncated(probs: torch.Tensor, top_p: float = 1.0, top_k: int = -1) -> torch.Tensor:
    """The target's sampling distribution under one of top-k / top-p, renormalised: the k most
    likely tokens, or the most likely tokens while the mass before each is <= p (independent of
    the serving code's pivot formulation; ties at the edge do not occur in these tests)."""
    order = probs.argsort(descending=True)
    sorted_probs = probs[order]
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    if top_p < 1.0:
        keep &= (sorted_probs.cumsum(0) - sorted_probs) <= top_p
    out = torch.zeros_like(probs)
    out[order[keep]] = sorted_probs[keep] / sorted_probs[keep].sum()
    return out


def exact_pair_distribution(
    model_path: str, prompt: list[int], top: int = 8, top_p: float = 1.0, top_k: int = -1
) -> dict[tuple[int, int], float]:
    """P(t1, t2 | prompt) of the target at temperature 1 under top-p / top-k, by HF transformers,
    over every pair in the truncated support (at most `top` first and second tokens each)."""
    model = _hf_model(str(model_path))
    with torch.no_grad():
        p1 = truncated(model(torch.tensor([prompt])).logits[0, -1].float().softmax(-1), top_p, top_k)
        pairs = {}
        for t1 in p1.topk(top).indices.tolist():
            if p1[t1] == 0:
                continue
            p2 = truncated(model(torch.tensor([prompt + [t1]])).logits[0, -1].float().softmax(-1), top_p, top_k)
            for t2 in p2.topk(top).indices.tolist():
                if p2[t2] > 0:
                    pairs[(t1, t2)] = float(p1[t1] * p2[t2])
    return pairs


def assert_sampling_keeps_target_distribution(
    base_url: str,
    model_path,
    prompt: list[int],
    n: int = 400,
    top_p: float = 1.0,
    top_k: int = -1,
    first_seed: int | None = None,
) -> None:
    """t2 comes out of the first speculative round (draft, then rejection sampling in verify): the
    joint frequency of (t1, t2) over n samples at temperature 1 must match the target's P(t1, t2)
    under the same top-p / top-k (4.5 binomial standard errors + 0.01) on every pair of probability
    >= 0.03, and no sample may fall outside the truncated support. With `first_seed`, sample i
    carries the seed first_seed + i (the distribution over seeds)."""
    params = {"temperature": 1.0, "top_p": top_p, "top_k": top_k, "max_new_tokens": 2, "ignore_eos": True}
    per_sample = params if first_seed is None else [{**params, "sampling_seed": first_seed + i} for i in range(n)]
    outs = post_json(base_url + "/generate", {"input_ids": [prompt] * n, "sampling_params": per_sample})
    counts: dict[tuple[int, int], int] = {}
    for out in outs:
        key = tuple(out["output_ids"][:2])
        counts[key] = counts.get(key, 0) + 1
    exact = exact_pair_distribution(
        str(model_path), prompt, top=64 if top_p < 1 or top_k > 0 else 8, top_p=top_p, top_k=top_k
    )
    checked = 0
    for pair, p in exact.items():
        if p < 0.03:
            continue
        freq = counts.get(pair, 0) / n
        assert abs(freq - p) < 4.5 * (p * (1 - p) / n) ** 0.5 + 0.01, (pair, freq, p)
        checked += 1
    assert checked >= 2
    covered = sum(counts.get(pair, 0) for pair in exact) / n
    if top_p < 1 or top_k > 0:
        outside = {pair: c for pair, c in counts.items() if pair not in exact}
        assert not outside, f"samples outside the top-p {top_p} / top-k {top_k} support: {outside}"
    else:
        assert covered > 0.8  # the sampled pairs are the target's likely ones
