#!/usr/bin/env python
"""Where a TTS update's time goes: phase by phase, per drafter kind, scope, batch size and trained subset.

For every configuration (target model x drafter kind x scope x batch size x trained parameters) the script
builds the drafter at its real shape (EAGLE-3: the shipped drafter of the target; DFlash: a random one built
with ``build_dflash``, block 8 and 2 layers by default), random canvases of a verify round's shape, and a
``Distiller`` with a ``SyncExecutor`` and a ``PhaseTimer`` (sglang_tts/core/profiling.py). It then drives
``--warmup`` + ``--updates`` updates through the real path, ``observe(canvas)`` + ``barrier(force=True)``,
and reports the median milliseconds per update of each phase: the rollback copy, teacher, forward, loss,
backward, clipping, optimizer, finite check, the do-no-harm guard's scoring and the publish; "other" is what
the phases leave of the whole ``observe`` + ``barrier`` call. The shared scope takes no rollback copy on its
path (one step from the published weights); its column ``rollback if taken`` times the copy on its own.

What the worker thread takes from serving: a stand-in for a verify round, one forward of the target
(transformers, fp32) over ``--serving-tokens`` tokens per request with a KV cache of ``--context`` tokens,
timed on the main thread (a) alone, (b) while updates run back to back on the update executor's worker
thread (``ThreadExecutor`` on CPU), and (c) with the update inline after each round (``--tts-sync``). Only
for the trained subsets in ``--serving-trainable`` (default: all, and every per-request configuration).

Canvases. EAGLE-3: chain drafts, canvas length ``--eagle3-canvas`` (accepted path + 1; 4 for a fully
accepted chain of 3), features [B, F] (the anchor's target features), the drafter's K/V of ``--context``
past positions per layer, one entry per row; with ``--requests R`` the B rows are rounds of R requests
(row i of request i % R), as an update window stacks them (core/canvas.py stack_rounds): one K/V entry per
request (batch 1 at ``--one-request``, i.e. R = 1; otherwise read through ``context_rows``), each request's
latest row reading all ``--context`` positions and each earlier row of it 2 fewer. DFlash: canvas length
``--dflash-canvas`` (committed + 1, at most block - 1), the target features of the previous round's committed
tokens [B, n, F] and the drafter's K/V of the rest of the ``--context`` positions. In a batch, odd rows
accepted half as much (shorter valid canvas; EAGLE-3: ``--valid-lengths`` sets the rows' valid lengths in
turn instead).
Target logits are random with a clear top token inside the draft vocabulary, so every valid position enters
the loss.

Writes ``profile.json`` (machine info and one record per configuration) and ``profile.md`` (one table per
model / kind / scope) under ``--out`` after every configuration; a rerun skips the configurations already
in profile.json (delete it, or use another ``--out``, to measure again). Models are named as
scripts/prepare_model.py names them (prepared models only: an unprepared one is skipped, saying so) or
given as folders (then pass ``--eagle3-drafter``: no shipped EAGLE-3 drafter is found for a folder name
that is not a shipped target's)::

    .venv/bin/python scripts/profile_update.py                                  # everything, CPU
    .venv/bin/python scripts/profile_update.py --models SmolLM2-135M-Instruct --kinds eagle3 \\
        --scopes batch --batch-sizes 1 --trainable all fc --updates 5 --warmup 1 --out /tmp/profile
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

# Runnable from a checkout without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_tts.assets import MODELS, AssetError, is_model_ready, model_dir, model_source  # noqa: E402
from sglang_tts.bench.report import machine_info, table, write_json  # noqa: E402
from sglang_tts.config import FULL_RANK, TTSConfig  # noqa: E402
from sglang_tts.core.canvas import Canvas  # noqa: E402
from sglang_tts.core.distiller import Distiller  # noqa: E402
from sglang_tts.core.executor import SyncExecutor, make_executor  # noqa: E402
from sglang_tts.core.profiling import PhaseTimer  # noqa: E402
from sglang_tts.drafters.loading import load_drafter  # noqa: E402
from sglang_tts.drafters.shipped import shipped_drafter  # noqa: E402
from sglang_tts.sglang.adapters import adapters_from_config  # noqa: E402
from sglang_tts.training.dflash import DFlashTrainConfig, build_dflash  # noqa: E402
from sglang_tts.training.target import TargetWeights, target_weights  # noqa: E402

PHASES = ("rollback_copy", "teacher", "forward", "loss", "backward", "clip", "optimizer", "finite_check", "guard")
PUBLISH = "publish"
ALL_PHASES = (*PHASES, PUBLISH)
KINDS = ("eagle3", "dflash")
SCOPES = ("batch", "request")
# Trained parameter subsets of the shared scope (per-request adapters train their bank: one subset, "r<rank>").
SUBSETS = ("all", "fc", "fc+norms", "decoder")
SUBSET_HELP = "all: every trainable parameter; fc; fc+norms: fc and every *norm*; decoder: all but the LM head"
TOP_LOGIT = 30.0  # added to the teacher's top token: far above the N(0, 1) rest
PROFILE_JSON = "profile.json"
PROFILE_MD = "profile.md"
SCOPE_TITLES = {"batch": "shared drafter (scope batch)", "request": "per-request adapters (scope request)"}


@dataclass
class Settings:
    """What to profile and how (the command line)."""

    models: list[str]
    kinds: list[str]
    scopes: list[str]
    batch_sizes: list[int]
    trainable: list[str]
    updates: int = 20
    warmup: int = 3
    canvases: int = 3  # distinct random canvases, used in turn
    context: int = 512
    eagle3_canvas: int = 4
    requests: int = 0  # EAGLE-3: the rows are rounds of this many requests, one K/V entry each (0: a request per row)
    valid_lengths: tuple[int, ...] | None = None  # rows' valid canvas lengths, in turn (None: c and c // 2)
    dflash_canvas: int = 4
    dflash_block_size: int = 8
    dflash_layers: int = 2
    adapter_rank: int | str = 8
    max_adapted_requests: int = 16
    serving_rounds: int = 10
    serving_tokens: int = 4
    serving_trainable: tuple[str, ...] = ("all",)
    eagle3_drafter: Path | None = None
    device: str = "cpu"
    threads: int | None = None
    seed: int = 0
    out: Path = Path("docs/results/update-profile")


@dataclass(frozen=True)
class Configuration:
    model: str
    kind: str
    scope: str
    batch_size: int
    trainable: str  # a SUBSETS name, or "r<rank>" for per-request adapters

    @property
    def key(self) -> str:
        return f"{self.model}/{self.kind}/{self.scope}/b{self.batch_size}/{self.trainable}"


@dataclass
class Target:
    name: str
    path: Path
    model: nn.Module  # the transformers causal LM, the serving stand-in
    weights: TargetWeights
    caches: dict[int, Any]  # batch size -> KV cache of `context` tokens


def rank_label(rank: int | str) -> str:
    return f"r{rank}" if rank != FULL_RANK else "rfull"


def configurations(settings: Settings) -> Iterator[Configuration]:
    for model in settings.models:
        name = Path(model).name if Path(model).expanduser().is_dir() else model
        for kind in settings.kinds:
            for scope in settings.scopes:
                subsets = settings.trainable if scope == "batch" else [rank_label(settings.adapter_rank)]
                for batch_size in settings.batch_sizes:
                    for subset in subsets:
                        yield Configuration(name, kind, scope, batch_size, subset)


# ----------------------------------------------------------------------------------------------------------
# Models, drafters, canvases
# ----------------------------------------------------------------------------------------------------------


def resolve_target(spec: str) -> tuple[Path | None, str]:
    """(folder, "") for a folder or a prepared model name; (None, why) when it is not available."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path, ""
    try:
        source = model_source(spec)
    except AssetError:
        return None, f"{spec}: neither a folder nor a known model ({', '.join(MODELS)})"
    folder = model_dir(source)
    if not is_model_ready(folder, source):
        return None, (
            f"{source.name} is not prepared at {folder}: skipped "
            f"(prepare it with: .venv/bin/python scripts/prepare_model.py --model {source.name})"
        )
    return folder, ""


def load_target(name: str, path: Path, device: torch.device) -> Target:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.requires_grad_(False)
    model.to(device)
    return Target(name, path, model, target_weights(model, path), {})


def eagle3_folder(settings: Settings, target: Target) -> Path | None:
    if settings.eagle3_drafter is not None:
        return settings.eagle3_drafter
    return shipped_drafter(target.name, "eagle3")


def build_drafter(kind: str, settings: Settings, target: Target, device: torch.device) -> nn.Module:
    """A fresh drafter (a Distiller changes which of its parameters require grad, so none is reused)."""
    weights = target.weights
    if kind == "eagle3":
        folder = eagle3_folder(settings, target)
        if folder is None:
            raise FileNotFoundError(f"no EAGLE-3 drafter for {target.name}: pass --eagle3-drafter")
        return load_drafter(
            folder,
            target_embedding=weights.embedding,
            target_lm_head=weights.lm_head,
            target_config=weights.config,
            device=device,
        )
    cfg = DFlashTrainConfig(block_size=settings.dflash_block_size, num_layers=settings.dflash_layers)
    drafter, _ = build_dflash(weights, cfg, mask_token_id=weights.vocab_size - 1, seed=settings.seed)
    return drafter.to(device)


def subset_prefixes(drafter: nn.Module, subset: str) -> tuple[str, ...] | None:
    """TTSConfig.trainable for a SUBSETS name (name prefixes; None: all)."""
    names = [n for n, _ in drafter.trainable_named_parameters()]
    if subset == "all":
        return None
    if subset == "fc":
        return ("fc.",)
    if subset == "fc+norms":
        return ("fc.", *(n for n in names if "norm" in n and not n.startswith("fc.")))
    if subset == "decoder":
        return tuple(dict.fromkeys(n.split(".")[0] + "." for n in names if not n.startswith("lm_head.")))
    raise ValueError(f"unknown trainable subset {subset!r} (one of {', '.join(SUBSETS)})")


def selected_names(drafter: nn.Module, prefixes: tuple[str, ...] | None) -> frozenset[str]:
    names = [n for n, _ in drafter.trainable_named_parameters()]
    return frozenset(n for n in names if prefixes is None or any(n.startswith(p) for p in prefixes))


def _valid_lengths(b: int, c: int, pattern: Sequence[int] | None = None) -> torch.Tensor:
    """Row r's valid canvas length: `pattern` in turn (each clamped to 1..c), or by default c, and half
    of it on odd rows (requests that accepted less)."""
    pattern = (c, max(1, c // 2)) if not pattern else pattern
    return torch.tensor([min(c, max(1, pattern[r % len(pattern)])) for r in range(b)], dtype=torch.long)


def _teacher(b: int, c: int, vocab: int, top: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    logits = torch.randn(b, c, vocab, generator=gen)
    logits.scatter_add_(-1, top[..., None], torch.full((b, c, 1), TOP_LOGIT))
    return logits


def eagle3_canvas(
    base: nn.Module,
    b: int,
    c: int,
    context: int,
    gen: torch.Generator,
    requests: int = 0,
    valid_lengths: Sequence[int] | None = None,
) -> Canvas:
    cfg = base.cfg
    draft_ids = base.draft_to_target_ids().cpu()

    def pick(*shape: int) -> torch.Tensor:
        return draft_ids[torch.randint(0, draft_ids.numel(), shape, generator=gen)]

    lengths = _valid_lengths(b, c, valid_lengths)
    kv_rows = min(requests, b) if requests > 0 else b
    kv = [
        tuple(torch.randn(kv_rows, cfg.num_key_value_heads, context, cfg.head_dim, generator=gen) for _ in range(2))
        for _ in base.layers
    ]
    # Row i of request i % R is the round 2 ((B - 1 - i) // R) positions before its request's latest.
    rows = torch.arange(b)
    reads = (context - 2 * ((b - 1 - rows) // kv_rows)).clamp(min=1) if requests > 0 else torch.full((b,), context)
    return Canvas(
        input_ids=pick(b, c),
        positions=(reads[:, None] + torch.arange(c)[None]).clone(),
        target_logits=_teacher(b, c, cfg.vocab_size, pick(b, c), gen),
        valid=torch.arange(c)[None] < lengths[:, None],
        features=torch.randn(b, base.fc.in_features, generator=gen),
        past_kv=kv,
        past_mask=torch.arange(context)[None] < reads[:, None],
        num_accepted=lengths - 1,
        context_rows=(rows % kv_rows).tolist() if 1 < kv_rows < b else None,
    )


def dflash_canvas(base: nn.Module, b: int, c: int, context: int, gen: torch.Generator) -> Canvas:
    """Anchor at position `context`; the previous round committed n_r tokens (their features are in the
    canvas), the drafter's K/V hold the context before them."""
    cfg = base.cfg
    c = min(c, base.block_size - 1)
    lengths = _valid_lengths(b, c)
    recent = int(lengths.max())
    rows = torch.arange(recent)
    starts = context - lengths  # first position of each row's recent features
    past_len = int(starts.max())  # K/V rows: each request's context before its recent features
    kv = [
        tuple(torch.randn(b, cfg.num_key_value_heads, past_len, cfg.head_dim, generator=gen) for _ in range(2))
        for _ in base.layers
    ]
    return Canvas(
        input_ids=torch.randint(0, cfg.vocab_size, (b, c), generator=gen),
        positions=(context + torch.arange(c)).expand(b, c).clone(),
        target_logits=_teacher(b, c, cfg.vocab_size, torch.randint(0, cfg.vocab_size, (b, c), generator=gen), gen),
        valid=torch.arange(c)[None] < lengths[:, None],
        features=torch.randn(b, recent, base.fc.in_features, generator=gen),
        past_kv=kv,
        past_mask=torch.arange(past_len)[None] < starts[:, None],
        context_positions=starts[:, None] + rows[None],
        context_mask=rows[None] < lengths[:, None],
        num_accepted=lengths - 1,
    )


def make_canvases(
    kind: str, base: nn.Module, config: Configuration, settings: Settings, device: torch.device
) -> list[Canvas]:
    gen = torch.Generator().manual_seed(settings.seed)
    build, length = (
        (eagle3_canvas, settings.eagle3_canvas) if kind == "eagle3" else (dflash_canvas, settings.dflash_canvas)
    )
    out = []
    for _ in range(settings.canvases):
        if kind == "eagle3":
            canvas = eagle3_canvas(
                base, config.batch_size, length, settings.context, gen, settings.requests, settings.valid_lengths
            )
        else:
            canvas = build(base, config.batch_size, length, settings.context, gen)
        if config.scope == "request":
            canvas.slots = torch.arange(config.batch_size, dtype=torch.long)
        out.append(canvas.to(device))
    return out


# ----------------------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------------------


def _sync_fn(device: torch.device) -> Callable[[], None] | None:
    return torch.cuda.synchronize if device.type == "cuda" else None


def _median(values: Sequence[float]) -> float:
    return round(statistics.median(values), 3) if values else float("nan")


def one_update(distiller: Distiller, canvas: Canvas) -> tuple[dict[str, float], float, float, str]:
    """observe + barrier(force=True) (SyncExecutor): phase ms, the call's ms, the update's own ms, status."""
    timer = distiller.timer
    timer.reset()
    start = time.perf_counter()
    distiller.observe(canvas, owned=True)
    distiller.barrier(force=True)
    total = (time.perf_counter() - start) * 1e3
    result = distiller.executor.last_result
    status = result.value.status if result is not None and result.error is None else "error"
    run_ms = result.timing.run_s * 1e3 if result is not None else float("nan")
    return {k: v * 1e3 for k, v in timer.seconds.items()}, total, run_ms, status


def serving_cache(model: nn.Module, batch_size: int, context: int, device: torch.device) -> Any:
    """A transformers KV cache holding `context` random positions per request (as after a prefill)."""
    from transformers import DynamicCache

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    cache = DynamicCache(config=cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for layer in range(cfg.num_hidden_layers):
            k, v = (torch.randn(batch_size, kv_heads, context, head_dim, generator=gen) for _ in range(2))
            cache.update(k.to(device), v.to(device), layer)
    return cache


def serving_round(target: Target, cache: Any, tokens: torch.Tensor, sync: Callable[[], None] | None) -> float:
    """One verify-shaped target forward; the cache is cut back to its context afterwards. Returns ms."""
    start = time.perf_counter()
    with torch.inference_mode():
        target.model(input_ids=tokens, past_key_values=cache, use_cache=True)
        cache.crop(-tokens.shape[1])
    if sync is not None:
        sync()
    return (time.perf_counter() - start) * 1e3


def measure_serving(
    target: Target,
    distiller: Distiller,
    canvases: list[Canvas],
    config: Configuration,
    settings: Settings,
    device: torch.device,
) -> dict[str, Any]:
    """Round ms alone, with updates back to back on the worker thread, and with the update inline."""
    sync = _sync_fn(device)
    b = config.batch_size
    cache = target.caches.get(b)
    if cache is None:
        cache = target.caches[b] = serving_cache(target.model, b, settings.context, device)
    vocab = target.weights.vocab_size
    gen = torch.Generator().manual_seed(settings.seed + 7)

    def tokens() -> torch.Tensor:
        return torch.randint(0, vocab, (b, settings.serving_tokens), generator=gen).to(device)

    rounds = settings.serving_rounds
    timer, distiller.timer = distiller.timer, None  # no phase syncs while the worker overlaps
    try:
        for _ in range(2):
            serving_round(target, cache, tokens(), sync)
        alone = [serving_round(target, cache, tokens(), sync) for _ in range(rounds)]

        # (b) updates back to back on the update executor's worker thread, the main thread serving.
        stop = threading.Event()
        worker_ms: list[float] = []

        def updates_back_to_back() -> None:
            i = 0
            while not stop.is_set():
                exact = distiller._needs_rollback_copy(distiller.config.steps_per_update)
                start = time.perf_counter()
                distiller._update(canvases[i % len(canvases)], i, i, exact)
                if sync is not None:
                    sync()
                worker_ms.append((time.perf_counter() - start) * 1e3)
                i += 1

        executor = make_executor(device, sync=False, cpu_thread=True)  # the worker thread, on CPU too
        executor.submit(updates_back_to_back)
        with_worker: list[float] = []
        try:
            # Enough rounds to overlap at least two whole updates (capped: a slow update must not stall the run).
            while (len(with_worker) < rounds or len(worker_ms) < 2) and len(with_worker) < 20 * rounds:
                with_worker.append(serving_round(target, cache, tokens(), sync))
        finally:
            stop.set()
            result = executor.wait()
            executor.close()
        if result is not None and result.error is not None:
            raise RuntimeError(f"the worker's updates failed: {result.error!r}") from result.error

        # (c) the update inline: each round is the target forward, then observe + barrier (SyncExecutor).
        inline_rounds, inline_updates = [], []
        for i in range(rounds):
            start = time.perf_counter()
            serving_round(target, cache, tokens(), sync)
            distiller.observe(canvases[i % len(canvases)], owned=True)
            distiller.barrier(force=True)
            inline_rounds.append((time.perf_counter() - start) * 1e3)
            inline_updates.append(distiller.executor.last_result.timing.run_s * 1e3)
    finally:
        distiller.timer = timer
    alone_ms, worker_round_ms = _median(alone), _median(with_worker)
    return {
        "batch_size": b,
        "tokens": settings.serving_tokens,
        "context": settings.context,
        "rounds": rounds,
        "round_alone_ms": alone_ms,
        "round_with_worker_ms": worker_round_ms,
        "rounds_with_worker": len(with_worker),
        "slowdown": round(worker_round_ms / alone_ms, 3),
        "update_on_worker_ms": _median(worker_ms),
        "updates_on_worker": len(worker_ms),
        "update_inline_ms": _median(inline_updates),
        "round_inline_ms": _median(inline_rounds),
    }


def profile(
    config: Configuration, target: Target, settings: Settings, device: torch.device
) -> tuple[dict[str, Any] | None, str]:
    """One configuration's record, or (None, why) when it is skipped."""
    base = build_drafter(config.kind, settings, target, device)
    tts = TTSConfig(
        update_stride=1,
        stride_pinned=True,
        log_interval=0,
        scope=config.scope,  # type: ignore[arg-type]
        adapter_rank=settings.adapter_rank,  # type: ignore[arg-type]
        max_adapted_requests=settings.max_adapted_requests,
    )
    prefixes: tuple[str, ...] | None = None
    if config.scope == "request":
        if config.batch_size > settings.max_adapted_requests:
            return None, f"batch {config.batch_size} > --max-adapted-requests {settings.max_adapted_requests}"
        drafter: nn.Module = adapters_from_config(base, tts).to(device)
        # As the SGLang runtime does (sglang/binding.py): low-rank adapters train at their own rate.
        tts = replace(tts, lr=tts.lr if settings.adapter_rank == FULL_RANK else tts.adapter_lr)
    else:
        prefixes = subset_prefixes(base, config.trainable)
        names = selected_names(base, prefixes)
        # A subset that selects what an earlier one does (e.g. DFlash's decoder = all) is not measured twice.
        for earlier in settings.trainable[: settings.trainable.index(config.trainable)]:
            if selected_names(base, subset_prefixes(base, earlier)) == names:
                return None, f"same parameters as {earlier}"
        drafter = base
        tts = replace(tts, trainable=prefixes)
    distiller = Distiller(drafter, tts.validate(), executor=SyncExecutor())
    sync = _sync_fn(device)
    distiller.timer = PhaseTimer(sync=sync)
    canvases = make_canvases(config.kind, base, config, settings, device)
    try:
        for i in range(settings.warmup):
            one_update(distiller, canvases[i % len(canvases)])
        phases: list[dict[str, float]] = []
        totals, runs, statuses = [], [], []
        for i in range(settings.updates):
            ms, total, run_ms, status = one_update(distiller, canvases[(settings.warmup + i) % len(canvases)])
            phases.append(ms)
            totals.append(total)
            runs.append(run_ms)
            statuses.append(status)
        ran = [p for p in ALL_PHASES if any(p in ms for ms in phases)]
        ran += sorted({p for ms in phases for p in ms} - set(ran))  # phases added to the Distiller later
        rollback_if_taken = None
        if "rollback_copy" not in ran:  # the shared scope's path skips it: what it costs when taken
            copies = []
            for _ in range(max(settings.updates, 1)):
                start = time.perf_counter()
                distiller._rollback.save(distiller.optimizer)
                if sync is not None:
                    sync()
                copies.append((time.perf_counter() - start) * 1e3)
            rollback_if_taken = _median(copies)
        numel = sum(p.numel() for p in distiller.train_params)
        record: dict[str, Any] = {
            **asdict(config),
            "prefixes": list(prefixes) if prefixes is not None else None,
            "numel_trained": numel,
            "tensors_trained": len(distiller.train_params),
            "numel_per_request": numel // settings.max_adapted_requests if config.scope == "request" else None,
            "canvas_length": canvases[0].length,
            "context": settings.context,
            "updates": settings.updates,
            "warmup": settings.warmup,
            "phases_ms": {p: _median([ms.get(p, 0.0) for ms in phases]) for p in ran},
            "phase_updates": {p: sum(p in ms for ms in phases) for p in ran},
            "other_ms": _median([t - sum(ms.values()) for t, ms in zip(totals, phases)]),
            "total_ms": _median(totals),
            "update_ms": _median(runs),
            "rollback_copy_if_taken_ms": rollback_if_taken,
            "outcomes": {s: statuses.count(s) for s in sorted(set(statuses))},
            "guard_resets": distiller.stats.num_guard_resets,
            "serving": None,
        }
        if config.scope == "request" or config.trainable in settings.serving_trainable:
            record["serving"] = measure_serving(target, distiller, canvases, config, settings, device)
        return record, ""
    finally:
        distiller.close()


# ----------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    if value is None or value != value:
        return "–"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _row_order(record: dict[str, Any]) -> tuple:
    subset = record["trainable"]
    return (record["batch_size"], SUBSETS.index(subset) if subset in SUBSETS else len(SUBSETS), subset)


def render_markdown(payload: dict[str, Any]) -> str:
    meta, results = payload["meta"], payload["results"]
    device = (
        meta.get("gpu") if meta.get("device") == "cuda" else f"{meta.get('processor')} ({meta.get('cpu_count')} CPUs)"
    )
    lines = [
        "# Where a TTS update's time goes",
        "",
        f"{device}, {meta.get('torch_threads')} torch threads, torch {meta.get('torch')}, fp32; "
        f"{meta.get('date')}. Command: `{meta.get('command')}`.",
        "",
        "Median ms per update over the measured updates (after warm-up) of `observe(canvas)` + "
        "`barrier(force=True)` with a SyncExecutor; a phase that does not run on the path shows –. "
        "*other*: the call's time outside the phases. *rollback if taken*: the rollback copy timed on its "
        "own where the path skips it (one step of the shared drafter from published weights). Numel: "
        "trained parameters (per-request scope: every adapter slot; per request in brackets). Canvases "
        "and the serving stand-in: see the docstring of scripts/profile_update.py.",
    ]
    sections: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for record in results.values():
        sections.setdefault((record["model"], record["kind"], record["scope"]), []).append(record)
    model_order = list(dict.fromkeys(r["model"] for r in results.values()))

    def section_order(key: tuple[str, str, str]) -> tuple:
        model, kind, scope = key
        return (model_order.index(model), KINDS.index(kind), SCOPES.index(scope))

    skipped = payload.get("skipped", {})
    for key in sorted(sections, key=section_order):
        model, kind, scope = key
        records = sorted(sections[key], key=_row_order)
        phases = [p for p in ALL_PHASES if any(p in r["phases_ms"] for r in records)]
        phases += sorted({p for r in records for p in r["phases_ms"]} - set(phases) - set(ALL_PHASES))
        if any(r["rollback_copy_if_taken_ms"] is not None for r in records) and "rollback_copy" not in phases:
            phases.insert(0, "rollback_copy")
        header = ["config", *(p.replace("_", " ") for p in phases), "other", "total", "numel"]
        rows = []
        for r in records:
            numel = f"{r['numel_trained']:,}"
            if r.get("numel_per_request"):
                numel += f" ({r['numel_per_request']:,})"
            rows.append(
                [f"B={r['batch_size']} {r['trainable']}"]
                + [_ms(r["phases_ms"].get(p)) for p in phases]
                + [_ms(r["other_ms"]), _ms(r["total_ms"]), numel]
            )
        lines += ["", f"## {model} · {kind} · {SCOPE_TITLES.get(scope, scope)}", ""]
        first = records[0]
        lines.append(
            f"Canvas length {first['canvas_length']}, context {first['context']}, "
            f"{first['updates']} updates after {first['warmup']} warm-up."
        )
        lines += ["", table(header, rows)]
        taken = [r for r in records if r["rollback_copy_if_taken_ms"] is not None]
        if taken:
            notes = ", ".join(
                f"B={r['batch_size']} {r['trainable']} {_ms(r['rollback_copy_if_taken_ms'])}" for r in taken
            )
            lines += ["", f"Rollback copy if taken (ms): {notes}."]
        odd = [r for r in records if set(r["outcomes"]) != {"ok"} or r["guard_resets"]]
        for r in odd:
            lines.append(
                f"\nB={r['batch_size']} {r['trainable']}: outcomes {r['outcomes']}, guard resets {r['guard_resets']}."
            )
        prefix = f"{model}/{kind}/{scope}/"
        for skipped_key, why in skipped.items():
            if skipped_key.startswith(prefix):
                lines.append(f"\n{skipped_key.removeprefix(prefix)}: not measured ({why}).")
        serving = [r for r in records if r["serving"]]
        if serving:
            header = [
                "config",
                "round alone",
                "round + worker",
                "slowdown",
                "update on worker",
                "update inline",
                "round inline",
            ]
            rows = [
                [
                    f"B={r['batch_size']} {r['trainable']}",
                    _ms(s["round_alone_ms"]),
                    _ms(s["round_with_worker_ms"]),
                    f"{s['slowdown']:.2f}x",
                    _ms(s["update_on_worker_ms"]),
                    _ms(s["update_inline_ms"]),
                    _ms(s["round_inline_ms"]),
                ]
                for r in serving
                for s in [r["serving"]]
            ]
            s0 = serving[0]["serving"]
            lines += [
                "",
                f"What the worker thread takes from serving (ms): a target forward of {s0['tokens']} tokens per "
                f"request over a {s0['context']}-token KV cache, median of {s0['rounds']}+ rounds, alone, while "
                "updates run back to back on the worker thread, and with the update inline after it.",
                "",
                table(header, rows),
            ]
    unavailable = payload.get("unavailable", {})
    if unavailable:
        lines += ["", "## Not measured", ""] + [f"- {why}" for why in unavailable.values()]
    return "\n".join(lines) + "\n"


def write_report(out: Path, payload: dict[str, Any]) -> None:
    write_json(out / PROFILE_JSON, payload)
    (out / PROFILE_MD).write_text(render_markdown(payload))


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> Settings:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = ap.add_argument
    add(
        "--models",
        nargs="+",
        default=list(MODELS),
        help="prepared model names or target folders (default: %(default)s)",
    )
    add("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    add("--scopes", nargs="+", choices=SCOPES, default=list(SCOPES), help="batch: shared drafter; request: adapters")
    add("--batch-sizes", nargs="+", type=int, default=[1, 4])
    add("--trainable", nargs="+", choices=SUBSETS, default=list(SUBSETS), help=f"shared scope only. {SUBSET_HELP}")
    add("--updates", type=int, default=20, help="measured updates per configuration (median)")
    add("--warmup", type=int, default=3, help="updates run first and not measured")
    add("--canvases", type=int, default=3, help="distinct random canvases, used in turn")
    add("--context", type=int, default=512, help="past positions of the drafter's K/V and the target's KV cache")
    add("--eagle3-canvas", type=int, default=4, help="EAGLE-3 canvas length (accepted path + 1)")
    add("--one-request", action="store_true", help="EAGLE-3: the B rows are rounds of one request (--requests 1)")
    add(
        "--requests",
        type=int,
        default=0,
        help="EAGLE-3: the B rows are rounds of this many requests (an update window at several; 0: one per row)",
    )
    add(
        "--valid-lengths",
        nargs="+",
        type=int,
        default=None,
        help="EAGLE-3: the rows' valid canvas lengths, in turn (default: the canvas length, half of it on odd rows)",
    )
    add("--dflash-canvas", type=int, default=4, help="DFlash canvas length (committed + 1, at most block - 1)")
    add("--dflash-block-size", type=int, default=8)
    add("--dflash-layers", type=int, default=2)
    add("--adapter-rank", default="8", help="per-request adapter rank (or 'full')")
    add("--max-adapted-requests", type=int, default=16, help="adapter slots (all are copied for the rollback)")
    add("--serving-rounds", type=int, default=10, help="target forwards timed per serving measurement")
    add("--serving-tokens", type=int, default=4, help="tokens per request of the verify-shaped target forward")
    add(
        "--serving-trainable",
        nargs="*",
        choices=SUBSETS,
        default=["all"],
        help="shared-scope subsets that also get the serving measurement (per-request: always)",
    )
    add("--eagle3-drafter", type=Path, default=None, help="EAGLE-3 drafter folder (default: the shipped one)")
    add("--device", default="cpu")
    add("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add("--seed", type=int, default=0)
    add("--out", type=Path, default=None, help="output folder (default: docs/results/update-profile-<date>)")
    args = ap.parse_args(argv)
    rank: int | str = FULL_RANK if args.adapter_rank == FULL_RANK else int(args.adapter_rank)
    for flag in ("updates", "canvases", "context", "eagle3_canvas", "dflash_canvas", "serving_rounds"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    out = args.out if args.out is not None else Path("docs/results") / f"update-profile-{time.strftime('%Y-%m-%d')}"
    return Settings(
        models=args.models,
        kinds=args.kinds,
        scopes=args.scopes,
        batch_sizes=args.batch_sizes,
        trainable=args.trainable,
        updates=args.updates,
        warmup=max(args.warmup, 0),
        canvases=args.canvases,
        context=args.context,
        eagle3_canvas=args.eagle3_canvas,
        requests=1 if args.one_request else args.requests,
        valid_lengths=tuple(args.valid_lengths) if args.valid_lengths else None,
        dflash_canvas=args.dflash_canvas,
        dflash_block_size=args.dflash_block_size,
        dflash_layers=args.dflash_layers,
        adapter_rank=rank,
        max_adapted_requests=args.max_adapted_requests,
        serving_rounds=args.serving_rounds,
        serving_tokens=args.serving_tokens,
        serving_trainable=tuple(args.serving_trainable),
        eagle3_drafter=args.eagle3_drafter,
        device=args.device,
        threads=args.threads,
        seed=args.seed,
        out=out,
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    settings = parse_args(argv)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    device = torch.device(settings.device)
    path = settings.out / PROFILE_JSON
    payload: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    payload.setdefault("results", {})
    payload.setdefault("skipped", {})  # configurations never measured (e.g. a subset equal to another)
    command = shlex.join(["scripts/profile_update.py", *(sys.argv[1:] if argv is None else argv)])
    payload["meta"] = {
        **machine_info(),
        "device": device.type,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": command,
        "settings": json.loads(json.dumps(asdict(settings), default=str)),
    }
    payload["unavailable"] = {}  # models or drafters missing this run (tried again by the next one)
    done = set(payload["results"]) | set(payload["skipped"])
    plan = list(configurations(settings))
    todo = [c for c in plan if c.key not in done]
    runs = payload.setdefault("runs", [])
    runs.append({"date": payload["meta"]["date"], "command": command, "configurations": [c.key for c in todo]})
    if len(todo) < len(plan):
        print(f"profile_update: {len(plan) - len(todo)} of {len(plan)} configurations already in {path}; skipped")

    targets: dict[str, Target | None] = {}
    specs = {Path(m).name if Path(m).expanduser().is_dir() else m: m for m in settings.models}
    for config in tqdm(todo, desc="profile_update", unit="config"):
        if config.model not in targets:
            for name in [n for n, t in targets.items() if t is not None]:  # one target in memory at a time
                targets[name] = None
            gc.collect()
            folder, why = resolve_target(specs[config.model])
            if folder is None:
                payload["unavailable"][config.model] = why
                tqdm.write(f"profile_update: {why}")
                targets[config.model] = None
                continue
            targets[config.model] = load_target(config.model, folder, device)
        target = targets[config.model]
        if target is None:
            continue
        if config.kind == "eagle3" and eagle3_folder(settings, target) is None:
            why = f"{config.model}: no shipped EAGLE-3 drafter (pass --eagle3-drafter): eagle3 skipped"
            if f"{config.model}/eagle3" not in payload["unavailable"]:
                tqdm.write(f"profile_update: {why}")
            payload["unavailable"][f"{config.model}/eagle3"] = why
            continue
        tqdm.write(f"profile_update: {config.key}")
        record, why = profile(config, target, settings, device)
        if record is None:
            payload["skipped"][config.key] = why
            tqdm.write(f"profile_update: {config.key} skipped: {why}")
        else:
            payload["results"][config.key] = record
            tqdm.write(
                f"profile_update: {config.key}: {record['total_ms']:.1f} ms per update "
                + " ".join(f"{p}={v:.1f}" for p, v in record["phases_ms"].items())
            )
        write_report(settings.out, payload)
        gc.collect()
    write_report(settings.out, payload)
    print(f"profile_update: wrote {settings.out / PROFILE_JSON} and {settings.out / PROFILE_MD}")
    print(render_markdown(payload))
    return payload


if __name__ == "__main__":
    main()
