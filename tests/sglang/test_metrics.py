"""Per-request TTS values travel as token-aligned customized_info and end as meta_info scalars/lists."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_tts.sglang.metrics import finalize_meta_info, write_request_info
from sglang_tts.sglang.requests import RequestOptions
from sglang_tts.sglang.runtime import RequestCounters

ACCEPT = RequestOptions(accept_lengths=True)


def _req(custom=None, output_ids=()):
    return SimpleNamespace(
        customized_info=None, output_ids=list(output_ids), sampling_params=SimpleNamespace(custom_params=custom)
    )


def test_values_align_with_output_tokens_and_finalize_to_scalars_and_rounds():
    req = _req({"tts_return_accept_lengths": True}, output_ids=[7])  # one token from prefill
    counters = RequestCounters()
    for accept_len, updates in ((2, 0), (1, 1), (3, 2)):
        counters.num_updates = updates
        write_request_info(req, counters, accept_len, ACCEPT)
        req.output_ids.extend([0] * accept_len)
    info = req.customized_info
    assert all(len(column) == len(req.output_ids) for column in info.values())
    meta = {key: list(values) for key, values in info.items()}  # what the tokenizer accumulates
    finalize_meta_info(meta)
    assert meta["tts_num_updates"] == 2
    assert meta["tts_accept_lengths"] == [2, 1, 3]


def test_accept_lengths_only_when_asked():
    req = _req(None)
    write_request_info(req, RequestCounters(), 2, RequestOptions())
    assert "tts_accept_lengths" not in req.customized_info
    assert "tts_weight_digest_start" not in req.customized_info


def test_digest_start_is_the_first_round_and_end_the_last():
    req = _req({"tts_return_weight_digest": True})
    counters = RequestCounters()
    write_request_info(req, counters, 1, RequestOptions(weight_digest=True), digest="aaa")
    write_request_info(req, counters, 2, RequestOptions(weight_digest=True), digest="bbb")
    meta = {key: list(values) for key, values in req.customized_info.items()}
    finalize_meta_info(meta)
    assert meta["tts_weight_digest_start"] == "aaa" and meta["tts_weight_digest_end"] == "bbb"


def test_a_round_run_after_the_request_finished_is_not_reported():
    """Overlap scheduling runs one more round for a request that just finished; SGLang drops its
    tokens (completion_tokens counts the kept ones), so its values are dropped too."""
    req = _req({"tts_return_accept_lengths": True}, output_ids=[7])
    for accept_len in (2, 4, 3):  # the third round ran after the request had finished
        write_request_info(req, RequestCounters(), accept_len, ACCEPT)
    meta = {key: list(values) for key, values in req.customized_info.items()} | {"completion_tokens": 7}
    finalize_meta_info(meta)
    assert meta["tts_accept_lengths"] == [2, 4]


def test_rounds_stay_aligned_when_output_ids_lag_behind_the_worker():
    """Under the overlap scheduler the worker runs round n+1 before the scheduler appended round n's
    tokens (or even the prefill token) to output_ids; the lists still start after the prefill token."""
    req = _req({"tts_return_accept_lengths": True}, output_ids=[])  # prefill token not appended yet
    for accept_len in (2, 1, 3, 2):  # the last round ran after the request had finished at 7 tokens
        write_request_info(req, RequestCounters(), accept_len, ACCEPT)
    meta = {key: list(values) for key, values in req.customized_info.items()} | {"completion_tokens": 7}
    finalize_meta_info(meta)
    assert meta["tts_accept_lengths"] == [2, 1, 3]
