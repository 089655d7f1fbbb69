"""SGLang's own NGRAM speculation (the benchmark's ``ngram`` configuration) served on CPU.

NGRAM has no drafter: it drafts from a trie of the text generated so far (a C++ corpus that SGLang
compiles with the machine's C++ compiler, cached under ~/.cache/sglang/jit: scripts/setup_env.sh builds it,
so that no server launch pays for the compile). Its verify
goes through the CPU layer: the stand-in's ``reconstruct_indices_from_tree_mask``, the torch-native
verify attention and, for a sampled request, the PyTorch tree sampler. The server is launched with
exactly the flags of ``bench_long.py --configs ngram``.
"""

from __future__ import annotations

from sglang_tts.bench.configs import NGRAM_DRAFT_TOKENS, build_configs
from sglang_tts.bench.runner import flush_cache, get_json
from sglang_tts.bench.server import group_alive, sglang_server
from sglang_tts.testing.reference import generate_ids, hf_greedy

PROMPTS = ["def hello(name):", "import os\nimport sys\n\nclass Config:", '# Copyright 2024\n"""Utilities for']
NEW_TOKENS = 128  # loopy_llama falls into a cycle within the first 50 tokens of each prompt


def test_ngram_is_lossless_answers_sampled_requests_and_drafts_loops(loopy_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(loopy_llama)
    prompts = [tok.encode(p) for p in PROMPTS]
    (config,) = build_configs(["ngram"], ["eagle3"], {})
    with sglang_server(str(loopy_llama), config.server_args) as server:
        info = get_json(server.base_url + "/server_info")  # what bench_long.py --base-url checks
        assert info["speculative_algorithm"] == "NGRAM"
        assert info["speculative_num_draft_tokens"] == NGRAM_DRAFT_TOKENS
        metas = []
        for ids in prompts:
            flush_cache(server.base_url)  # each prompt drafts from its own text, as in the benchmark
            out = generate_ids(server.base_url, ids, NEW_TOKENS)
            # Greedy output is the target's, token for token (HF greedy: what no-spec serves).
            assert out["output_ids"] == hf_greedy(str(loopy_llama), ids, NEW_TOKENS)
            metas.append(out["meta_info"])
        # The corpus is server-wide: the same prompt again drafts its whole answer; after a flush it
        # starts from nothing again (why the benchmark flushes before every ngram request).
        again = generate_ids(server.base_url, prompts[0], NEW_TOKENS)["meta_info"]
        flush_cache(server.base_url)
        fresh = generate_ids(server.base_url, prompts[0], NEW_TOKENS)["meta_info"]
        sampled = generate_ids(server.base_url, prompts[1], NEW_TOKENS, temperature=0.7, top_p=0.95)
    assert not group_alive(server.proc.pid), "server processes survived shutdown"

    for meta in metas:
        rounds = meta["spec_verify_ct"]
        assert 0 < rounds < NEW_TOKENS
        # More than one token per verify round on a looping output (about 2-3 with 4 verified tokens).
        assert meta["completion_tokens"] / rounds > 1.5
        assert meta["spec_accept_length"] > 1.5
    assert again["spec_verify_ct"] < metas[0]["spec_verify_ct"]
    assert fresh["spec_verify_ct"] == metas[0]["spec_verify_ct"]
    meta = sampled["meta_info"]
    assert meta["completion_tokens"] == NEW_TOKENS and len(sampled["output_ids"]) == NEW_TOKENS
    assert meta["spec_verify_ct"] > 0
