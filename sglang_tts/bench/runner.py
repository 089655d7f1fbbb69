"""Run the benchmark: launch (or target) servers in an interleaved schedule and record every request.

Schedule. The prompts are split into ``rounds`` contiguous chunks (prompts are already interleaved
across datasets). In each round every configuration runs the whole chunk on a fresh server: start,
one short unrecorded warm-up request, the chunk's requests one at a time, stop. The configuration
order rotates by one per round (A B C | B C A | C A B), so no configuration always runs first or
last. Machine noise that lasts minutes (a background job, thermal state) then lands on every
configuration alike, at the cost of ``rounds x configs`` server starts (about a minute each on a
2-core CPU). A server is kept alive when the next slot is the same configuration (a single
configuration, or ``--base-url``, where the one running server serves everything).

By default requests are sequential (batch size 1): acceptance and per-request wall time are then
properties of the configuration, not of the batch mix. Each prompt runs once per temperature
(``temperatures``; 0 = greedy) on the same server; records carry the mode's label (``greedy``, ``t0.7``).

``concurrencies`` adds batched modes: at concurrency ``c > 1`` the slot's prompts are sent in waves of
``c`` simultaneous requests (the prompt list is cycled to fill the last wave, so every wave is full and
SGLang really batches ``c`` requests), labelled ``greedy-c4``, ``t0.7-c4``. A wave's wall time is
shared equally by its requests for throughput (pooled tokens / wave seconds = the server's output rate).

SGLang's NGRAM speculation (the ``ngram`` configuration) and TTS's hybrid drafting (``+hybrid``) draft
from one corpus shared by every request of a server: the warm-up, the same prompt at another temperature
and earlier prompts would feed it. The runner empties it (``/flush_cache``, between requests: the server
is idle) before each of its requests or waves, so such a request drafts from its own text only (its
prompt's prefix cache goes too: one prefill).

At c > 1 a wave's requests reach SGLang's scheduler in an order no one sets, and where a wave repeats a
prompt (fewer prompts than ``c``) a copy reads the prompt from the radix cache or prefills it again
depending on that order: on 3,249-token prompts one configuration's wave prefilled 20-50% more prompt
tokens than another's over the same requests, seconds of CPU that no drafter caused. So by default
(``warm_prompts``) each distinct prompt of a wave is prefilled by an unrecorded 1-token request before the
wave's clock starts: every configuration's wave then finds all its prompts cached, and its wall time is
the decode's. A hybrid server's suffix corpus takes the prompt from the warm request, as it would from
the wave's own prefill a moment later.

By default requests go through the ``openai`` client to ``/v1/chat/completions`` with
``extra_body={"return_meta_info": True, "custom_params": {...}}``; ``api="generate"`` posts token ids to
SGLang's native ``/generate`` instead.

Units. What is sent, recorded and resumed as a whole is a :class:`Unit`: one request at concurrency 1, a
whole wave at c > 1 (its wall time needs every request of it). ``Runner.run`` calls ``on_record`` after
each finished unit (the suite appends it to ``requests.jsonl``) and skips the units it is given as
``done`` (a resumed run): a slot with nothing left starts no server. The progress bar counts tokens
(``max_new_tokens`` per request, whether the request used them all or stopped early), so its estimate of
the time left holds when a request takes minutes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from tqdm import tqdm

from sglang_tts.bench.configs import BenchConfig
from sglang_tts.bench.repetition import distinct_by_quarter
from sglang_tts.bench.workload import BenchPrompt

DETAILS = {"tts_return_accept_lengths": True}


def sampling_label(temperature: float) -> str:
    """``greedy`` for temperature 0, else ``t<temperature>`` (e.g. ``t0.7``): also used in plot file names."""
    return "greedy" if temperature == 0 else f"t{temperature:g}"


def mode_label(temperature: float, concurrency: int = 1) -> str:
    """The report's mode: the sampling label, plus ``-c<N>`` at concurrency N > 1 (``greedy-c4``)."""
    label = sampling_label(temperature)
    return label if concurrency == 1 else f"{label}-c{concurrency}"


def parse_mode(label: str) -> tuple[str, int]:
    """``greedy-c4`` -> (``greedy``, 4); ``t0.7`` -> (``t0.7``, 1)."""
    base, sep, conc = label.rpartition("-c")
    if sep and conc.isdigit():
        return base, int(conc)
    return label, 1


def waves(prompts: Sequence[Any], concurrency: int) -> list[list[Any]]:
    """``prompts`` in groups of ``concurrency`` sent together; the list is cycled so every group is full."""
    if concurrency <= 1:
        return [[p] for p in prompts]
    if not prompts:
        return []
    total = -(-max(len(prompts), concurrency) // concurrency) * concurrency
    cycled = [prompts[i % len(prompts)] for i in range(total)]
    return [cycled[i : i + concurrency] for i in range(0, total, concurrency)]


@dataclass(frozen=True)
class SamplingSettings:
    """Sampling parameters shared by every configuration (greedy by default)."""

    max_new_tokens: int = 2048
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False
    # Sampled requests carry a seed derived from this and the prompt's id (None: unseeded): every
    # configuration then samples a prompt with the same seed, and on CPU (seeded verify) the same text.
    seed: int | None = None

    @property
    def label(self) -> str:
        return sampling_label(self.temperature)

    def request_seed(self, prompt_id: str | None) -> int | None:
        """The seed of a sampled request for `prompt_id`: stable across configurations, runs and
        resumes (crc32 of the id, offset by the run's seed); None when greedy or unseeded."""
        if self.seed is None or self.temperature == 0 or prompt_id is None:
            return None
        return self.seed * 1_000_003 + zlib.crc32(prompt_id.encode())

    def generate_params(self, max_new_tokens: int | None = None, prompt_id: str | None = None) -> dict[str, Any]:
        params = {
            "max_new_tokens": self.max_new_tokens if max_new_tokens is None else max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "ignore_eos": self.ignore_eos,
        }
        seed = self.request_seed(prompt_id)
        if seed is not None:
            params["sampling_seed"] = seed
        return params


@dataclass
class RequestRecord:
    """Everything measured for one request. Optional fields are None where the server reports nothing
    (no-spec servers have no speculative stats; only TTS servers return per-round accept lengths)."""

    config: str
    dataset: str
    prompt_id: str
    round: int
    completion_tokens: int
    wall_s: float  # client-side, request sent -> full response received
    sampling: str = "greedy"  # sampling_label() of the request's temperature
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    accept_lengths: list[int] | None = None  # tokens emitted by each verify round, bonus included
    spec_accept_length: float | None = None
    spec_verify_ct: int | None = None
    tts_num_updates: int | None = None
    tts_num_skipped_updates: int | None = None
    tts_trained_rounds: int | None = None  # rounds its updates trained on (> updates with --tts-update-window)
    tts_update_ms: float | None = None
    tts_guard_resets: int | None = None  # do-no-harm resets of the drafter the request drafted with
    tts_prompt_positions: int | None = None  # --tts-prompt-adapt: positions its prompt update trained on
    tts_prompt_ms: float | None = None  # ... and that prompt update's run time
    # --tts-hybrid: rounds each proposer drafted, and its accepted drafted tokens (bonus excluded)
    tts_suffix_rounds: int | None = None
    tts_suffix_accepted: int | None = None
    tts_drafter_rounds: int | None = None
    tts_drafter_accepted: int | None = None
    tts_drafter_retired: int | None = None  # 1 once --tts-hybrid-retire-below retired the request's drafter
    tts_idle_updates: int | None = None  # updates skipped in its rounds: the drafter drafted none of their stride
    cached_tokens: int | None = None  # prompt tokens SGLang's radix cache served (not prefilled)
    e2e_latency_s: float | None = None  # the server's own measurement
    ttft_s: float | None = None  # streamed requests (--stream): request sent -> first token, client-side
    output_digest: str | None = None  # sha256 prefix of the output: equal greedy outputs across configs
    concurrency: int = 1  # requests sent together (the wave size; 1 = sequential)
    wave_wall_s: float | None = None  # first request sent -> last response of its wave (concurrency > 1)
    distinct_ngrams: list[float | None] | None = None  # distinct word 4-gram share per quarter of the text

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def share_wall_s(self) -> float:
        """This request's share of server time: its wall time alone, or its wave's divided by the wave size."""
        if self.concurrency <= 1 or self.wave_wall_s is None:
            return self.wall_s
        return self.wave_wall_s / self.concurrency

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class Slot:
    """One configuration serving one round's prompts."""

    round: int
    config: BenchConfig
    prompts: tuple[BenchPrompt, ...]


@dataclass
class SlotLog:
    """What happened in a slot: server start time (None when reused or external) and any error.
    ``done_before``: its units an earlier session of a resumed run had finished (not sent again)."""

    round: int
    config: str
    prompt_ids: list[str]
    server_start_s: float | None = None
    warmup_s: float | None = None
    error: str | None = None
    skipped: bool = False
    done_before: int = 0


@dataclass(frozen=True)
class Unit:
    """What is sent, recorded and resumed as a whole: one request (concurrency 1) or one wave of
    ``concurrency`` requests sent together (its wall time needs all of them)."""

    config: str
    round: int
    sampling: str  # the records' mode label: greedy, t0.7, greedy-c4
    concurrency: int
    index: int  # the request's prompt position in its slot (concurrency 1), or the wave's position
    prompt_ids: tuple[str, ...]

    @property
    def requests(self) -> int:
        return len(self.prompt_ids)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "prompt_ids": list(self.prompt_ids)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Unit:
        return cls(
            str(data["config"]),
            int(data["round"]),
            str(data["sampling"]),
            int(data["concurrency"]),
            int(data["index"]),
            tuple(str(p) for p in data["prompt_ids"]),
        )


@dataclass(frozen=True)
class UnitPlan:
    """A unit with what to send: its prompts (one, or the wave's) and their sampling settings."""

    unit: Unit
    prompts: tuple[BenchPrompt, ...]
    sampling: SamplingSettings


def split_rounds(items: Sequence[Any], rounds: int) -> list[list[Any]]:
    """``items`` in ``rounds`` contiguous chunks of near-equal size (earlier chunks get the remainder)."""
    rounds = max(1, min(rounds, len(items))) if items else 1
    size, extra = divmod(len(items), rounds)
    chunks, start = [], 0
    for r in range(rounds):
        end = start + size + (1 if r < extra else 0)
        chunks.append(list(items[start:end]))
        start = end
    return chunks


def plan_schedule(configs: Sequence[BenchConfig], prompts: Sequence[BenchPrompt], rounds: int) -> list[Slot]:
    """Every configuration on every chunk; the configuration order rotates by one per round."""
    slots: list[Slot] = []
    n = len(configs)
    for r, chunk in enumerate(split_rounds(prompts, rounds)):
        if not chunk:
            continue
        for config in [*configs[r % n :], *configs[: r % n]]:
            slots.append(Slot(r, config, tuple(chunk)))
    return slots


# ----------------------------------------------------------------------------------------------------------
# One request
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Response:
    """The parts of a server response the benchmark keeps."""

    meta: dict[str, Any]
    completion_tokens: int
    prompt_tokens: int | None
    output_digest: str
    text: str | None = None
    ttft_s: float | None = None  # streamed requests: request sent -> first token received (client-side)


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


def _post(url: str, data: bytes | None, timeout: float, headers: dict[str, str] | None = None) -> bytes:
    """POST and return the response body; an HTTP error becomes a RuntimeError carrying the server's answer."""
    request = urllib.request.Request(url, data=data, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()
    except urllib.error.HTTPError as error:
        body = error.read().decode(errors="replace")[:2000]
        raise RuntimeError(f"{url} answered HTTP {error.code}: {body}") from None


def _post_json(url: str, payload: dict[str, Any], timeout: float) -> Any:
    return json.loads(_post(url, json.dumps(payload).encode(), timeout, {"Content-Type": "application/json"}))


def get_json(url: str, timeout: float = 30.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def shares_a_corpus(config: BenchConfig) -> bool:
    """SGLang's NGRAM and TTS's hybrid drafting (`--tts-hybrid on`) draft from a server-wide corpus."""
    args = list(config.server_args)
    hybrid = any(a == "--tts-hybrid" and i + 1 < len(args) and args[i + 1] == "on" for i, a in enumerate(args))
    return config.variant == "ngram" or hybrid


def flush_cache(base_url: str, wait_s: float = 30.0) -> None:
    """SGLang's ``/flush_cache``: empties the prefix cache and the NGRAM corpus once the server is idle (it
    waits up to ``wait_s`` for the last request's bookkeeping); raises if the server refuses."""
    _post(f"{base_url}/flush_cache?timeout={wait_s:g}", None, wait_s + 30)


def send_generate(
    base_url: str,
    prompt: BenchPrompt,
    sampling: SamplingSettings,
    details: bool,
    timeout: float,
    max_new_tokens: int | None = None,
    stream: bool = False,
) -> Response:
    """SGLang's native ``/generate`` with token ids (the chat template was applied client-side)."""
    if prompt.input_ids is None:
        raise ValueError(f"prompt {prompt.id} has no token ids; use the OpenAI API or give a tokenizer")
    params = sampling.generate_params(max_new_tokens, prompt.id)
    if details:
        params["custom_params"] = DETAILS
    payload = {"input_ids": list(prompt.input_ids), "sampling_params": params}
    ttft = None
    if stream:
        out, ttft = _stream_generate(base_url + "/generate", payload, timeout)
    else:
        out = _post_json(base_url + "/generate", payload, timeout)
    meta = out.get("meta_info") or {}
    return Response(
        meta,
        int(meta.get("completion_tokens", len(out.get("output_ids") or []))),
        meta.get("prompt_tokens"),
        _digest(out.get("output_ids", out.get("text"))),
        out.get("text"),
        ttft,
    )


def _stream_generate(url: str, payload: dict[str, Any], timeout: float) -> tuple[dict[str, Any], float | None]:
    """A streamed ``/generate``: the last chunk (SGLang's chunks carry the whole output so far and its
    meta_info) and the seconds until the first chunk with a token arrived."""
    data = json.dumps({**payload, "stream": True}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    start, ttft, last = time.perf_counter(), None, {}
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                last = json.loads(line[len("data:") :])
                if ttft is None and (last.get("meta_info") or {}).get("completion_tokens", 0) >= 1:
                    ttft = time.perf_counter() - start
    except urllib.error.HTTPError as error:
        body = error.read().decode(errors="replace")[:2000]
        raise RuntimeError(f"{url} answered HTTP {error.code}: {body}") from None
    return last, ttft


@functools.lru_cache(maxsize=8)
def _openai_client(base_url: str, timeout: float) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=base_url + "/v1", api_key="none", timeout=timeout, max_retries=0)


def send_openai(
    base_url: str,
    model: str,
    prompt: BenchPrompt,
    sampling: SamplingSettings,
    details: bool,
    timeout: float,
    max_new_tokens: int | None = None,
) -> Response:
    """``/v1/chat/completions`` through the OpenAI client; meta_info comes back via ``extra_body``."""
    if prompt.messages is None:
        raise ValueError(f"prompt {prompt.id} has no chat messages; the OpenAI API needs them")
    client = _openai_client(base_url, timeout)
    extra: dict[str, Any] = {"return_meta_info": True, "top_k": sampling.top_k, "ignore_eos": sampling.ignore_eos}
    if details:
        extra["custom_params"] = DETAILS
    seed = sampling.request_seed(prompt.id)
    reply = client.chat.completions.create(
        model=model,
        messages=[dict(m) for m in prompt.messages],  # type: ignore[misc]
        max_tokens=sampling.max_new_tokens if max_new_tokens is None else max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        **({} if seed is None else {"seed": seed}),
        extra_body=extra,
    )
    choice = reply.choices[0]
    meta = (choice.model_extra or {}).get("meta_info") or {}
    usage = reply.usage
    return Response(
        meta,
        int(usage.completion_tokens if usage else meta.get("completion_tokens", 0)),
        usage.prompt_tokens if usage else meta.get("prompt_tokens"),
        _digest(choice.message.content),
        choice.message.content,
    )


def _finish_reason(meta: dict[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    if isinstance(reason, dict):
        return reason.get("type")
    return None if reason is None else str(reason)


def _opt(meta: dict[str, Any], key: str, cast: Callable[[Any], Any]) -> Any:
    value = meta.get(key)
    return None if value is None else cast(value)


def record_from_response(
    config: str, prompt: BenchPrompt, round_index: int, response: Response, wall_s: float, sampling: str = "greedy"
) -> RequestRecord:
    """A :class:`RequestRecord` from a response's meta_info (keys the server did not send stay None)."""
    meta = response.meta
    lengths = meta.get("tts_accept_lengths")
    return RequestRecord(
        config=config,
        dataset=prompt.dataset,
        prompt_id=prompt.id,
        round=round_index,
        completion_tokens=response.completion_tokens,
        wall_s=wall_s,
        sampling=sampling,
        prompt_tokens=response.prompt_tokens,
        finish_reason=_finish_reason(meta),
        accept_lengths=None if lengths is None else [int(x) for x in lengths],
        spec_accept_length=_opt(meta, "spec_accept_length", float),
        spec_verify_ct=_opt(meta, "spec_verify_ct", int),
        tts_num_updates=_opt(meta, "tts_num_updates", int),
        tts_num_skipped_updates=_opt(meta, "tts_num_skipped_updates", int),
        tts_trained_rounds=_opt(meta, "tts_trained_rounds", int),
        tts_update_ms=_opt(meta, "tts_update_ms", float),
        tts_guard_resets=_opt(meta, "tts_guard_resets", int),
        tts_prompt_positions=_opt(meta, "tts_prompt_positions", int),
        tts_prompt_ms=_opt(meta, "tts_prompt_ms", float),
        tts_suffix_rounds=_opt(meta, "tts_suffix_rounds", int),
        tts_suffix_accepted=_opt(meta, "tts_suffix_accepted", int),
        tts_drafter_rounds=_opt(meta, "tts_drafter_rounds", int),
        tts_drafter_accepted=_opt(meta, "tts_drafter_accepted", int),
        tts_drafter_retired=_opt(meta, "tts_drafter_retired", int),
        tts_idle_updates=_opt(meta, "tts_idle_updates", int),
        cached_tokens=_opt(meta, "cached_tokens", int),
        e2e_latency_s=_opt(meta, "e2e_latency", float),
        ttft_s=response.ttft_s,
        output_digest=response.output_digest,
        distinct_ngrams=None if response.text is None else distinct_by_quarter(response.text),
    )


# ----------------------------------------------------------------------------------------------------------
# The schedule
# ----------------------------------------------------------------------------------------------------------


# A request's timeout when none is given: time for its answer at MIN_TOKENS_PER_S, never under an hour.
# One answer of 8,192 sampled tokens at a 10-18K-token context ran at 1.4-2.6 tokens/s on the 2-core CPU
# (2026-12-03) and ran past the hour the old fixed timeout allowed, losing the request.
MIN_TOKENS_PER_S = 0.5
MIN_REQUEST_TIMEOUT_S = 3600.0


def request_timeout(max_new_tokens: int, given: float | None = None) -> float:
    """Seconds a request of up to `max_new_tokens` is waited for: `given`, or sized for its length."""
    if given is not None:
        return given
    return max(MIN_REQUEST_TIMEOUT_S, max_new_tokens / MIN_TOKENS_PER_S)


@dataclass
class RunnerSettings:
    """How servers are launched and requests are sent (shared by every configuration)."""

    model: str
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    # Every prompt runs once per temperature (0 = greedy), on the same server; the other sampling
    # parameters come from ``sampling``.
    temperatures: tuple[float, ...] = (0.0,)
    # Each mode runs once per concurrency: 1 = one request at a time; c > 1 = waves of c requests.
    concurrencies: tuple[int, ...] = (1,)
    api: str = "openai"  # "openai" (/v1/chat/completions through the openai client) | "generate"
    stream: bool = False  # api "generate" only: stream responses and record the time to the first token
    warmup_tokens: int = 32  # 0: no warm-up request
    warm_prompts: bool = True  # c > 1: prefill a wave's prompts before its clock starts (module docstring)
    request_timeout_s: float | None = None  # None: sized per request (request_timeout)
    server_timeout_s: float = 900.0
    cpu_defaults: bool = True  # add sglang_tts.bench.server.cpu_default_args(kv_tokens)
    kv_tokens: int | None = None  # KV pool the waves need (server.kv_pool_tokens); None: the CPU default
    server_env: dict[str, str] = field(default_factory=dict)
    log_dir: str | None = None
    base_url: str | None = None  # target this running server instead of launching any
    served_model: str | None = None  # the OpenAI "model" field (default: the model path)


OnRecord = Callable[[Unit, list[RequestRecord]], None]


class _CallbackError(Exception):
    """An ``on_record`` callback failed (its records could not be saved): the run stops, no slot is blamed."""


class Runner:
    """Executes a schedule slot by slot. ``on_record`` is called after each finished unit (a request, or a wave
    at concurrency > 1) with its records, ``on_slot`` after each slot (e.g. to save progress); units given as
    ``done`` (an earlier session's) are not sent again, and a slot with nothing left starts no server."""

    def __init__(self, settings: RunnerSettings) -> None:
        self.settings = settings
        self.records: list[RequestRecord] = []  # every finished unit's records, in schedule order
        self.slot_logs: list[SlotLog] = []
        self.finished: dict[Unit, list[RequestRecord]] = {}  # done before this session, or in it
        self._order: list[Unit] = []
        self._server: Any = None  # sglang_tts.bench.server.ServerProcess
        self._server_config: str | None = None

    def _send(
        self,
        base_url: str,
        prompt: BenchPrompt,
        details: bool,
        max_new_tokens: int | None = None,
        sampling: SamplingSettings | None = None,
    ) -> Response:
        s = self.settings
        sampling = sampling or s.sampling
        timeout = request_timeout(max_new_tokens or sampling.max_new_tokens, s.request_timeout_s)
        if s.api == "openai":
            model = s.served_model or s.model
            return send_openai(base_url, model, prompt, sampling, details, timeout, max_new_tokens)
        return send_generate(base_url, prompt, sampling, details, timeout, max_new_tokens, s.stream)

    def _stop(self) -> None:
        from sglang_tts.bench.server import stop_server

        if self._server is not None:
            stop_server(self._server)
        self._server, self._server_config = None, None

    def _ensure_server(self, config: BenchConfig, log: SlotLog) -> str:
        """The base URL serving ``config``: the external one, the live one, or a freshly started one."""
        if self.settings.base_url is not None:
            return self.settings.base_url
        if self._server is not None and self._server_config == config.name:
            return self._server.base_url
        self._stop()
        from sglang_tts.bench.server import start_server

        start = time.perf_counter()
        self._server = start_server(
            self.settings.model,
            config.server_args,
            cpu_defaults=self.settings.cpu_defaults,
            timeout_s=self.settings.server_timeout_s,
            env=self.settings.server_env,
            log_dir=self.settings.log_dir,
            kv_tokens=self.settings.kv_tokens,
            die_with_parent=True,  # a benchmark killed outright (kill -9) leaves no server computing on
        )
        self._server_config = config.name
        log.server_start_s = time.perf_counter() - start
        return self._server.base_url

    def units(self, slot: Slot) -> list[UnitPlan]:
        """The slot's units in the order they run: per concurrency, at 1 each prompt at every temperature;
        at c > 1, per temperature, the waves of c prompts (:func:`waves`)."""
        s = self.settings
        samplings = [replace(s.sampling, temperature=t) for t in s.temperatures]
        name = slot.config.name
        out: list[UnitPlan] = []
        for concurrency in s.concurrencies:
            if concurrency == 1:
                for i, prompt in enumerate(slot.prompts):
                    for sampling in samplings:
                        unit = Unit(name, slot.round, sampling.label, 1, i, (prompt.id,))
                        out.append(UnitPlan(unit, (prompt,), sampling))
                continue
            for sampling in samplings:
                label = mode_label(sampling.temperature, concurrency)
                for j, wave in enumerate(waves(slot.prompts, concurrency)):
                    unit = Unit(name, slot.round, label, concurrency, j, tuple(p.id for p in wave))
                    out.append(UnitPlan(unit, tuple(wave), sampling))
        return out

    def run(
        self,
        schedule: Sequence[Slot],
        on_slot: Callable[[Runner], None] | None = None,
        progress: bool = True,
        on_record: OnRecord | None = None,
        done: Mapping[Unit, Sequence[RequestRecord]] | None = None,
    ) -> list[RequestRecord]:
        plans = [self.units(slot) for slot in schedule]
        self._order = [p.unit for units in plans for p in units]
        wanted = set(self._order)
        self.finished = {unit: list(records) for unit, records in (done or {}).items() if unit in wanted}
        self._collect()
        tokens = self.settings.sampling.max_new_tokens  # what the bar counts per request
        bar = tqdm(
            total=sum(u.requests for u in self._order) * tokens,
            initial=sum(u.requests for u in self.finished) * tokens,
            desc="tokens",
            unit="tok",
            unit_scale=True,
            disable=not progress,
            dynamic_ncols=True,
        )
        with_work = [i for i, units in enumerate(plans) if any(p.unit not in self.finished for p in units)]
        failed: dict[str, str] = {}
        try:
            for n, i in enumerate(with_work):
                slot = schedule[i]
                remaining = [p for p in plans[i] if p.unit not in self.finished]
                log = SlotLog(slot.round, slot.config.name, [p.id for p in slot.prompts])
                log.done_before = len(plans[i]) - len(remaining)
                self.slot_logs.append(log)
                if slot.config.name in failed:
                    log.skipped, log.error = True, f"skipped: {failed[slot.config.name]}"
                    bar.update(sum(p.unit.requests for p in remaining) * tokens)
                    continue
                try:
                    self._run_slot(slot, remaining, log, bar, on_record)
                except _CallbackError as error:
                    raise error.__cause__ from None  # type: ignore[misc]
                except Exception as error:  # noqa: BLE001 - recorded; the other configurations still run
                    log.error = f"{type(error).__name__}: {error}"
                    failed[slot.config.name] = log.error.splitlines()[0]
                    if self._server is not None:
                        log.error += "\nserver log tail:\n" + self._server.log_tail(40)
                    tqdm.write(f"[bench] {slot.config.name} failed in round {slot.round}: {log.error}")
                    self._stop()
                    bar.update(sum(p.unit.requests for p in remaining if p.unit not in self.finished) * tokens)
                # Stop now unless the next slot with work runs the same configuration (one server at a time).
                following = schedule[with_work[n + 1]].config.name if n + 1 < len(with_work) else None
                if following != self._server_config:
                    self._stop()
                if on_slot is not None:
                    on_slot(self)
        finally:
            self._stop()
            bar.close()
        return self.records

    def _collect(self) -> None:
        self.records = [r for unit in self._order for r in self.finished.get(unit, ())]

    def _run_slot(
        self, slot: Slot, units: Sequence[UnitPlan], log: SlotLog, bar: tqdm, on_record: OnRecord | None
    ) -> None:
        config = slot.config
        bar.set_postfix_str(f"round {slot.round} {config.name}: starting server")
        base_url = self._ensure_server(config, log)
        if self.settings.warmup_tokens > 0 and log.server_start_s is not None:
            # The first request on a fresh server pays one-time costs (lazy init, allocator growth, the first
            # update's setup); a short unrecorded request keeps them out of the measured wall times.
            start = time.perf_counter()
            self._send(base_url, slot.prompts[0], config.speculative, self.settings.warmup_tokens)
            log.warmup_s = time.perf_counter() - start
        # NGRAM's corpus (and the hybrid's suffix trie) is server-wide: each request (or wave) starts from an
        # empty one (module docstring).
        own_text_only = shares_a_corpus(config)
        for plan in units:
            unit = plan.unit
            if unit.concurrency == 1:
                what = f"{plan.prompts[0].id} {unit.sampling}"
            else:
                what = f"{unit.sampling} wave {unit.index + 1} ({', '.join(dict.fromkeys(unit.prompt_ids))})"
            bar.set_postfix_str(f"round {slot.round} {config.name} {what}")
            if own_text_only:
                flush_cache(base_url)
            if unit.concurrency > 1 and self.settings.warm_prompts:
                for prompt in {p.id: p for p in plan.prompts}.values():
                    self._send(base_url, prompt, config.speculative, 1)
            if unit.concurrency == 1:
                prompt = plan.prompts[0]
                start = time.perf_counter()
                response = self._send(base_url, prompt, config.speculative, sampling=plan.sampling)
                wall = time.perf_counter() - start
                records = [record_from_response(config.name, prompt, slot.round, response, wall, unit.sampling)]
            else:
                records = self._send_wave(base_url, config, slot.round, plan.prompts, plan.sampling, unit.sampling)
            self.finished[unit] = records
            self._collect()
            bar.update(unit.requests * self.settings.sampling.max_new_tokens)
            if on_record is not None:
                try:
                    on_record(unit, records)
                except Exception as error:
                    raise _CallbackError(str(error)) from error

    def _send_wave(
        self,
        base_url: str,
        config: BenchConfig,
        round_index: int,
        wave: Sequence[BenchPrompt],
        sampling: SamplingSettings,
        label: str,
    ) -> list[RequestRecord]:
        """Send ``wave`` all at once (one thread per request) and record each with the wave's wall time."""

        def one(prompt: BenchPrompt) -> tuple[Response, float]:
            start = time.perf_counter()
            response = self._send(base_url, prompt, config.speculative, sampling=sampling)
            return response, time.perf_counter() - start

        start = time.perf_counter()
        pool = ThreadPoolExecutor(max_workers=len(wave))
        try:
            results = list(pool.map(one, wave))
        finally:
            # An interrupted wave (Ctrl-C, SIGTERM) must not wait for answers that may take an hour: the runner
            # stops the server, which ends the requests still in flight.
            pool.shutdown(wait=False, cancel_futures=True)
        wave_wall = time.perf_counter() - start
        records = []
        for prompt, (response, wall) in zip(wave, results):
            record = record_from_response(config.name, prompt, round_index, response, wall, label)
            record.concurrency, record.wave_wall_s = len(wave), wave_wall
            records.append(record)
        return records
