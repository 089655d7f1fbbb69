"""sglang_tts.bench.configs and runner: configuration names, launch flags, the schedule, the request path."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from bench_testing import full_configs

from sglang_tts.bench.configs import (
    BenchConfig,
    ConfigError,
    build_configs,
    kinds_needed,
    parse_config_name,
    parse_eagle3_shape,
    parse_variants,
)
from sglang_tts.bench.runner import (
    Response,
    Runner,
    RunnerSettings,
    SamplingSettings,
    Slot,
    mode_label,
    parse_mode,
    plan_schedule,
    record_from_response,
    request_timeout,
    send_generate,
    send_openai,
    split_rounds,
    waves,
)
from sglang_tts.bench.workload import BenchPrompt, interleave


def test_config_names_expand_per_kind_with_their_launch_flags():
    configs = build_configs(
        ["no-spec", "stock", "frozen", "eagle3:tts-s5-sync"],
        ["eagle3", "dflash"],
        {"eagle3": "/e", "dflash": "/d"},
        tts_lr=0.01,
        extra_server_args=["--tts-scope", "global"],
    )
    names = [c.name for c in configs]
    assert names == ["no-spec", "eagle3:stock", "eagle3:frozen", "eagle3:tts-s5-sync", "dflash:stock", "dflash:frozen"]
    by = {c.name: c for c in configs}
    assert by["no-spec"].server_args == ("--tts-scope", "global")
    stock = ("--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "/d")
    assert by["dflash:stock"].server_args == (*stock, "--tts-scope", "global")
    assert "--speculative-num-steps" in by["eagle3:stock"].server_args
    assert "--tts-freeze" in by["eagle3:frozen"].server_args
    sync = by["eagle3:tts-s5-sync"]
    assert sync.stride == 5 and sync.sync and sync.variant == "tts"
    args = list(sync.server_args)
    assert args[args.index("--tts-update-stride") + 1] == "5" and "--tts-sync" in args
    assert args[args.index("--tts-lr") + 1] == "0.01" and args[-2:] == ["--tts-scope", "global"]


def test_scope_suffixes_become_scope_and_adapter_rank_flags():
    configs = build_configs(
        ["frozen", "tts-s5-batch", "tts-s5-request-r8", "tts-s1-sync-global", "tts-s5-request", "tts-s5-request-rfull"],
        ["eagle3"],
        {"eagle3": "/e"},
    )
    by = {c.name: c for c in configs}
    assert list(by) == [
        "eagle3:frozen",
        "eagle3:tts-s5-batch",
        "eagle3:tts-s5-request-r8",
        "eagle3:tts-s1-sync-global",
        "eagle3:tts-s5-request",
        "eagle3:tts-s5-request-rfull",
    ]
    args = list(by["eagle3:tts-s5-request-r8"].server_args)
    assert args[args.index("--tts-scope") + 1] == "request" and args[args.index("--tts-adapter-rank") + 1] == "8"
    assert by["eagle3:tts-s5-request-r8"].scope == "request" and by["eagle3:tts-s5-batch"].scope == "batch"
    full = list(by["eagle3:tts-s5-request-rfull"].server_args)
    assert full[full.index("--tts-adapter-rank") + 1] == "full"
    plain = list(by["eagle3:tts-s5-request"].server_args)
    assert "--tts-adapter-rank" not in plain and plain[plain.index("--tts-scope") + 1] == "request"
    glob = by["eagle3:tts-s1-sync-global"]
    assert glob.sync and glob.stride == 1 and "--tts-sync" in glob.server_args
    assert "--tts-scope" not in by["eagle3:frozen"].server_args and by["eagle3:frozen"].scope is None
    # A configuration survives results.json.
    assert BenchConfig.from_json(by["eagle3:tts-s5-batch"].to_json()) == by["eagle3:tts-s5-batch"]
    (group,) = build_configs(["tts-s5-group-r4"], ["eagle3"], {"eagle3": "/e"})
    args = list(group.server_args)
    assert group.scope == "group" and args[args.index("--tts-scope") + 1] == "group"
    assert args[args.index("--tts-adapter-rank") + 1] == "4"
    with pytest.raises(ConfigError, match="request or group scope"):
        parse_config_name("tts-s5-global-r4")


def test_variant_tags_add_their_flags_last():
    variants = parse_variants(["ctl=--tts-controller /p.json", "lr3=--tts-adapter-lr 3e-3"])
    assert variants == {"ctl": ("--tts-controller", "/p.json"), "lr3": ("--tts-adapter-lr", "3e-3")}
    configs = build_configs(
        ["no-spec+ctl", "frozen", "tts-s5+ctl", "tts-s5-request-r8+lr3+ctl"],
        ["eagle3"],
        {"eagle3": "/e"},
        extra_server_args=["--tts-scope", "global"],
        variants=variants,
    )
    by = {c.name: c for c in configs}
    assert list(by) == ["no-spec+ctl", "eagle3:frozen", "eagle3:tts-s5+ctl", "eagle3:tts-s5-request-r8+lr3+ctl"]
    assert by["no-spec+ctl"].server_args == ("--tts-scope", "global", "--tts-controller", "/p.json")
    tagged = list(by["eagle3:tts-s5-request-r8+lr3+ctl"].server_args)
    assert tagged[-4:] == ["--tts-adapter-lr", "3e-3", "--tts-controller", "/p.json"]
    assert "--tts-controller" not in by["eagle3:frozen"].server_args
    with pytest.raises(ConfigError, match=r"uses \+nope, which no --variant defines"):
        build_configs(["tts-s5+nope"], ["eagle3"], {"eagle3": "/e"}, variants=variants)
    for bad in (["ctl"], ["c tl=--x"], ["a=--x", "a=--y"]):
        with pytest.raises(ConfigError, match="--variant"):
            parse_variants(bad)


def test_eagle3_shape_chooses_the_draft_shape_flags():
    def flags(shape):
        config = build_configs(["tts-s5"], ["eagle3", "dflash"], {"eagle3": "/e", "dflash": "/d"}, eagle3_shape=shape)
        return [list(c.server_args) for c in config]

    (eagle_tree, dflash), (eagle_sglang, _) = flags(parse_eagle3_shape("5,4,8")), flags(parse_eagle3_shape("sglang"))
    assert eagle_tree[eagle_tree.index("--speculative-eagle-topk") + 1] == "4"
    assert eagle_tree[eagle_tree.index("--speculative-num-draft-tokens") + 1] == "8"
    assert not any(a.startswith("--speculative-num") for a in eagle_sglang)  # SGLang picks the shape itself
    assert not any(a.startswith("--speculative-num") for a in dflash)  # DFlash drafts its block
    assert parse_eagle3_shape("chain") == (3, 1, 4)
    for bad in ("tree", "5,4", "5,0,8"):
        with pytest.raises(ConfigError, match="EAGLE-3 shape"):
            parse_eagle3_shape(bad)


@pytest.mark.parametrize(
    "bad",
    [
        "tts-s0",
        "foo",
        "medusa:frozen",
        "eagle3:no-spec",
        "tts-sx",
        "tts-s5-batch-r8",
        "tts-s5-request-r0",
        "eagle3:ngram",
        "ngram-sync",
        "ngram-s5",
    ],
)
def test_bad_config_names_are_refused(bad):
    with pytest.raises(ConfigError):
        parse_config_name(bad)


def test_ngram_serves_sglangs_ngram_algorithm_without_a_drafter():
    spec = parse_config_name("ngram")
    assert spec.variant == "ngram" and spec.kind is None and not spec.needs_drafter and spec.base_name == "ngram"
    assert parse_config_name("ngram+wide").tags == ("wide",) and parse_config_name("frozen").needs_drafter
    assert kinds_needed(["no-spec", "ngram"], ["eagle3", "dflash"]) == []
    assert kinds_needed(["ngram", "eagle3:frozen"], ["eagle3", "dflash"]) == ["eagle3"]
    wide = ("--speculative-num-draft-tokens", "12", "--speculative-ngram-max-bfs-breadth", "10")
    configs = build_configs(
        ["eagle3:frozen", "ngram", "no-spec", "ngram+wide", "ngram"],
        ["eagle3", "dflash"],
        {"eagle3": "/e"},  # no dflash drafter: nothing here serves one
        extra_server_args=["--tts-scope", "global"],
        variants={"wide": wide},
    )
    by = {c.name: c for c in configs}
    assert list(by) == ["ngram", "no-spec", "ngram+wide", "eagle3:frozen"]
    ngram = by["ngram"]
    assert (ngram.variant, ngram.kind, ngram.drafter, ngram.speculative) == ("ngram", None, None, True)
    # SGLang's NGRAM shaped like the EAGLE-3 chain: 4 verified tokens, breadth 1; no drafter path.
    assert ngram.server_args == (
        "--speculative-algorithm", "NGRAM",
        "--speculative-num-draft-tokens", "4",
        "--speculative-ngram-max-bfs-breadth", "1",
        "--tts-scope", "global",
    )  # fmt: skip
    assert by["ngram+wide"].server_args[-4:] == wide  # a variant overrides the shape (SGLang's default here)
    assert BenchConfig.from_json(ngram.to_json()) == ngram
    assert build_configs(["ngram"], ["eagle3"], {})[0].name == "ngram"  # runs with no drafter at all


def test_kinds_needed_and_missing_drafters():
    assert kinds_needed(["no-spec"], ["eagle3", "dflash"]) == []
    assert kinds_needed(["no-spec", "dflash:stock"], ["eagle3", "dflash"]) == ["dflash"]
    with pytest.raises(ConfigError, match="no dflash drafter"):
        build_configs(["frozen"], ["eagle3", "dflash"], {"eagle3": "/e"})


def test_schedule_rotates_the_configuration_order_per_round():
    configs = full_configs(("no-spec", "frozen", "tts-s1"))[:3]
    prompts = [BenchPrompt(f"p{i}", "d") for i in range(5)]
    assert [len(c) for c in split_rounds(prompts, 3)] == [2, 2, 1]
    assert split_rounds(prompts[:2], 5) == [[prompts[0]], [prompts[1]]]
    slots = plan_schedule(configs, prompts, 3)
    order = [[s.config.name for s in slots if s.round == r] for r in range(3)]
    a, b, c = (x.name for x in configs)
    assert order == [[a, b, c], [b, c, a], [c, a, b]]
    assert all(isinstance(s, Slot) and s.prompts for s in slots)
    assert interleave([[1, 2, 3], ["a"]]) == [1, "a", 2, 3]


# 16 distinct words, then a 16-word loop of one word: quarters of 8 words.
_FAKE_TEXT = " ".join([f"w{i}" for i in range(16)] + ["loop"] * 16)


class _QuietHandler(BaseHTTPRequestHandler):
    """A request handler that answers with `_send` and logs nothing."""

    def _send(self, status: int, data: bytes, content_type: str | None = None) -> None:
        self.send_response(status)
        if content_type is not None:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_json(self, status: int, reply: dict) -> None:
        self._send(status, json.dumps(reply).encode(), "application/json")

    def log_message(self, *args):
        pass


class _FakeSGLang(_QuietHandler):
    """Answers /v1/chat/completions like SGLang does with return_meta_info."""

    bodies: list[dict] = []
    meta: dict = {
        "completion_tokens": 8,
        "spec_accept_length": 2.33,
        "spec_verify_ct": 3,
        "tts_accept_lengths": [1, 3, 3],
        "tts_num_updates": 3,
        "tts_num_skipped_updates": 0,
        "tts_update_ms": 12.5,
        "tts_guard_resets": 1,
        "e2e_latency": 0.4,
        "finish_reason": {"type": "length", "length": 8},
    }

    def do_POST(self):  # noqa: N802 - BaseHTTPRequestHandler's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _FakeSGLang.bodies.append(body)
        meta = self.meta
        reply = {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": _FAKE_TEXT},
                    "finish_reason": "length",
                    "meta_info": meta,
                }
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13},
        }
        self._send_json(200, reply)


@contextlib.contextmanager
def _serving(handler: type[BaseHTTPRequestHandler]):
    """A local HTTP server in a thread; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


class _FakeGenerate(_QuietHandler):
    """SGLang's /generate: echoes the request in meta_info; a prompt of token 0 is refused with HTTP 400."""

    def do_POST(self):  # noqa: N802 - BaseHTTPRequestHandler's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["input_ids"] == [0]:
            status, reply = 400, {"error": "bad token 0"}
        else:
            meta = {"completion_tokens": 2, "prompt_tokens": len(body["input_ids"]), "echo": body}
            status, reply = 200, {"text": "ab", "output_ids": [7, 8], "meta_info": meta}
        self._send_json(status, reply)


def test_generate_request_posts_json_and_names_the_servers_refusal():
    sampling = SamplingSettings(max_new_tokens=2, temperature=0.0)
    with _serving(_FakeGenerate) as base:
        response = send_generate(base, BenchPrompt("p0", "d", input_ids=(3, 4, 5)), sampling, False, timeout=30)
        assert response.completion_tokens == 2 and response.prompt_tokens == 3 and response.text == "ab"
        assert response.meta["echo"]["input_ids"] == [3, 4, 5]
        assert response.meta["echo"]["sampling_params"]["max_new_tokens"] == 2
        with pytest.raises(RuntimeError, match=r"/generate answered HTTP 400: .*bad token 0"):
            send_generate(base, BenchPrompt("p1", "d", input_ids=(0,)), sampling, False, timeout=30)


class _FakeStreamingGenerate(_QuietHandler):
    """SGLang's streamed /generate: server-sent chunks carrying the output so far, the first one after a
    delay (the prefill), then [DONE]."""

    def do_POST(self):  # noqa: N802 - BaseHTTPRequestHandler's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] is True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(0.2)
        for n in (1, 2, 3):
            meta = {"completion_tokens": n, "prompt_tokens": 3, "tts_prompt_positions": 3, "tts_prompt_ms": 4.5}
            chunk = {"text": "abc"[:n], "output_ids": [7, 8, 9][:n], "meta_info": meta}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.05)
        self.wfile.write(b"data: [DONE]\n\n")


def test_a_streamed_generate_request_records_its_time_to_first_token():
    sampling = SamplingSettings(max_new_tokens=3)
    with _serving(_FakeStreamingGenerate) as base:
        response = send_generate(base, BenchPrompt("p0", "d", input_ids=(3, 4, 5)), sampling, True, 30, stream=True)
    assert response.completion_tokens == 3 and response.text == "abc"
    assert 0.2 <= response.ttft_s < 0.25  # the first chunk, not the last
    record = record_from_response("tts-s2", BenchPrompt("p0", "d"), 0, response, 0.4)
    assert record.ttft_s == response.ttft_s
    assert record.tts_prompt_positions == 3 and record.tts_prompt_ms == 4.5


def test_openai_request_carries_custom_params_and_reads_meta_info():
    with _serving(_FakeSGLang) as base:
        prompt = BenchPrompt("p0", "d", messages=({"role": "user", "content": "hi"},))
        sampling = SamplingSettings(max_new_tokens=8, temperature=0.7, ignore_eos=True)
        response = send_openai(base, "m", prompt, sampling, details=True, timeout=30)
    body = _FakeSGLang.bodies[-1]
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["max_tokens"] == 8
    assert body["temperature"] == 0.7 and body["ignore_eos"] is True and body["return_meta_info"] is True
    assert body["custom_params"] == {"tts_return_accept_lengths": True}
    record = record_from_response("eagle3:tts-s1", prompt, 2, response, 0.5, sampling.label)
    assert (record.completion_tokens, record.prompt_tokens, record.sampling) == (8, 5, "t0.7")
    assert record.accept_lengths == [1, 3, 3] and record.spec_verify_ct == 3
    assert record.tts_num_updates == 3 and record.tts_update_ms == 12.5 and record.finish_reason == "length"
    assert record.tts_guard_resets == 1
    assert record.tokens_per_s == pytest.approx(16.0)
    assert record.distinct_ngrams == [1.0, 1.0, 0.2, 0.2]  # 5 four-grams per quarter; the loop has 1 distinct


def test_a_record_carries_the_hybrids_proposer_counters_retirement_and_cached_prompt_tokens():
    meta = {"completion_tokens": 9, "spec_verify_ct": 5, "tts_suffix_rounds": 3, "tts_suffix_accepted": 2}
    meta |= {"tts_drafter_rounds": 2, "tts_drafter_accepted": 1, "tts_drafter_retired": 1, "cached_tokens": 3}
    record = record_from_response("eagle3:tts+hybrid", BenchPrompt("p0", "d"), 0, Response(meta, 9, 4, "x"), 1.0)
    assert (record.tts_suffix_rounds, record.tts_drafter_rounds, record.tts_drafter_retired) == (3, 2, 1)
    assert (record.prompt_tokens, record.cached_tokens) == (4, 3)
    plain = record_from_response("ngram", BenchPrompt("p0", "d"), 0, Response({"completion_tokens": 9}, 9, 4, "x"), 1.0)
    assert plain.tts_drafter_retired is None  # a server without the hybrid sends no such key


def test_a_sampling_seed_gives_each_prompt_its_seed_in_both_apis():
    seeded = SamplingSettings(max_new_tokens=8, temperature=0.7, seed=3)
    seed = seeded.request_seed("p0")
    assert seed == SamplingSettings(max_new_tokens=2, temperature=0.7, seed=3).request_seed("p0")  # any config
    assert seed != seeded.request_seed("p1") and seed != SamplingSettings(temperature=0.7, seed=4).request_seed("p0")
    assert SamplingSettings(temperature=0.0, seed=3).request_seed("p0") is None  # greedy needs none
    assert SamplingSettings(temperature=0.7).request_seed("p0") is None  # unseeded by default
    assert "sampling_seed" not in SamplingSettings(temperature=0.7).generate_params(prompt_id="p0")
    with _serving(_FakeSGLang) as base:
        prompt = BenchPrompt("p0", "d", messages=({"role": "user", "content": "hi"},))
        send_openai(base, "m", prompt, seeded, details=False, timeout=30)
        assert _FakeSGLang.bodies[-1]["seed"] == seed
        send_openai(base, "m", prompt, SamplingSettings(temperature=0.7), details=False, timeout=30)
        assert "seed" not in _FakeSGLang.bodies[-1]
    with _serving(_FakeGenerate) as base:
        response = send_generate(base, BenchPrompt("p0", "d", input_ids=(3, 4)), seeded, False, timeout=30)
    assert response.meta["echo"]["sampling_params"]["sampling_seed"] == seed


def test_runner_settings_default_to_the_openai_api_and_greedy():
    settings = RunnerSettings(model="m")
    assert settings.api == "openai" and settings.temperatures == (0.0,)
    assert SamplingSettings().label == "greedy"


def test_waves_fill_every_group_by_cycling_the_prompts():
    assert waves([1, 2, 3], 1) == [[1], [2], [3]]
    assert waves([1, 2], 3) == [[1, 2, 1]]
    assert waves([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5, 1]]
    assert waves([], 4) == []
    assert mode_label(0.0, 1) == "greedy" and mode_label(0.7, 4) == "t0.7-c4"
    assert parse_mode("t0.7-c4") == ("t0.7", 4) and parse_mode("greedy") == ("greedy", 1)


class _SlowSGLang(_FakeSGLang):
    """Like _FakeSGLang, but each request takes a while and the server counts requests in flight."""

    lock = threading.Lock()
    in_flight = 0
    max_in_flight = 0

    def do_POST(self):  # noqa: N802
        cls = _SlowSGLang
        with cls.lock:
            cls.in_flight += 1
            cls.max_in_flight = max(cls.max_in_flight, cls.in_flight)
        try:
            time.sleep(0.3)
            super().do_POST()
        finally:
            with cls.lock:
                cls.in_flight -= 1


def test_runner_sends_waves_of_concurrent_requests_and_charges_each_its_share():
    with _serving(_SlowSGLang) as base:
        settings = RunnerSettings(model="m", base_url=base, concurrencies=(1, 3), warmup_tokens=0)
        config = BenchConfig("eagle3:tts-s5", "tts", "eagle3", stride=5)
        prompts = [BenchPrompt(f"p{i}", "d", messages=({"role": "user", "content": f"q{i}"},)) for i in range(2)]
        records = Runner(settings).run(plan_schedule([config], prompts, 1), progress=False)
    single = [r for r in records if r.sampling == "greedy"]
    batched = [r for r in records if r.sampling == "greedy-c3"]
    assert [r.prompt_id for r in single] == ["p0", "p1"] and all(r.concurrency == 1 for r in single)
    assert [r.prompt_id for r in batched] == ["p0", "p1", "p0"]  # one full wave, cycled
    assert all(r.concurrency == 3 for r in batched)
    assert _SlowSGLang.max_in_flight == 3  # the wave really was in flight together
    wave = batched[0].wave_wall_s
    assert wave is not None and all(r.wave_wall_s == wave for r in batched)
    assert batched[0].share_wall_s == pytest.approx(wave / 3) and single[0].share_wall_s == single[0].wall_s
    assert all(r.wall_s <= wave + 1e-6 for r in batched)


@pytest.mark.parametrize("warm", [True, False])
def test_a_waves_prompts_are_prefilled_once_each_before_its_clock_starts(warm):
    """A wave that repeats a prompt would share its prefix or not as its requests happen to arrive: by default
    each distinct prompt is sent once for 1 token before the wave (unrecorded); single requests are not."""
    with _serving(_SlowSGLang) as base:
        settings = RunnerSettings(model="m", base_url=base, concurrencies=(1, 3), warmup_tokens=0, warm_prompts=warm)
        config = BenchConfig("eagle3:tts-s5", "tts", "eagle3", stride=5)
        prompts = [BenchPrompt(f"p{i}", "d", messages=({"role": "user", "content": f"q{i}"},)) for i in range(2)]
        _FakeSGLang.bodies.clear()
        records = Runner(settings).run(plan_schedule([config], prompts, 1), progress=False)
    sent = [(b["messages"][0]["content"], b["max_tokens"]) for b in _FakeSGLang.bodies]
    single, wave = sent[:2], sent[2:]
    n = settings.sampling.max_new_tokens
    assert single == [("q0", n), ("q1", n)]
    if warm:
        assert wave[:2] == [("q0", 1), ("q1", 1)]  # p0 once although the wave sends it twice
        assert sorted(wave[2:]) == [("q0", n), ("q0", n), ("q1", n)]
    else:
        assert sorted(wave) == [("q0", n), ("q0", n), ("q1", n)]
    assert len(records) == 5  # warm requests are not recorded


def test_a_request_waits_as_long_as_its_answer_needs(monkeypatch):
    """No --request-timeout: a request is waited for at least an hour, longer for a long answer (8,192
    tokens at 0.5 tokens/s; an hour lost one such answer on the 2-core CPU); a given timeout is kept."""
    from sglang_tts.bench import runner as runner_module

    assert request_timeout(1024) == 3600.0
    assert request_timeout(8192) == 16384.0
    assert request_timeout(8192, given=60.0) == 60.0
    seen: list[float] = []
    monkeypatch.setattr(runner_module, "send_openai", lambda *args: seen.append(args[5]))
    prompt = BenchPrompt("p", "d", messages=({"role": "user", "content": "q"},))
    sized = Runner(RunnerSettings(model="m", sampling=SamplingSettings(max_new_tokens=8192)))
    sized._send("http://x", prompt, details=False)
    sized._send("http://x", prompt, details=False, max_new_tokens=16)  # a warm-up request
    Runner(RunnerSettings(model="m", request_timeout_s=90.0))._send("http://x", prompt, details=False)
    assert seen == [16384.0, 3600.0, 90.0]


class _FakeNgram(_FakeSGLang):
    """A stock NGRAM server: SGLang's speculative stats only, and /flush_cache (every path is logged)."""

    paths: list[str] = []
    meta = {"completion_tokens": 8, "spec_accept_length": 2.0, "spec_verify_ct": 4, "e2e_latency": 0.4}

    def do_POST(self):  # noqa: N802
        _FakeNgram.paths.append(self.path)
        if not self.path.startswith("/flush_cache"):
            return super().do_POST()
        self._send(200, b"Cache flushed.\n")


def test_ngram_requests_start_from_an_empty_corpus_and_report_sglangs_acceptance():
    from sglang_tts.bench.metrics import aggregate
    from sglang_tts.bench.report import throughput_table

    _FakeNgram.paths.clear()
    with _serving(_FakeNgram) as base:
        settings = RunnerSettings(
            model="m", base_url=base, temperatures=(0.0, 0.7), concurrencies=(1, 2), warmup_tokens=4
        )
        configs = build_configs(["ngram", "frozen"], ["eagle3"], {"eagle3": "/e"})
        prompts = [BenchPrompt(f"p{i}", "d", messages=({"role": "user", "content": f"q{i}"},)) for i in range(2)]
        records = Runner(settings).run(plan_schedule(configs, prompts, 1), progress=False)
    chat, flush = "/v1/chat/completions", "/flush_cache?timeout=30"
    # ngram runs first: a flush before each of its 4 single requests and each of its 2 waves of 2 (no warm-up
    # on a server the runner did not start), the flush before a wave's 2 prompt warm-ups; then frozen's 8
    # requests and 4 warm-ups, none flushed.
    assert _FakeNgram.paths == [flush, chat] * 4 + ([flush] + [chat] * 4) * 2 + [chat] * 12
    ngram = [r for r in records if r.config == "ngram"]
    assert len(ngram) == 8 and all(r.spec_accept_length == 2.0 and r.accept_lengths is None for r in ngram)
    # The report's throughput table shows its acceptance (SGLang's spec_accept_length, pooled over rounds).
    greedy = aggregate([r for r in records if r.sampling == "greedy"], configs, 32)
    row = next(line for line in throughput_table(greedy).splitlines() if line.startswith("| ngram "))
    assert row.rstrip(" |").endswith("2.00")


def test_a_reference_resolves_to_one_configuration():
    from sglang_tts.bench.configs import resolve_reference

    names = ["no-spec", "eagle3:tts-s2+best", "dflash:tts-s2+best", "eagle3:frozen"]
    assert resolve_reference("eagle3:tts-s2+best", names) == "eagle3:tts-s2+best"
    assert resolve_reference("frozen", names) == "eagle3:frozen"
    assert resolve_reference("no-spec", names) == "no-spec"
    with pytest.raises(ConfigError, match="names several configurations"):
        resolve_reference("tts-s2+best", names)
    with pytest.raises(ConfigError, match="is not one of the configurations: use one of no-spec"):
        resolve_reference("tts-s5", names)


def test_default_drafter_is_the_newest_trained_one_else_the_shipped_one(tmp_path, monkeypatch):
    from sglang_tts.bench import configs

    monkeypatch.setattr(configs, "cache_root", lambda: tmp_path)
    shipped = tmp_path / "shipped" / "M-eagle3"
    monkeypatch.setattr(configs, "shipped_drafter", lambda t, kind: shipped if (t, kind) == ("M", "eagle3") else None)
    assert configs.find_default_drafter("M", "eagle3") == shipped
    with pytest.raises(configs.ConfigError, match="no trained dflash drafter for M"):
        configs.find_default_drafter("M", "dflash")
    trained = tmp_path / "drafters" / "M-eagle3-len256"
    trained.mkdir(parents=True)
    (trained / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    assert configs.find_default_drafter("M", "eagle3") == trained
    # an explicit root never falls back to the shipped drafter
    with pytest.raises(configs.ConfigError):
        configs.find_default_drafter("M", "eagle3", root=tmp_path / "elsewhere")


def test_hybrid_configurations_flush_their_corpus_like_ngram():
    from sglang_tts.bench.configs import build_configs
    from sglang_tts.bench.runner import shares_a_corpus

    configs = build_configs(["no-spec", "ngram", "frozen", "frozen+hybrid", "tts+hybrid"], ["eagle3"], {"eagle3": "d"})
    by_name = {c.name: c for c in configs}
    assert by_name["eagle3:tts+hybrid"].server_args[-2:] == ("--tts-hybrid", "on")  # a tag every run knows
    assert [shares_a_corpus(c) for c in configs] == [False, True, False, True, True]


def test_long_answers_fit_the_kv_pool_and_the_context_at_every_concurrency(tiny_llama):
    from types import SimpleNamespace

    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

    from sglang_tts.bench.server import (
        CPU_KV_TOKENS,
        DRAFT_MARGIN,
        context_length_arg,
        context_shortfall,
        kv_pool_tokens,
        model_context_length,
        waves_kv_tokens,
    )

    lengths = {"p2": 5200, "p1": 900, "p0": 3000, "p3": 1200}
    prompts = [BenchPrompt(p, "d") for p in lengths]  # rounds: p2 p1 | p0 p3
    allocator = SimpleNamespace(page_size=1)  # SGLang's CPU pages are one token
    for max_new in (8192, 16384):
        for concurrency in (1, 4, 8):
            # Two rounds of two prompts: a wave of 8 sends each prompt of its round 4 times.
            chunks = split_rounds(prompts, 2)
            wave_lengths = [[lengths[p.id] for p in wave] for chunk in chunks for wave in waves(chunk, concurrency)]
            pool = waves_kv_tokens(wave_lengths, max_new)
            worst = [5200, 900] * (concurrency // 2) if concurrency > 1 else [5200]
            assert pool == max(CPU_KV_TOKENS, sum(worst) + concurrency * (max_new + DRAFT_MARGIN))
            if concurrency == 4:  # the longest prompts of all rounds together need less than this wave
                assert pool > kv_pool_tokens(list(lengths.values()), max_new, concurrency)
            # The whole worst wave is in the pool at once, and SGLang's own clip leaves each answer whole.
            assert sum(n + max_new for n in worst) <= pool
            for n in worst:
                clipped = BaseTokenToKVPoolAllocator.max_new_tokens_for_memory(
                    allocator, n, max_new, token_capacity=pool, sliding_window_size=None, chunk_size=None
                )
                assert clipped == max_new
    # Fewer prompts than a wave: the wave repeats them, and so does the pool (it counted only 2 requests before).
    assert kv_pool_tokens([5200, 900], 8192, 4) == 2 * 5200 + 2 * 900 + 4 * (8192 + DRAFT_MARGIN)

    # The context: Qwen2.5-Coder-0.5B's 32,768 tokens hold a 5K prompt and a 16K answer; SmolLM2's 8,192 do not
    # hold an 8K answer (SGLang would refuse each request), and the benchmark says so before starting.
    assert context_shortfall(32768, 5200, 16384) is None and context_shortfall(8192, 8190 - 8000, 8000) is None
    assert "need a context of 8394 tokens" in context_shortfall(8192, 200, 8192)
    assert model_context_length(tiny_llama) == 4096  # its config's max_position_embeddings, as SGLang derives it
    assert model_context_length(tiny_llama / "nowhere") is None  # unreadable: the launch will say why
    assert context_length_arg(("--tts-lr", "1", "--context-length", "20000")) == 20000
    assert context_length_arg(("--context-length=30000",)) == 30000 and context_length_arg(()) is None
