"""State that must not grow under real traffic: 2,000 short requests through one TTS server.

The mix a server sees in production, 16 in flight at a time: requests that finish at prefill
(`max_new_tokens=1`), short ones (some asking for per-round data), streams read to the end,
streams the client closes after the first chunk, and streams aborted with SGLang's
`/abort_request`. After request 200 (everything warmed up: allocator pools, SGLang's radix cache
at its working size) and after request 2,000, with the server idle and one probe request run:

- the scheduler process's resident memory has not grown beyond RSS_TOLERANCE_MB;
- TTS holds as many per-request entries (Prometheus `sglang_tts:tracked_requests`, set at every
  decode round: anchors, counters, prefilled requests, adapter slots) as it did at request 200;
- every response reported what it should (the counters in every non-streamed response and in every
  stream's last chunk).
"""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psutil
import pytest

from sglang_tts.bench.server import sglang_server
from sglang_tts.platform.cpu.linear import ENABLE_ENV as PACKED_LINEAR_ENV
from sglang_tts.sglang.metrics import SCALAR_KEYS
from sglang_tts.testing.reference import generate_ids, post_json

CHAIN = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
WARM, TOTAL, IN_FLIGHT = 200, 2000, 16
# Allowed growth of the scheduler's RSS from request 200 to request 2,000: allocator noise (glibc
# keeps freed blocks in its arenas, and a batch shape first seen late can set a new high-water mark
# of activation buffers). Measured on this mix with the server below: +1..3 MB. A leak of 5 KB per
# request (a Req with its output, a canvas, a request's features) is 9 MB over the 1,800 requests.
# Smaller per-request entries (an anchor feature, a counters record: about 1 KB) are caught by
# `sglang_tts:tracked_requests` instead, exactly.
# The server runs without the CPU layer's oneDNN-packed linear layers (SGLANG_TTS_CPU_PACKED_LINEAR=0):
# with them, oneDNN's caches (one primitive per new row count of every linear shape, up to its
# capacity) and their allocations add 20-45 MB over the first ~1,000 requests of this mix, then stay
# flat to request 4,000 (measured; stock EAGLE3 without TTS grows the same way). That is a bounded
# warm-up of the linear kernels, not per-request state, and it would hide a leak of that size.
RSS_TOLERANCE_MB = 8.0
PROMPT = [4, 100, 200, 300, 3, 5]


def _prompt(i: int) -> list[int]:
    return [4, 10 + i % 500, 20 + (i * 7) % 700, 3, 5]  # short and varied: the radix cache fills too


def _body(i: int, max_new: int, stream: bool = False, **extra: Any) -> dict[str, Any]:
    params = {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True, **extra}
    return {"input_ids": _prompt(i), "sampling_params": params, "stream": stream}


def _stream(base_url: str, body: dict[str, Any], on_first=None) -> list[dict[str, Any]]:
    """The chunks of a streamed /generate; `on_first(response)` after the first chunk may close the
    connection (a client that goes away) or abort the request, and decides whether to read on."""
    req = urllib.request.Request(
        base_url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    chunks: list[dict[str, Any]] = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunks.append(json.loads(line[5:]))
            if len(chunks) == 1 and on_first is not None and not on_first(r):
                break
    return chunks


def _one(base_url: str, i: int) -> tuple[str, bool]:
    """Request i of the mix: (its kind, whether its answer reported what it should)."""
    kind = ("prefill_only", "short", "short_rounds", "stream", "disconnect", "short", "abort", "short", "prefill_only",
            "stream")[i % 10]  # fmt: skip
    if kind == "prefill_only":  # finishes at prefill: no decode round, nothing for TTS to report
        meta = post_json(base_url + "/generate", _body(i, 1), timeout=300)["meta_info"]
        return kind, meta["completion_tokens"] == 1
    if kind in ("short", "short_rounds"):
        custom = {"tts_return_accept_lengths": True} if kind == "short_rounds" else None
        meta = post_json(base_url + "/generate", _body(i, 6, custom_params=custom), timeout=300)["meta_info"]
        ok = meta["completion_tokens"] == 6 and all(key in meta for key in SCALAR_KEYS)
        if kind == "short_rounds":
            ok = ok and len(meta["tts_accept_lengths"]) == meta["spec_verify_ct"]
        return kind, ok
    if kind == "stream":
        chunks = _stream(base_url, _body(i, 8, stream=True))
        last = chunks[-1]["meta_info"]
        return kind, last["completion_tokens"] == 8 and all(key in last for key in SCALAR_KEYS)
    if kind == "disconnect":  # the client goes away after the first chunk
        chunks = _stream(base_url, _body(i, 200, stream=True), on_first=lambda r: False)
        return kind, len(chunks) == 1
    rid = f"bounded-abort-{i}"

    def abort(_response) -> bool:
        post = urllib.request.Request(
            base_url + "/abort_request", data=json.dumps({"rid": rid}).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(post, timeout=60) as a:
            return a.status == 200  # read on: the stream ends with the abort

    chunks = _stream(base_url, {**_body(i, 200, stream=True), "rid": rid}, on_first=abort)
    meta = chunks[-1]["meta_info"]
    finish = meta["finish_reason"]
    if finish is not None and finish["type"] == "length" and meta["completion_tokens"] == 200:
        # The loopy pair drafts whole chains: under load the 200 tokens may be out before the abort
        # lands, which is a correct answer too (the abort of a finished request is a no-op).
        return "abort-late", all(key in meta for key in SCALAR_KEYS)
    ok = finish is not None and finish["type"] == "abort" and meta["completion_tokens"] < 200
    return (kind if ok else f"abort: finish {finish}, {meta['completion_tokens']} tokens"), ok


def _scheduler(server) -> psutil.Process:
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        if " ".join(child.cmdline()).startswith("sglang::scheduler"):
            return child
    raise AssertionError("no sglang::scheduler process under the server")


def _tracked_requests(base_url: str) -> float:
    with urllib.request.urlopen(base_url + "/metrics", timeout=60) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("sglang_tts:tracked_requests"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError("sglang_tts:tracked_requests not exported")


def _checkpoint(server, scheduler: psutil.Process) -> dict[str, float]:
    """Idle server, then one probe request (its decode rounds refresh the gauge): RSS and gauge."""
    generate_ids(server.base_url, PROMPT, 8)
    time.sleep(0.5)
    return {"rss_mb": scheduler.memory_info().rss / 2**20, "tracked": _tracked_requests(server.base_url)}


@pytest.fixture(scope="module")
def traffic(loopy_llama, loopy_eagle3):
    args = ["--speculative-algorithm", "TTS", "--speculative-draft-model-path", str(loopy_eagle3), *CHAIN,
            "--tts-update-stride", "2", "--enable-metrics"]  # fmt: skip
    with sglang_server(str(loopy_llama), args, env={PACKED_LINEAR_ENV: "0"}) as server:
        scheduler = _scheduler(server)
        results: list[tuple[str, bool]] = []
        points = {}
        started = time.monotonic()
        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            for begin, end in ((0, WARM), (WARM, TOTAL)):
                results += list(pool.map(lambda i: _one(server.base_url, i), range(begin, end)))
                points[end] = _checkpoint(server, scheduler)
        seconds = time.monotonic() - started
        healthy = server.healthy()
    return {"results": results, "points": points, "seconds": seconds, "healthy": healthy}


def test_every_request_of_the_mix_is_answered_as_it_should_be(traffic):
    assert traffic["healthy"]
    assert len(traffic["results"]) == TOTAL
    wrong = [(i, kind) for i, (kind, ok) in enumerate(traffic["results"]) if not ok]
    assert not wrong, wrong[:20]
    late = sum(kind == "abort-late" for kind, _ in traffic["results"])
    assert late <= TOTAL // 10 // 10, late  # most aborts land mid-stream (1 in 10 requests is one)


def test_tts_holds_no_entry_of_a_finished_request(traffic):
    warm, end = traffic["points"][WARM], traffic["points"][TOTAL]
    assert end["tracked"] == warm["tracked"], traffic["points"]
    assert end["tracked"] <= 3  # the probe request's own entries (anchor, counters), nothing else


def test_the_scheduler_memory_stays_flat(traffic):
    warm, end = traffic["points"][WARM], traffic["points"][TOTAL]
    growth = end["rss_mb"] - warm["rss_mb"]
    print(f"scheduler RSS: {warm['rss_mb']:.1f} MB at request {WARM}, {end['rss_mb']:.1f} MB at {TOTAL} "
          f"({growth:+.1f} MB); {TOTAL} requests in {traffic['seconds']:.0f} s")  # fmt: skip
    assert growth <= RSS_TOLERANCE_MB, traffic["points"]
