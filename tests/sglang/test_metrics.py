"""Per-request TTS values: written per round into customized_info, sent by SGLang's own output
streamer (request-level for non-streamed requests, sliced per chunk for streams), and turned into
the documented meta_info keys on the tokenizer side. What is stored per request does not grow with
the output unless the request asked for per-round data (`tts_accept_lengths`)."""

from __future__ import annotations

import functools
import pickle
import pkgutil
import random
from types import SimpleNamespace

import pytest
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers.scheduler_components.output_streamer import (
    SchedulerOutputStreamer,
    _GenerationStreamAccumulator,
)
from sglang.srt.managers.tokenizer_manager import TokenizerManager

from sglang_tts.sglang import metrics
from sglang_tts.sglang.metrics import (
    INTERNAL_KEYS,
    REQUEST_LEVEL_KEY,
    ROUNDS_KEPT,
    ROUNDS_KEY,
    SCALAR_KEYS,
    STREAM_KEY,
    TOKENIZER_META_INFO,
    finalize_meta_info,
    request_level_key_hook,
    update_request_meta_info_hook,
    write_request_info,
)
from sglang_tts.sglang.requests import RequestOptions
from sglang_tts.sglang.runtime import RequestCounters

PLAIN = RequestOptions()
ACCEPT = RequestOptions(accept_lengths=True)
DIGEST = RequestOptions(weight_digest=True)
FORCE_STREAM_INTERVAL = 50  # SGLang's default: a non-streamed request's output is sent every 50 tokens


class _Req:
    """The attributes of SGLang's Req that its output streamer reads (no logprobs, no beams)."""

    def __init__(self, stream: bool, output_ids=(), custom=None) -> None:
        self.rid, self.stream, self.customized_info = "r0", stream, None
        self.output_ids = list(output_ids)
        self.sampling_params = SimpleNamespace(
            custom_params=custom,
            stream_interval=None,
            skip_special_tokens=True,
            spaces_between_special_tokens=True,
            no_stop_trim=False,
        )
        self.beam_group, self.finished_output, self.finished_len, self.finished_reason = None, False, None, None
        self.send_token_offset = self.send_output_token_logprobs_offset = self.send_decode_id_offset = 0
        self.origin_input_ids, self.reasoning_tokens, self.cached_tokens = [4, 5, 6], 0, 0
        self.http_worker_ipc, self.decoded_text, self.retraction_count = None, "", 0
        self.weight_version_events, self.time_stats = [], None

    def finished(self) -> bool:
        return self.finished_reason is not None

    def finish(self, length: int) -> None:
        self.finished_reason = SimpleNamespace(to_json=lambda: {"type": "length", "length": length})
        self.finished_len = length

    @property
    def output_ids_through_stop(self) -> list[int]:
        return self.output_ids if self.finished_len is None else self.output_ids[: self.finished_len]

    def check_match_stop_str_prefix(self) -> bool:
        return False

    def init_incremental_detokenize(self):
        return self.output_ids, 0

    def get_mm_token_counts(self):
        return 0, 0, 0


def _emit(req: _Req) -> dict | None:
    """One scheduler step's output for `req` through SGLang's own accumulator (with TTS's hook on
    its request-level test), pickled as it crosses processes; None when SGLang sends nothing."""
    is_request_level = functools.partial(
        request_level_key_hook, SchedulerOutputStreamer.is_request_level_customized_info_key, None
    )
    acc = _GenerationStreamAccumulator(
        return_logprob=False,
        return_hidden_states=False,
        return_routed_experts=False,
        return_indexer_topk=False,
        spec_algorithm=SimpleNamespace(is_none=lambda: True),
        disaggregation_mode=DisaggregationMode.NULL,
        default_stream_interval=1,
        default_force_stream_interval=FORCE_STREAM_INTERVAL,
        get_cached_tokens_details=lambda req: None,
        is_request_level_customized_info_key=is_request_level,
        current_weight_version=None,
    )
    acc.accept(req=req)
    if not acc.rids:
        return None
    customized_info = pickle.loads(pickle.dumps(acc.customized_info))
    return {"completion_tokens": acc.completion_tokens[0], "customized_info": customized_info}


class _Tokenizer:
    """The tokenizer side of one request: SGLang's own accumulation, behind TTS's hook."""

    def __init__(self) -> None:
        self.manager = SimpleNamespace(_accumulate_request_meta_info=TokenizerManager._accumulate_request_meta_info)
        self.state = SimpleNamespace(customized_info_accumulated={}, customized_info_reported_keys=set())

    def receive(self, output: dict) -> dict:
        meta_info = {"completion_tokens": output["completion_tokens"]}
        if output["customized_info"]:
            update_request_meta_info_hook(
                TokenizerManager.update_request_meta_info,
                self.manager,
                meta_info,
                self.state,
                output["customized_info"],
                0,
                None,
            )
        return meta_info


def _old_write(columns: dict, output_ids: list, counters: RequestCounters, accept_len: int) -> None:
    """The token-aligned lists written before (the reference: the values at each output token)."""
    already = max(len(output_ids), 1)
    column = columns.setdefault("tts_num_updates", [])
    column.extend([counters.num_updates] * max(already - len(column), 0) + [counters.num_updates] * accept_len)


def _serve(stream: bool, accept_lens: list[int], max_new: int, lag: bool, options=PLAIN, prefix=1):
    """One request through write_request_info (the worker), SGLang's output streamer and the tokenizer.
    `lag`: the overlap scheduler, whose worker runs round n+1 before round n's tokens are appended
    (and before the prefill token is). Returns (meta_info of every output, the reference value at
    each output's last token, the request)."""
    req = _Req(stream, output_ids=[] if lag else [7] * prefix)
    tokenizer, old, outputs = _Tokenizer(), {}, []
    pending = prefix if lag else None
    for n, accept_len in enumerate(accept_lens):
        counters = RequestCounters(num_updates=n, update_ms=n / 4, failures=n % 2)
        write_request_info(req, counters, accept_len, options)
        _old_write(old, req.output_ids, counters, accept_len)
        if lag:
            pending, accept_len = accept_len, pending
        req.output_ids.extend([0] * accept_len)
        if len(req.output_ids) >= max_new:
            req.finish(max_new)
        output = _emit(req)
        if output is not None:
            tokens = output["completion_tokens"]
            outputs.append((tokenizer.receive(output), old["tts_num_updates"][:tokens][-1]))
        if req.finished():
            break
    assert req.finished(), "the test's rounds must reach max_new"
    return outputs, tokenizer, req


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
@pytest.mark.parametrize("lag", [False, True], ids=["", "overlap"])
def test_every_output_reports_the_values_at_its_last_token(stream, lag):
    rng = random.Random(0)
    for _ in range(30):
        accept_lens = [rng.randint(1, 4) for _ in range(60)]
        max_new = rng.randint(2, 60)  # 60 rounds of >= 1 token always get there
        outputs, _, _ = _serve(stream, accept_lens, max_new, lag, options=ACCEPT)
        if not stream:  # SGLang sends a non-streamed request's values once, when it finishes
            outputs = outputs[-1:]
        for meta, expected_updates in outputs:
            assert meta["tts_num_updates"] == expected_updates, meta
            assert all(key in meta for key in SCALAR_KEYS)
            assert not meta.keys() & set(INTERNAL_KEYS)
        meta = outputs[-1][0]
        # the accepted lengths of the rounds whose first token is kept, in order
        kept, start = [], 1
        for accept_len in accept_lens:
            if start >= max_new:
                break
            kept.append(accept_len)
            start += accept_len
        assert meta["tts_accept_lengths"] == kept


def test_a_streams_chunks_report_the_values_so_far_and_the_last_chunk_the_final_ones():
    outputs, _, _ = _serve(True, [2] * 20, 31, lag=False, options=ACCEPT)
    updates = [meta["tts_num_updates"] for meta, _ in outputs]
    assert updates == [expected for _, expected in outputs]
    assert updates == sorted(updates) and updates[-1] == 14  # the 15th round covers token 30
    assert outputs[-1][0]["completion_tokens"] == 31


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_what_a_request_stores_does_not_grow_with_its_output(stream):
    """Without per-round data asked for, the request's customized_info holds the last few rounds,
    not a value per output token; the tokenizer keeps none of it between outputs."""
    sizes = {}
    for rounds in (100, 1000):
        outputs, tokenizer, req = _serve(stream, [3] * rounds, 3 * rounds + 1, lag=False)
        info = req.customized_info
        assert set(info) == {STREAM_KEY if stream else ROUNDS_KEY}  # no per-token list of any key
        kept = info[STREAM_KEY].rounds if stream else info[ROUNDS_KEY]
        assert len(kept) == ROUNDS_KEPT
        assert tokenizer.state.customized_info_accumulated == {}
        assert outputs[-1][0]["tts_num_updates"] == rounds - 1
        sizes[rounds] = len(pickle.dumps(info))
    assert sizes[1000] <= sizes[100] + 16  # the same rounds kept; only the numbers in them are larger


def test_per_round_data_is_kept_only_when_asked():
    _, _, plain = _serve(False, [2] * 10, 21, lag=False)
    assert set(plain.customized_info) == {ROUNDS_KEY}
    _, tokenizer, asked = _serve(False, [2] * 10, 21, lag=False, options=ACCEPT)
    assert len(asked.customized_info["tts_accept_lengths"]) == 21  # token-aligned: what SGLang slices
    assert set(tokenizer.state.customized_info_accumulated) == {"tts_accept_lengths"}


def test_digest_start_is_the_first_round_and_end_the_last():
    req = _Req(False, output_ids=[7])
    counters = RequestCounters()
    for digest in ("aaa", "bbb"):
        write_request_info(req, counters, 1, DIGEST, digest=digest)
        req.output_ids.append(0)
    meta = {"completion_tokens": 3}
    finalize_meta_info(meta, {ROUNDS_KEY: req.customized_info[ROUNDS_KEY]})
    assert meta["tts_weight_digest_start"] == "aaa" and meta["tts_weight_digest_end"] == "bbb"
    meta = {"completion_tokens": 3}
    finalize_meta_info(meta, {ROUNDS_KEY: _written(False, RequestOptions())})
    assert "tts_weight_digest_start" not in meta and meta["tts_num_updates"] == 0


def _written(stream: bool, options: RequestOptions):
    req = _Req(stream, output_ids=[7])
    write_request_info(req, RequestCounters(), 2, options)
    return req.customized_info[STREAM_KEY if stream else ROUNDS_KEY]


def test_a_request_without_rounds_reports_zeros_beside_one_with_rounds():
    """In a batch where another request has TTS values, SGLang pads this one's: [] for a
    request-level key, a None per token for a token-level one. It reports zeros, as before."""
    for padding in ({ROUNDS_KEY: []}, {STREAM_KEY: [None, None]}):
        meta = {"completion_tokens": 2}
        finalize_meta_info(meta, padding)
        assert {key: meta[key] for key in SCALAR_KEYS} == dict.fromkeys(SCALAR_KEYS, 0)
    meta = {"completion_tokens": 1}
    finalize_meta_info(meta, {})  # no TTS values in the batch at all (a request finished at prefill)
    assert meta == {"completion_tokens": 1}


def test_only_the_rounds_key_is_request_level_and_the_hooks_target_sglang_0_5_23():
    original = SchedulerOutputStreamer.is_request_level_customized_info_key
    assert request_level_key_hook(original, None, ROUNDS_KEY) is True
    for key in (STREAM_KEY, "tts_accept_lengths", "some_other_key"):
        assert request_level_key_hook(original, None, key) is False
    for target in (REQUEST_LEVEL_KEY, TOKENIZER_META_INFO):
        assert callable(pkgutil.resolve_name(target))
    registered = []
    metrics.register_hooks(SimpleNamespace(register=lambda *a: registered.append(a)), SimpleNamespace(AROUND="around"))
    assert {(t, h) for t, h, _ in registered} == {
        (REQUEST_LEVEL_KEY, request_level_key_hook),
        (TOKENIZER_META_INFO, update_request_meta_info_hook),
    }


def test_a_stream_column_answers_slices_only():
    column = _written(True, RequestOptions())
    assert column[0:3] == [column.rounds[-1][2]] and column[0:0] == []
    with pytest.raises(TypeError):
        column[0]
