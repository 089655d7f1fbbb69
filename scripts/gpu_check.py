#!/usr/bin/env python
"""The GPU path, by construction: checks that need only torch (and triton), no SGLang.

Each check runs the package's real code (no re-implementation) on tiny shapes and reports pass, fail or skip
with a reason. On CUDA everything runs; on CPU what CPU can (the Triton kernels through the interpreter, the
worker-thread executor, publishing), and the checks that only mean something on a GPU report skip.

    check                    CPU                                           CUDA
    kernel_linear_kl         Triton (interpreter) vs naive reference       compiled, fp32 and bf16, V > one block
    kernel_gather_draft      Triton (interpreter) vs PyTorch reference     compiled, 128k target vocabulary
    kernel_lowrank_delta     Triton (interpreter) vs PyTorch reference     compiled, fp32 and bf16
    executor_barrier         ThreadExecutor: overlap, barrier, errors      SideStreamExecutor("cuda"): side stream
                                                                           waits for serving, wait() is the barrier
    publish_all_or_nothing   EAGLE-3 drafter + Distiller + worker thread:  same, side stream (loss and gather run
                             drafts and weight reads see one version       the Triton kernels inside the update)
    graph_replay_publish     skip                                          captured draft step; replays between
                                                                           in-place publishes see all-old or
                                                                           all-new weights
    adapter_kernel_capture   skip                                          lowrank_delta (Triton) inside a CUDA
                                                                           graph, adapters published in place
    sync_free_round          skip                                          TTSRuntime.before_draft/observe under
                                                                           torch.cuda.set_sync_debug_mode("error")
    sampled_verify_ops       skip (tests/platform/test_spec_sampling.py)   spec_sampling's tree sampler and top-k /
                                                                           top-p renorm under the sync-debug mode,
                                                                           equal to the same ops on CPU
    update_at_scale          the rehearsal: the same code at tiny sizes    EAGLE-3 (32K, 128K draft vocabulary) and
                             (--scale tiny), timings not meaningful        DFlash drafters for an 8B target: one
                                                                           update on the side stream against a
                                                                           memory-bound verify stand-in; update
                                                                           time, share hidden at strides 1/2/5/10,
                                                                           round slowdown (--scale 8b)
    no_sglang_import         no sglang module got imported                 same

Usage (the exit status is 1 when a check fails; skips are fine)::

    .venv/bin/python scripts/gpu_check.py                    # cuda if available, else cpu
    .venv/bin/python scripts/gpu_check.py --device cpu --json gpu_check.json --markdown gpu_check.md
    python scripts/gpu_check.py --only update_at_scale --round-ms 8   # the 8B-scale update alone, 8 ms rounds
    python scripts/gpu_check.py --list

update_at_scale measures; its numbers are in the JSON (`metrics`) and Markdown reports and in a table printed after
the checks. It fails only when an update fails or publishes nothing; the issue's targets (>= 80% hidden at stride
5, round slowdown <= 15%) are reported as met or missed, on the 8b scale on CUDA.

On CPU the script sets TRITON_INTERPRET=1 before anything imports Triton (unless the variable is already set);
on CUDA a set TRITON_INTERPRET=1 fails the kernel checks (they exist to test the compiled kernels). The script
runs from a bare checkout: when `sglang_tts` is not installed it puts the repository root on sys.path.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("sglang_tts") is None:  # a bare checkout on a GPU machine: torch + triton only
    sys.path.insert(0, str(REPO))

PASS, FAIL, SKIP = "pass", "fail", "skip"


class Skip(Exception):
    """The check cannot run here; the message says why."""


class CheckFailed(AssertionError):
    """The property the check tests does not hold; the message says how."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


@dataclass
class Context:
    device: torch.device
    scale: str = "auto"  # update_at_scale's sizes: "8b", "tiny", or "auto" (8b on CUDA, tiny elsewhere)
    round_ms: float | None = None  # update_at_scale's round time; None: the scale's
    trainable: tuple[str, ...] | None = None  # update_at_scale's trained parameters (name prefixes); None: all
    # update_at_scale: serve on a stream of this CUDA priority (lower is more urgent; the side stream keeps the
    # default 0, the least urgent); None: the default stream, as SGLang serves
    serving_priority: int | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def scale_name(self) -> str:
        return ("8b" if self.cuda else "tiny") if self.scale == "auto" else self.scale

    def generator(self, seed: int) -> torch.Generator:
        # CPU generator: tensors are drawn on the host and moved, so CPU and CUDA runs see the same numbers.
        return torch.Generator().manual_seed(seed)


@dataclass
class CheckResult:
    name: str
    result: str  # pass | fail | skip
    seconds: float
    detail: str
    metrics: dict[str, Any] | None = None  # the measurements of a check that measures (update_at_scale)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude."""
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-12)


# ----------------------------------------------------------------------------- Triton kernels


def _is_interpreted(kernel: Any) -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - older/newer Triton layouts
        return os.environ.get("TRITON_INTERPRET") == "1"
    return isinstance(kernel, InterpretedFunction)


def _triton_module(ctx: Context, module_name: str, kernel_attr: str) -> tuple[Any, str]:
    """Import one kernel module; skip without Triton, refuse a kernel in the wrong mode for the device."""
    from sglang_tts import kernels

    if not kernels.triton_available():
        raise Skip("triton is not importable here (the PyTorch backends serve instead)")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if ctx.cuda and interpret:
        raise CheckFailed("TRITON_INTERPRET=1 is set: on CUDA this check is for the compiled kernels; unset it")
    if not ctx.cuda and not interpret:
        raise Skip("Triton runs on CPU only through its interpreter, and TRITON_INTERPRET is not 1 here")
    module = importlib.import_module(f"sglang_tts.kernels.{module_name}")
    interpreted = _is_interpreted(getattr(module, kernel_attr))
    if interpreted and ctx.cuda:
        raise CheckFailed(f"{module.__name__} was imported with TRITON_INTERPRET=1: its kernel is not compiled")
    if not interpreted and not ctx.cuda:
        raise Skip(
            f"{module.__name__} was imported in this process before TRITON_INTERPRET=1 was set, so its kernel "
            "cannot run on CPU tensors; run the script in a fresh process"
        )
    return module, "interpreted" if interpreted else "compiled"


def _linear_kl_problem(n: int, h: int, v: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    hidden = torch.randn(n, h, generator=gen) * 0.5
    weight = torch.randn(v, h, generator=gen) * 0.2
    teacher = torch.softmax(torch.randn(n, v, generator=gen) * 3.0, dim=-1)
    teacher[teacher < 1.0 / v] = 0.0  # exact zeros
    teacher = teacher / teacher.sum(-1, keepdim=True)
    teacher[min(1, n - 1)] = 0.0  # a row without draft-vocabulary mass contributes nothing
    prev = torch.softmax(torch.randn(n, v, generator=gen), dim=-1)
    weights = torch.rand(n, generator=gen) + 0.1
    weights[2::4] = 0.0  # switched-off positions
    return hidden, weight, teacher, weights, prev


def check_kernel_linear_kl(ctx: Context) -> str:
    """`fused_linear_kl(backend="triton")` against `backend="naive"`: loss, dL/dhidden, dL/dW."""
    _, mode = _triton_module(ctx, "triton_linear_kl", "_linear_kl_rows_kernel")
    from sglang_tts.kernels import fused_linear_kl, resolve_backend

    # (N, H, V, dtype, chunk_size, tolerance): chunks of 2 rows and a masked vocabulary tail on CPU; on CUDA a
    # vocabulary wider than one Triton block (32768) and bf16 inputs.
    cases = [(6, 16, 80, torch.float32, 2, 1e-5)]
    if ctx.cuda:
        cases = [
            (64, 256, 4096, torch.float32, None, 1e-4),
            (12, 128, 40000, torch.float32, 5, 1e-4),
            (64, 256, 4096, torch.bfloat16, None, 5e-2),
        ]
    worst = 0.0
    for n, h, v, dtype, chunk, tol in cases:
        hidden, weight, teacher, weights, prev = _linear_kl_problem(n, h, v, ctx.generator(n + v))
        teacher, weights, prev = (t.to(ctx.device) for t in (teacher, weights, prev))
        for reg_lambda in (0.0, 0.3):
            out = {}
            for backend in ("naive", "triton"):
                hd = hidden.to(ctx.device, dtype).requires_grad_()
                wd = weight.to(ctx.device, dtype).requires_grad_()
                loss = fused_linear_kl(hd, wd, teacher, weights, prev, reg_lambda, backend=backend, chunk_size=chunk)
                loss.backward()
                out[backend] = (loss.detach(), hd.grad, wd.grad)
            for name, got, want in zip(("loss", "dL/dhidden", "dL/dW"), out["triton"], out["naive"]):
                expect(got.shape == want.shape and got.dtype == want.dtype, f"{name}: shape/dtype differ")
                err = _rel_err(got, want)
                worst = max(worst, err if dtype == torch.float32 else 0.0)
                expect(err <= tol, f"N={n} V={v} {dtype} lambda={reg_lambda}: {name} off by {err:.2e} > {tol:g}")
    if ctx.cuda:
        probe = torch.zeros(1, 1, device=ctx.device)
        expect(resolve_backend("auto", probe, "chunked") == "triton", "backend 'auto' does not pick Triton on CUDA")
    shapes = ", ".join(f"{n}x{v} {str(dtype).removeprefix('torch.')}" for n, _, v, dtype, _, _ in cases)
    return f"{mode}; {shapes}; lambda 0 and 0.3; worst fp32 rel err {worst:.1e}"


def check_kernel_gather_draft(ctx: Context) -> str:
    """`gather_draft_probs(backend="triton")` against `backend="torch"`: probabilities and mask."""
    _, mode = _triton_module(ctx, "gather", "_gather_draft_kernel")
    from sglang_tts.kernels import gather_draft_probs

    cases = [(5, 96, 40)] if not ctx.cuda else [(32, 40000, 16000), (8, 128256, 32000)]
    worst = 0.0
    for n, vt, vd in cases:
        gen = ctx.generator(vt)
        ids = torch.randperm(vt, generator=gen)[:vd].sort().values
        d2t = (ids - torch.arange(vd)).to(ctx.device)
        logits = torch.randn(n, vt, generator=gen) * 3.0
        outside = torch.ones(vt, dtype=torch.bool)
        outside[ids] = False
        off = int(outside.nonzero()[0])
        logits[0, off] = 50.0  # the target's top token is outside the draft vocabulary: mask False
        logits[1, ids] = float("-inf")  # no mass on the draft vocabulary: an all-zero row, not NaN
        logits = logits.to(ctx.device)
        for is_logits in (True, False):
            target = logits if is_logits else torch.softmax(logits, dim=-1)
            want = gather_draft_probs(target, d2t, input_is_logits=is_logits, backend="torch")
            got = gather_draft_probs(target, d2t, input_is_logits=is_logits, backend="triton")
            expect(torch.equal(got[1], want[1]), f"Vt={vt}: masks differ")
            expect(bool(torch.isfinite(got[0]).all()), f"Vt={vt}: non-finite probabilities")
            expect(not bool(got[1][0]), f"Vt={vt}: mask of a row whose top token is outside the draft vocabulary")
            expect(float(got[0][1].abs().sum()) == 0.0, f"Vt={vt}: a row without draft mass is not all zeros")
            err = _rel_err(got[0], want[0])
            worst = max(worst, err)
            expect(err <= 1e-5, f"Vt={vt} Vd={vd} logits={is_logits}: probabilities off by {err:.2e}")
    shapes = ", ".join(f"{n}x{vt}->{vd}" for n, vt, vd in cases)
    return f"{mode}; {shapes}; logits and probabilities in; worst rel err {worst:.1e}"


def check_kernel_lowrank_delta(ctx: Context) -> str:
    """`lowrank_delta(backend="triton")` against `backend="torch"`; stack row 0 (no adapter) gives zeros."""
    _, mode = _triton_module(ctx, "lowrank", "_lowrank_delta_kernel")
    from sglang_tts.kernels import lowrank_delta

    cases = [(7, 48, 40, 4, 4, torch.float32, 1e-5)]
    if ctx.cuda:
        cases = [(64, 512, 1024, 16, 9, torch.float32, 1e-4), (64, 512, 1024, 16, 9, torch.bfloat16, 2e-2)]
    worst = 0.0
    for n, fin, fout, rank, stack, dtype, tol in cases:
        gen = ctx.generator(fin + rank)
        a = torch.randn(stack, rank, fin, generator=gen) / fin**0.5
        b = torch.randn(stack, fout, rank, generator=gen)
        a[0], b[0] = 0.0, 0.0  # the "no adapter" row
        slots = torch.randint(0, stack, (n,), generator=gen)
        slots[0] = 0
        x = torch.randn(n, fin, generator=gen)
        a, b, slots, x = a.to(ctx.device), b.to(ctx.device), slots.to(ctx.device), x.to(ctx.device, dtype)
        # The reference in float32 (the kernel accumulates in float32 whatever the input dtype).
        want = lowrank_delta(x.float(), a, b, slots, 0.5, backend="torch")
        got = lowrank_delta(x, a, b, slots, 0.5, backend="triton")
        expect(got.dtype == dtype, f"output dtype {got.dtype}, input {dtype}")
        expect(float(got[slots == 0].float().abs().sum()) == 0.0, "tokens without an adapter got a delta")
        err = _rel_err(got, want)
        worst = max(worst, err if dtype == torch.float32 else 0.0)
        expect(err <= tol, f"N={n} in={fin} out={fout} r={rank} {dtype}: off by {err:.2e} > {tol:g}")
        if ctx.cuda:
            auto = lowrank_delta(x, a, b, slots, 0.5)
            expect(torch.equal(auto, got), "backend 'auto' is not the Triton kernel on CUDA")
    shapes = ", ".join(
        f"{n}x{fin}->{fout} r{rank} {str(d).removeprefix('torch.')}" for n, fin, fout, rank, _, d, _ in cases
    )
    return f"{mode}; {shapes}; worst fp32 rel err {worst:.1e}"


# ----------------------------------------------------------------------------- executor and barrier


def check_executor_barrier(ctx: Context) -> str:
    """The update executor the serving path gets (`make_executor(device, sync=False)`): submit returns at once,
    the update runs off the serving thread, wait() returns only once it has finished, errors come back inside
    the result, one update in flight at a time."""
    return _executor_cuda(ctx) if ctx.cuda else _executor_cpu(ctx)


def _executor_common(executor: Any) -> None:
    def boom() -> None:
        raise ZeroDivisionError("injected")

    executor.submit(boom)
    failed = executor.wait()
    expect(failed is not None and isinstance(failed.error, ZeroDivisionError), "an update's exception got lost")
    order: list[str] = []

    def first() -> None:
        time.sleep(0.02)
        order.append("first")

    executor.submit(first)
    executor.submit(lambda: order.append("second"))  # waits for the first before queueing
    expect(order[:1] == ["first"], "a second submit did not wait for the pending update")
    expect(executor.wait().ok and order == ["first", "second"], "updates ran out of order")


def _executor_cpu(ctx: Context) -> str:
    from sglang_tts.core.executor import ThreadExecutor, make_executor

    executor = make_executor(ctx.device, sync=False, cpu_thread=True)
    expect(isinstance(executor, ThreadExecutor), f"CPU serving with --tts-cpu-thread got {type(executor).__name__}")
    try:
        data = torch.zeros(4096)
        started, release = threading.Event(), threading.Event()
        serving_thread = threading.current_thread()

        def update() -> bool:
            started.set()
            release.wait(10)
            for piece in data.split(512):  # written a piece at a time: wait() must return after the last one
                piece.fill_(1.0)
                time.sleep(0.002)
            return threading.current_thread() is not serving_thread

        executor.submit(update)
        expect(executor.pending and started.wait(10), "submit() did not return while the update was running")
        expect(float(data.sum()) == 0.0, "the update ran before it was released")
        release.set()
        result = executor.wait()
        expect(result is not None and result.ok, f"update failed: {result and result.error!r}")
        expect(result.value, "the update ran on the serving thread")
        expect(bool((data == 1.0).all()), "wait() returned before the update had finished")
        expect(not executor.pending and result.timing.wait_blocked_s > 0.0, "wait() did not block on the update")
        _executor_common(executor)
    finally:
        executor.close()
    expect(not executor._thread.is_alive(), "close() left the worker thread running")
    return f"ThreadExecutor: overlap, barrier after a {result.timing.run_s * 1e3:.0f} ms update, errors, ordering"


def _sleep_cycles_per_ms() -> float:
    # The last of three: an idle GPU's clock ramps up under load (on an H200 the first call counted about half
    # the cycles per ms that later ones did), and a calibration at the low clock makes every later sleep short.
    rate = 0.0
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        rate = 10_000_000 / max(start.elapsed_time(end), 1e-3)
    return rate


def _executor_cuda(ctx: Context) -> str:
    from sglang_tts.core.executor import SideStreamExecutor, make_executor

    # The device as SGLang's workers pass it: "cuda", no index.
    executor = make_executor(ctx.device, sync=False)
    expect(isinstance(executor, SideStreamExecutor), f"CUDA serving got {type(executor).__name__}")
    try:
        cycles_per_ms = _sleep_cycles_per_ms()
        x = torch.zeros(1 << 16, device=ctx.device)
        y = torch.zeros_like(x)
        torch.cuda.synchronize()
        serving_thread = threading.current_thread()
        torch.cuda._sleep(int(50 * cycles_per_ms))  # the serving stream is busy for 50 ms ...
        x.fill_(1.0)  # ... before it writes what the update reads: the side stream must wait for it

        work = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def update() -> tuple[bool, bool]:
            where = (threading.current_thread() is not serving_thread, torch.cuda.current_stream() == executor.stream)
            work[0].record()
            torch.cuda._sleep(int(100 * cycles_per_ms))
            y.copy_(x * 2.0)
            work[1].record()
            return where

        t0 = time.perf_counter()
        executor.submit(update)
        submit_ms = (time.perf_counter() - t0) * 1e3
        expect(executor.pending, "nothing pending after submit()")
        result = executor.wait()
        expect(result is not None and result.ok, f"update failed on the side stream: {result and result.error!r}")
        off_thread, on_side_stream = result.value
        expect(off_thread and on_side_stream, f"update ran off-thread={off_thread}, on side stream={on_side_stream}")
        # No stream-level wait between the side stream and this one: only wait()'s CPU-side barrier orders them.
        values = y.cpu()
        expect(bool((values == 2.0).all()), f"after wait(): {int((values != 2.0).sum())} values not the update's")
        # The executor's run time covers the side stream's work, as the stream itself timed it.
        work[1].synchronize()
        work_s = work[0].elapsed_time(work[1]) / 1e3
        expect(
            result.timing.run_s >= 0.9 * work_s,
            f"run time {result.timing.run_s:.3f} s misses the side stream's work ({work_s:.3f} s)",
        )
        _executor_common(executor)
    finally:
        executor.close()
    return (
        f"SideStreamExecutor on {executor.device}: submit {submit_ms:.1f} ms, update {result.timing.run_s * 1e3:.0f} "
        "ms of side-stream work ordered after the serving stream and complete at wait()"
    )


# ----------------------------------------------------------------------------- a tiny EAGLE-3 drafter

# A checkpoint config.json in the public EAGLE-3 layout (draft vocabulary = every other target id).
TINY_EAGLE3 = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_hidden_layers": 1,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "vocab_size": 96,
    "draft_vocab_size": 48,
    "target_hidden_size": 32,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True},
}


def tiny_eagle3(device: torch.device, seed: int = 0) -> torch.nn.Module:
    from sglang_tts.drafters.eagle3 import Eagle3Config, Eagle3Drafter

    cfg = Eagle3Config.from_dict(TINY_EAGLE3)
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = Eagle3Drafter(cfg, target_embedding=torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen))
    with torch.no_grad():
        drafter.d2t.copy_(torch.arange(cfg.draft_vocab_size))  # draft id i is target id 2i
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[drafter.draft_to_target_ids()] = True
        drafter.t2d.copy_(t2d)
    return drafter.to(device)


def tiny_canvas(
    drafter: Any, gen: torch.Generator, device: torch.device, request_ids: Sequence[str] = ("a", "b"), length: int = 4
) -> Any:
    """A verify round's canvas whose target top tokens lie in the draft vocabulary (every position trains)."""
    from sglang_tts.core.canvas import Canvas

    cfg, batch = drafter.cfg, len(request_ids)
    logits = torch.randn(batch, length, cfg.vocab_size, generator=gen)
    top = drafter.draft_to_target_ids().cpu()[torch.randint(0, cfg.draft_vocab_size, (batch, length), generator=gen)]
    logits.scatter_add_(-1, top[..., None], torch.full((batch, length, 1), 6.0))
    canvas = Canvas(
        input_ids=torch.randint(0, cfg.vocab_size, (batch, length), generator=gen),
        positions=torch.arange(length).repeat(batch, 1) + 16,
        target_logits=logits,
        valid=torch.ones(batch, length, dtype=torch.bool),
        features=torch.randn(batch, cfg.target_hidden_size * cfg.num_aux_hidden_states, generator=gen),
        request_ids=list(request_ids),
    )
    return canvas.to(device)


@dataclass
class DraftInputs:
    input_ids: torch.Tensor  # [B] the tokens fed
    hidden: torch.Tensor  # [B, F] target features (through fc)
    positions: torch.Tensor  # [B]


def draft_inputs(drafter: Any, gen: torch.Generator, device: torch.device, batch: int = 3) -> DraftInputs:
    cfg = drafter.cfg
    return DraftInputs(
        torch.randint(0, cfg.vocab_size, (batch,), generator=gen).to(device),
        torch.randn(batch, cfg.target_hidden_size * cfg.num_aux_hidden_states, generator=gen).to(device),
        (torch.arange(batch) + 20).to(device),
    )


def draft_logits(drafter: Any, inputs: DraftInputs) -> torch.Tensor:
    """One draft step (SGLang's multi-step draft, topk 1): logits over the draft vocabulary, [B, V_draft]."""
    with torch.no_grad():
        out = drafter.draft_step(inputs.input_ids, inputs.hidden, inputs.positions)
        return out.hidden[:, 0] @ drafter.lm_head_weight().T


def capture_draft(drafter: Any, inputs: DraftInputs) -> Callable[[], torch.Tensor]:
    """A CUDA graph of one draft step on static inputs; returns replay() -> a copy of the static output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs recommends
        for _ in range(3):
            draft_logits(drafter, inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = draft_logits(drafter, inputs)

    def replay() -> torch.Tensor:
        graph.replay()
        return static_out.clone()

    return replay


def _signal_after_step(distiller: Any, cuda: bool) -> threading.Event:
    """Set the returned event once an update's (real) optimizer step has landed in the trained copy. The serving
    thread waits for it before drafting in a round with an update in flight: the trained copy then holds new,
    unpublished weights while serving drafts and reads, which is when a leak or a torn publish would show."""
    stepped = threading.Event()
    step = distiller.optimizer.step

    def step_and_signal(*args: Any, **kwargs: Any) -> Any:
        out = step(*args, **kwargs)
        if cuda:
            torch.cuda.current_stream().synchronize()  # the side stream's step has run, not just been queued
        stepped.set()
        return out

    distiller.optimizer.step = step_and_signal
    return stepped


@contextmanager
def _captured_logs(name: str = "sglang_tts") -> Iterator[list[str]]:
    """Warnings and errors the package logs meanwhile (a failed publish or update is logged, not raised)."""
    messages: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = _Collect(logging.WARNING)
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def _publish_rounds(ctx: Context, capture: bool, rounds: int = 12, stride: int = 3) -> str:
    """Serve `rounds` rounds with the real Distiller (async executor, stride `stride`, in-place publishing into
    the serving drafter). Every recorded version is the trained weights a barrier published; after each barrier
    the serving weights must equal exactly the current version, and each draft (eager, or a graph replay) must
    match the eager draft with that version's weights and no other."""
    from sglang_tts.config import TTSConfig
    from sglang_tts.core.distiller import Distiller
    from sglang_tts.core.executor import make_executor

    gen = ctx.generator(11)
    serving = tiny_eagle3(ctx.device)
    reference = copy.deepcopy(serving)  # drafts eagerly with a recorded version's weights
    inputs = draft_inputs(serving, gen, ctx.device)
    # Captured before any update exists: no other thread touches CUDA during capture.
    draft = capture_draft(serving, inputs) if capture else (lambda: draft_logits(serving, inputs))
    config = TTSConfig(update_stride=stride, lr=1e-2, reg_lambda=0.0, log_interval=0, scope="global")
    distiller = Distiller(serving, config, make_executor(ctx.device, sync=False, cpu_thread=True))
    stepped = _signal_after_step(distiller, ctx.cuda)
    names = distiller.train_names
    serving_named = dict(serving.trainable_named_parameters())
    serving_tensors = [serving_named[n] for n in names]
    pointers = [t.data_ptr() for t in serving_tensors]
    reference_named = dict(reference.named_parameters())
    reference_tensors = [reference_named[n] for n in names]
    atol = 1e-4 if ctx.cuda else 1e-5

    weights: list[list[torch.Tensor]] = []
    outputs: list[torch.Tensor] = []

    def record() -> None:
        snapshot = [p.detach().clone() for p in distiller.train_params]  # what the barrier just published
        with torch.no_grad():
            for dst, src in zip(reference_tensors, snapshot):
                dst.copy_(src)
        weights.append(snapshot)
        outputs.append(draft_logits(reference, inputs))

    def read(round_number: int) -> None:
        current = distiller.weight_version
        expect(current == len(weights) - 1, f"round {round_number}: weight version {current}, {len(weights)} recorded")
        seen = [t.detach().clone() for t in serving_tensors]
        matches = [v for v, w in enumerate(weights) if all(torch.equal(s, t) for s, t in zip(seen, w))]
        expect(
            matches == [current],
            f"round {round_number}: serving weights match versions {matches} (none: a torn or leaked "
            f"state), expected [{current}]",
        )
        out = draft()
        close = [v for v, ref in enumerate(outputs) if torch.allclose(out, ref, rtol=1e-4, atol=atol)]
        expect(
            close == [current],
            f"round {round_number}: the {'replayed' if capture else 'eager'} draft matches versions {close}, "
            f"expected [{current}]",
        )

    record()  # version 0: the weights serving starts with
    in_flight = 0
    with _captured_logs() as logs:
        try:
            for round_number in range(1, rounds + 1):
                if distiller.barrier():
                    record()
                if distiller.executor.pending:
                    expect(stepped.wait(60), f"round {round_number}: the update in flight never stepped")
                    in_flight += 1
                for _ in range(2):  # two drafts per round, as a multi-step draft
                    read(round_number)
                if distiller.next_round_submits():
                    stepped.clear()  # the event now belongs to the update submitted next
                distiller.observe(tiny_canvas(serving, gen, ctx.device))
            if distiller.barrier(force=True):
                record()
            read(rounds + 1)
        finally:
            distiller.close()
    stats = distiller.stats
    expect(
        stats.num_skipped_updates == 0 and stats.num_failed_publishes == 0,
        f"{stats.num_skipped_updates} updates skipped, {stats.num_failed_publishes} publishes failed: {logs[:3]}",
    )
    expect(len(weights) >= 3, f"only {len(weights) - 1} versions published: nothing to tell apart")
    expect(in_flight > 0, "no draft ran while a stepped update was in flight")
    expect([t.data_ptr() for t in serving_tensors] == pointers, "publishing rebound a serving tensor")
    gaps = [float((outputs[v] - outputs[v - 1]).abs().max()) for v in range(1, len(outputs))]
    expect(min(gaps) > 20 * atol, f"consecutive versions draft almost alike (gap {min(gaps):.1e}): check is vacuous")
    return (
        f"{len(weights) - 1} versions published in place ({len(names)} tensors), {in_flight} of {rounds} rounds "
        f"drafted while a stepped update was unpublished; every draft and weight read saw exactly the current version "
        f"(smallest gap between versions {min(gaps):.1e})"
    )


def check_publish_all_or_nothing(ctx: Context) -> str:
    """Drafts and weight reads between barriers see exactly one published version (all-old or all-new)."""
    executor = "side stream" if ctx.cuda else "worker thread"
    return f"eager drafts, {executor}: " + _publish_rounds(ctx, capture=False)


def check_graph_replay_publish(ctx: Context) -> str:
    """A CUDA-graph-captured draft step replayed across in-place publishes sees all-old or all-new weights."""
    if not ctx.cuda:
        raise Skip("CUDA graphs need a CUDA device (publish_all_or_nothing covers the eager drafts on CPU)")
    return "graph replays, side stream: " + _publish_rounds(ctx, capture=True)


# ----------------------------------------------------------------------------- the adapter kernel under capture


def check_adapter_kernel_capture(ctx: Context) -> str:
    """`ServingBank.delta` (the Triton `lowrank_delta` on CUDA) captured in a CUDA graph: replays follow adapters
    published in place and inputs copied into the static buffers."""
    if not ctx.cuda:
        raise Skip("CUDA graphs need a CUDA device (kernel_lowrank_delta covers the kernel on CPU)")
    _triton_module(ctx, "lowrank", "_lowrank_delta_kernel")
    from sglang_tts.core.adapters import AdaptedLinear, LowRankBank, ServingBank
    from sglang_tts.core.publish import WeightPublisher
    from sglang_tts.kernels import resolve_backend
    from sglang_tts.kernels.lowrank import lowrank_delta_torch

    gen = ctx.generator(21)
    fin, fout, num_slots, n = 64, 96, 3, 16
    bank = LowRankBank([AdaptedLinear("q_proj", fin, fout)], num_slots=num_slots, rank=8, alpha=16.0)
    serving = ServingBank(bank, device=ctx.device)
    trained = dict(bank.named_parameters(prefix="bank"))
    publisher = WeightPublisher.from_name_map(serving.destinations(bank), trained)

    def train_a_little() -> None:  # stands in for the update: new values in every slot's factors
        with torch.no_grad():
            for p in trained.values():
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)

    train_a_little()
    publisher.publish(trained)
    pointers = [t.data_ptr() for t in (*serving.a, *serving.b)]
    x = torch.randn(n, fin, generator=gen).to(ctx.device)
    slots = torch.randint(-1, num_slots, (n,), generator=gen)  # -1: a request without an adapter
    rows = ServingBank.stack_rows(slots).to(ctx.device)
    expect(resolve_backend("auto", x, "torch") == "triton", "lowrank_delta would not take the Triton kernel here")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            serving.delta("q_proj", x, rows)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = serving.delta("q_proj", x, rows)

    def want() -> torch.Tensor:
        return lowrank_delta_torch(x, serving.a[0], serving.b[0], rows, serving.scale)

    graph.replay()
    expect(_rel_err(static_out, want()) <= 1e-4, "replay differs from the reference")
    expect(float(static_out[rows == 0].abs().sum()) == 0.0, "tokens without an adapter got a delta under replay")
    old = static_out.clone()
    train_a_little()
    publisher.publish(trained)  # in place, as the Distiller's barrier does between replays
    graph.replay()
    expect(_rel_err(static_out, want()) <= 1e-4, "replay after an in-place publish does not see the new adapters")
    expect(_rel_err(static_out, old) > 1e-3, "the new adapters changed nothing: check is vacuous")
    x.copy_(torch.randn(n, fin, generator=gen).to(ctx.device))
    rows.copy_(ServingBank.stack_rows(torch.randint(-1, num_slots, (n,), generator=gen)).to(ctx.device))
    graph.replay()
    expect(_rel_err(static_out, want()) <= 1e-4, "replay on new static inputs differs from the reference")
    expect([t.data_ptr() for t in (*serving.a, *serving.b)] == pointers, "publishing rebound a serving stack")
    return f"compiled Triton lowrank_delta in a CUDA graph: {n} tokens, {num_slots} slots + none, r 8, 2 publishes"


# ----------------------------------------------------------------------------- no host sync in a serving round


@contextmanager
def sync_debug_error() -> Iterator[None]:
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _gated_side_stream_executor(device: torch.device) -> Any:
    """The real SideStreamExecutor, except that an update starts only once `gate` is set (and `finished` counts
    completed runs). The sync-debug mode is process-wide, while the update itself syncs by design (it reads its
    loss on the host): gating keeps the update out of the windows that must not sync."""
    from sglang_tts.core.executor import SideStreamExecutor

    class GatedSideStreamExecutor(SideStreamExecutor):
        def __init__(self, device: torch.device) -> None:
            self.gate = threading.Event()
            self.gate.set()
            self.finished = threading.Semaphore(0)
            super().__init__(device)

        def _run(self, job: Any) -> None:
            self.gate.wait()
            try:
                super()._run(job)
            finally:
                self.finished.release()

    return GatedSideStreamExecutor(device)


def check_sync_free_round(ctx: Context) -> str:
    """A serving round's TTS code on the scheduler thread (`TTSRuntime.before_draft`: scope reset, the barrier
    and in-place publishing; `observe`: counters and submitting the update) under
    `torch.cuda.set_sync_debug_mode("error")`. The canvas is built outside (the engine's builder copies to the
    host by design, on update rounds only), and the update runs outside (it syncs by design)."""
    if not ctx.cuda:
        raise Skip("torch.cuda.set_sync_debug_mode needs CUDA: there is no host-device sync to catch on CPU")
    from sglang_tts.config import TTSConfig
    from sglang_tts.sglang.runtime import TTSRuntime  # imports the core only, no SGLang

    with sync_debug_error():
        try:
            torch.ones(1, device=ctx.device).item()
            armed = False
        except RuntimeError:
            armed = True
    expect(armed, "set_sync_debug_mode('error') did not turn .item() into an error: the check would be vacuous")

    gen = ctx.generator(31)
    drafter = tiny_eagle3(ctx.device)
    config = TTSConfig(update_stride=2, lr=1e-3, reg_lambda=0.0, log_interval=0, scope="batch")
    runtime = TTSRuntime(drafter, config, None, ctx.device)
    runtime.distiller.executor.close()
    gated = _gated_side_stream_executor(ctx.device)
    runtime.executor = runtime.distiller.executor = gated
    live = ["a", "b"]
    rounds = 10
    with _captured_logs() as logs:
        try:
            for round_number in range(1, rounds + 1):
                if round_number == 7:
                    live = ["c"]  # the generation finished: scope "batch" resets the drafter to base
                gated.gate.clear()
                try:
                    with sync_debug_error():
                        runtime.before_draft(live)
                        submits = runtime.distiller.next_round_submits()
                    canvas = tiny_canvas(drafter, gen, ctx.device, live) if submits else None
                    with sync_debug_error():
                        runtime.count_round(dict.fromkeys(live, 2))
                        runtime.observe(canvas)
                except RuntimeError as exc:
                    raise CheckFailed(f"round {round_number}: {exc}") from exc
                finally:
                    gated.gate.set()
                if submits:
                    expect(gated.finished.acquire(timeout=300), f"round {round_number}: the update never finished")
            with sync_debug_error():
                runtime.before_draft(live)
                runtime.distiller.barrier(force=True)
        finally:
            gated.gate.set()
            runtime.close()
    stats = runtime.distiller.stats
    expect(
        stats.num_skipped_updates == 0 and stats.num_failed_publishes == 0,
        f"{stats.num_skipped_updates} updates skipped, {stats.num_failed_publishes} publishes failed: {logs[:3]}",
    )
    expect(stats.num_updates >= 4 and stats.num_resets >= 1, f"{stats.num_updates} updates, {stats.num_resets} resets")
    return (
        f"{rounds} rounds of before_draft/observe with no host sync: {stats.num_updates} updates submitted and "
        f"published in place, {stats.num_resets} scope reset, weight version {stats.weight_version}"
    )


def check_no_sglang_import(ctx: Context) -> str:
    """Nothing above imported SGLang: the GPU path's TTS code runs on torch (and triton) alone."""
    loaded = sorted(m for m in sys.modules if m == "sglang" or m.startswith("sglang."))
    expect(not loaded, f"SGLang modules were imported: {loaded[:5]}")
    return "no sglang module in sys.modules"


# ----------------------------------------------------------------------------- sampled verify without flashinfer


def _random_tree_batch(bs: int, n: int, vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Inputs of SGLang's target-only tree sampler on the host: random trees of n nodes (node 0 the root, each
    node's parent among the nodes before it)."""
    next_token = torch.full((bs, n), -1, dtype=torch.long)
    next_sibling = torch.full((bs, n), -1, dtype=torch.long)
    parents = [torch.randint(0, max(node, 1), (bs,), generator=gen) for node in range(n)]
    for b in range(bs):
        children: dict[int, list[int]] = {}
        for node in range(1, n):
            children.setdefault(int(parents[node][b]), []).append(node)
        for parent, kids in children.items():
            next_token[b, parent] = kids[0]
            for a, c in zip(kids, kids[1:]):
                next_sibling[b, a] = c
    return {
        "candidates": torch.randint(0, 8, (bs, n), generator=gen),
        "retrive_index": torch.arange(bs * n).view(bs, n),
        "retrive_next_token": next_token,
        "retrive_next_sibling": next_sibling,
        "uniform_samples": torch.rand(bs, n, generator=gen),
        "uniform_samples_for_final_sampling": torch.rand(bs, generator=gen),
        # most of the mass on the 8 tokens drafted, so that proposals are often accepted
        "target_probs": (torch.randn(bs, n, vocab, generator=gen) * 2 + (torch.arange(vocab) < 8) * 9.0).softmax(-1),
        "draft_probs": torch.zeros(bs, n, vocab),
    }


# batch, draft tokens (tree nodes), vocabulary, tree depth + 1 (accept_index width)
SAMPLED_VERIFY_SHAPE = (64, 8, 32000, 4)


def check_sampled_verify_ops(ctx: Context) -> str:
    """The PyTorch sampled-verify ops (sglang_tts/platform/cpu/spec_sampling.py: tree sampler, top-k / top-p
    renorm) on CUDA under torch.cuda.set_sync_debug_mode("error"), against the same ops on CPU."""
    if not ctx.cuda:
        raise Skip("the host-sync mode needs CUDA (tests/platform/test_spec_sampling.py covers CPU and meta)")
    from sglang_tts.platform.cpu.spec_sampling import (
        top_k_renorm_prob,
        top_p_renorm_prob,
        tree_speculative_sampling_target_only,
    )

    gen = ctx.generator(41)
    bs, n, vocab, steps = SAMPLED_VERIFY_SHAPE
    host = _random_tree_batch(bs, n, vocab, gen)
    rows = host["target_probs"].view(bs * n, vocab)
    top_ks = torch.randint(1, 64, (bs * n,), generator=gen)
    top_ps = torch.rand(bs * n, generator=gen) * 0.9 + 0.05

    def outputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            torch.full((bs * n,), -1, dtype=torch.int32, device=device),
            torch.full((bs, steps), -1, dtype=torch.int32, device=device),
            torch.zeros(bs, dtype=torch.int32, device=device),
        )

    want_k, want_p = top_k_renorm_prob(rows, top_ks), top_p_renorm_prob(rows, top_ps)
    want = outputs(torch.device("cpu"))
    tree_speculative_sampling_target_only(*want, **host)
    dev = {k: v.to(ctx.device) for k, v in host.items()}
    dev_rows, dev_ks, dev_ps = rows.to(ctx.device), top_ks.to(ctx.device), top_ps.to(ctx.device)
    got = outputs(ctx.device)
    torch.cuda.synchronize()
    try:
        with sync_debug_error():
            got_k, got_p = top_k_renorm_prob(dev_rows, dev_ks), top_p_renorm_prob(dev_rows, dev_ps)
            tree_speculative_sampling_target_only(*got, **dev)
    except RuntimeError as exc:
        raise CheckFailed(f"a host sync inside a sampling op: {exc}") from exc
    for name, got_r, want_r in (("top_k", got_k.cpu(), want_k), ("top_p", got_p.cpu(), want_p)):
        err = _rel_err(got_r, want_r)
        support = int(((got_r > 0) != (want_r > 0)).any(1).sum())
        expect(err <= 1e-5, f"{name}_renorm_prob on CUDA differs from CPU: rel err {err:.1e}, {support} rows' support")
    # Sums over the vocabulary round differently on the two devices: a coin within rounding of a boundary may
    # fall the other way, so a few rows may differ (none in practice).
    rows_differ = ~(
        (got[0].cpu().view(bs, n) == want[0].view(bs, n)).all(1)
        & (got[1].cpu() == want[1]).all(1)
        & (got[2].cpu() == want[2])
    )
    differ = int(rows_differ.sum())
    accepted = int(want[2].sum())
    expect(differ <= bs // 50, f"{differ} of {bs} tree-sampler rows differ between CUDA and CPU")
    expect(0 < accepted < bs * (steps - 1), f"{accepted} proposals accepted: the comparison is vacuous")
    return (
        f"no host sync; renorm equal to CPU; tree sampler {bs - differ} of {bs} rows equal to CPU "
        f"({bs}x{n} nodes, vocabulary {vocab}, {accepted} proposals accepted)"
    )


# ----------------------------------------------------------------------------- the update at real scale


@dataclass(frozen=True)
class ScaleSpec:
    """Sizes of `update_at_scale`: drafters for a target of these shapes, the round that hides their update,
    and how long it is measured. "8b" is Llama-3.1-8B (hidden 4096, 32 layers, 32 / 8 heads, vocabulary 128,256);
    "tiny" the same structure at sizes a CPU runs in seconds (the rehearsal: same code, no meaningful timing)."""

    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    target_layers: int
    target_vocab: int
    draft_vocabs: tuple[int, ...]  # one EAGLE-3 drafter per draft vocabulary
    dflash_layers: int
    dflash_block: int
    batch: int  # requests per round (canvas rows)
    canvas: int  # EAGLE-3 canvas length: chain of 3 drafts + the bonus position (SGLang's default 3 steps)
    context: int  # tokens of drafter K/V each request holds before the round (the canvas's past_kv)
    verify_rows: int  # tokens per verify forward: batch x draft tokens
    round_ms: float  # what the verify stand-in is calibrated to take
    strides: tuple[int, ...]
    cycles: int  # updates measured per stride
    alone: int  # updates timed with nothing else on the device (after one warm-up)
    serving_dtype: torch.dtype  # SGLang's draft model (bf16 on a GPU)
    trained_dtype: torch.dtype  # TTS's trained copy: fp32, as sglang/eagle_worker.py builds it (load_drafter)


SCALES = {
    "8b": ScaleSpec(
        "8b", hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, target_layers=32,
        target_vocab=128256, draft_vocabs=(32000, 128256), dflash_layers=1, dflash_block=16, batch=8, canvas=4,
        context=1024, verify_rows=32, round_ms=12.0, strides=(1, 2, 5, 10), cycles=4, alone=3,
        serving_dtype=torch.bfloat16, trained_dtype=torch.float32,
    ),
    "tiny": ScaleSpec(
        "tiny", hidden=64, intermediate=224, heads=4, kv_heads=2, head_dim=16, target_layers=8, target_vocab=512,
        draft_vocabs=(128, 512), dflash_layers=1, dflash_block=4, batch=2, canvas=4, context=16, verify_rows=8,
        round_ms=2.0, strides=(1, 2, 5, 10), cycles=2, alone=2, serving_dtype=torch.bfloat16,
        trained_dtype=torch.float32,
    ),
}  # fmt: skip
# Targets of issue 42 for the 8B-scale update.
HIDDEN_TARGET, HIDDEN_TARGET_STRIDE, SLOWDOWN_TARGET = 0.80, 5, 0.15


def _scale_target_config(spec: ScaleSpec) -> dict[str, Any]:
    """The target's config.json (Llama layout) that the drafters' configs are derived from."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.target_layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.target_vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    }


class VerifyStandIn:
    """A memory-bound stand-in for the target's verify forward, on the current (serving) stream.

    `layers` passes over the weights of one decoder layer of the target (q/k/v [H, H + 2 kv], o [H, H],
    gate/up [H, 2 I], down [I, H]) with `verify_rows` tokens: each pass reads the layer's weights from memory
    as a decode step reads each of its layers (at 8B, 436 MB in bf16, far more than any L2, so passes over the
    same weights do not hit the cache). Calibrated to `round_ms` per round; on CUDA the round is a captured
    CUDA graph (SGLang replays its decode and verify as graphs) followed by a host sync on an event (SGLang
    reads the accepted tokens on the host every round).
    """

    def __init__(self, spec: ScaleSpec, device: torch.device) -> None:
        self.device = device
        gen = torch.Generator(device=device).manual_seed(5)
        h, kv, inter = spec.hidden, spec.kv_heads * spec.head_dim, spec.intermediate
        dtype = spec.serving_dtype

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, generator=gen, device=device).mul_(rows**-0.5).to(dtype)

        self.qkv, self.o = weight(h, h + 2 * kv), weight(h, h)  # [H, H + 2 kv], [H, H]
        self.gate_up, self.down = weight(h, 2 * inter), weight(inter, h)  # [H, 2 I], [I, H]
        self.x = torch.randn(spec.verify_rows, h, generator=gen, device=device).to(dtype)  # [rows, H]
        self.out = torch.zeros_like(self.x)  # [rows, H]
        self.hidden = h
        self.layer_bytes = sum(t.numel() * t.element_size() for t in (self.qkv, self.o, self.gate_up, self.down))
        self.layers = 1
        self.graph: Any = None
        self.round_ms = 0.0

    def _forward(self, layers: int) -> None:
        for _ in range(layers):  # every pass starts from the same input: values stay bounded
            attn = (self.x @ self.qkv)[:, : self.hidden] @ self.o
            gate, up = (attn @ self.gate_up).chunk(2, dim=-1)
            self.out.copy_((torch.nn.functional.silu(gate) * up) @ self.down)

    def _time_ms(self, fn: Callable[[], None], repeats: int, fastest: bool = False) -> float:
        """Median (or fastest: what noise from other processes cannot inflate) wall time of fn(), in ms."""
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return min(times) if fastest else sorted(times)[len(times) // 2]

    def calibrate(self, round_ms: float) -> None:
        """Pick the pass count that makes a round take about `round_ms` (after warming the GPU's clock), then
        capture it on CUDA."""
        probe = 8

        def probe_run() -> None:
            self._forward(probe)
            self.sync()

        for _ in range(10):  # the clock of an idle GPU ramps up under load
            probe_run()
        per_layer = self._time_ms(probe_run, 5, fastest=True) / probe
        self.layers = max(1, min(2048, round(round_ms / max(per_layer, 1e-6))))
        if self.device.type == "cuda":
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward(2)
            torch.cuda.current_stream(self.device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._forward(self.layers)
        for _ in range(3):
            self.run()
        self.round_ms = self._time_ms(self.run, 9)

    def sync(self) -> None:
        """The host waits for everything queued on the serving stream."""
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            done.synchronize()

    def run(self) -> float | None:
        """One round: the verify's weight reads, then the host waits for them (its read of the results).
        Returns the round's time on the GPU in seconds (CUDA events around the replay; None on CPU): the host's
        wall time minus it is time the serving thread spent elsewhere (e.g. waiting for the GIL)."""
        if self.graph is None:
            self._forward(self.layers)
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    @property
    def gb_per_round(self) -> float:
        return self.layers * self.layer_bytes / 1e9


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.0%}"


def _count(n: float) -> str:
    """128256 -> 128K, 425_000_000 -> 425M, 512 -> 512."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.0f}{unit}"
    return f"{n:.0f}"


def _decode_gb(spec: ScaleSpec) -> float:
    """Weights one decode step of the target reads: its layers and its LM head, in the serving dtype."""
    h, kv, inter = spec.hidden, spec.kv_heads * spec.head_dim, spec.intermediate
    layer = h * (h + 2 * kv) + h * h + 3 * h * inter
    return (spec.target_layers * layer + spec.target_vocab * h) * spec.serving_dtype.itemsize / 1e9


def _scale_eagle3(spec: ScaleSpec, draft_vocab: int, device: torch.device) -> Any:
    """A random EAGLE-3 drafter for the target of `spec` (the project's config builder and drafter class),
    built on the device in the trained copy's dtype; the target's embedding borrowed as the engine does."""
    from sglang_tts.drafters.checkpoints import default_eagle3_aux_layer_ids, draft_vocab_maps, eagle3_config
    from sglang_tts.drafters.eagle3 import Eagle3Config, Eagle3Drafter

    target = _scale_target_config(spec)
    cfg = Eagle3Config.from_dict(
        eagle3_config(
            target, draft_vocab_size=draft_vocab, aux_layer_ids=default_eagle3_aux_layer_ids(spec.target_layers)
        )
    )
    gen = torch.Generator(device=device).manual_seed(draft_vocab)
    embedding = torch.randn(spec.target_vocab, spec.hidden, generator=gen, device=device, dtype=spec.trained_dtype)
    with torch.device(device):
        drafter = Eagle3Drafter(cfg, target_embedding=embedding).to(spec.trained_dtype)
    step = spec.target_vocab // draft_vocab  # draft ids spread over the target vocabulary
    d2t, t2d = draft_vocab_maps(torch.arange(draft_vocab) * step, spec.target_vocab)
    with torch.no_grad():
        drafter.d2t.copy_(d2t)
        drafter.t2d.copy_(t2d)
    return drafter


def _scale_dflash(spec: ScaleSpec, device: torch.device) -> Any:
    """A random DFlash drafter for the target of `spec`, its embedding and LM head borrowed from the target."""
    from sglang_tts.drafters.checkpoints import default_dflash_target_layer_ids, dflash_config
    from sglang_tts.drafters.dflash import DFlashConfig, DFlashDrafter

    target = _scale_target_config(spec)
    layer_ids = default_dflash_target_layer_ids(spec.target_layers, spec.dflash_layers)
    cfg = DFlashConfig.from_dict(
        dflash_config(
            target,
            block_size=spec.dflash_block,
            num_layers=spec.dflash_layers,
            target_layer_ids=layer_ids,
            mask_token_id=spec.target_vocab - 1,
        )
    )
    gen = torch.Generator(device=device).manual_seed(7)
    shape = (spec.target_vocab, spec.hidden)
    embedding = torch.randn(*shape, generator=gen, device=device, dtype=spec.trained_dtype)
    lm_head = torch.randn(*shape, generator=gen, device=device, dtype=spec.trained_dtype).mul_(spec.hidden**-0.5)
    with torch.device(device):
        return DFlashDrafter(cfg, target_embedding=embedding, target_lm_head=lm_head).to(spec.trained_dtype)


def _scale_canvas(spec: ScaleSpec, drafter: Any, device: torch.device) -> Any:
    """One update's canvas as the engine hands it over (owned, on the device): `batch` requests, each with
    `context` tokens of drafter K/V before the round, the target's logits at every position (its top token in
    the draft vocabulary, so every position trains)."""
    from sglang_tts.core.canvas import Canvas

    gen = torch.Generator(device=device).manual_seed(3)
    b, ctx = spec.batch, spec.context
    dflash = drafter.kind == "dflash"
    length = spec.dflash_block if dflash else spec.canvas
    new_rows = 4 if dflash else 0  # DFlash: features of the tokens the last round committed
    past = ctx - new_rows
    kv = [
        tuple(
            torch.randn(b, spec.kv_heads, past, spec.head_dim, generator=gen, device=device, dtype=spec.serving_dtype)
            for _ in range(2)
        )
        for _ in range(len(drafter.layers))
    ]
    logits = torch.randn(b, length, spec.target_vocab, generator=gen, device=device)  # [B, C, V_target]
    if not dflash:
        ids = drafter.draft_to_target_ids()
        top = ids[torch.randint(0, ids.numel(), (b, length), generator=gen, device=device)]
        logits.scatter_add_(-1, top[..., None], torch.full((b, length, 1), 8.0, device=device))
    positions = ctx + torch.arange(length, device=device).repeat(b, 1)  # [B, C]
    width = drafter.fc.in_features
    common = dict(
        input_ids=torch.randint(0, spec.target_vocab - 1, (b, length), generator=gen, device=device),
        positions=positions,
        target_logits=logits,
        valid=torch.ones(b, length, dtype=torch.bool, device=device),
        past_kv=kv,
        past_mask=torch.ones(b, past, dtype=torch.bool, device=device),
        request_ids=[f"r{i}" for i in range(b)],
    )
    if dflash:
        return Canvas(
            features=torch.randn(b, new_rows, width, generator=gen, device=device),  # [B, L, F]
            context_positions=past + torch.arange(new_rows, device=device).repeat(b, 1),  # [B, L]
            context_mask=torch.ones(b, new_rows, dtype=torch.bool, device=device),
            **common,
        )
    return Canvas(features=torch.randn(b, width, generator=gen, device=device), **common)  # features [B, F]


def _overlap(span: tuple[float, float], others: Sequence[tuple[float, float]]) -> float:
    """Seconds of `span` covered by the (disjoint) `others`."""
    return sum(max(0.0, min(span[1], b) - max(span[0], a)) for a, b in others)


@dataclass
class _StrideRun:
    stride: int
    frozen_s: float  # wall time of the rounds without TTS
    tts_s: float  # wall time of the same number of rounds with updates every `stride` rounds
    updates: int
    wait_s: float  # time the barriers blocked on these updates
    round_s: list[float]  # the verify stand-in's time of each TTS round (host wall)
    round_gpu_s: list[float | None]  # the same on the GPU (CUDA events; None on CPU)
    frozen_round_s: list[float]
    frozen_gpu_s: list[float | None]
    round_spans: list[tuple[float, float]]
    update_spans: list[tuple[float, float]]


def _serve_rounds(distiller: Any, stand_in: VerifyStandIn, canvas: Any, rounds: int, spans: list, gpu: list) -> None:
    """`rounds` serving rounds: barrier, verify, observe (distiller None: frozen, the verify alone). Appends each
    verify's host span (perf_counter start, end) to `spans` and its GPU seconds (or None) to `gpu`."""
    for _ in range(rounds):
        if distiller is not None:
            distiller.barrier()
        start = time.perf_counter()
        gpu.append(stand_in.run())
        spans.append((start, time.perf_counter()))
        if distiller is not None:
            distiller.observe(canvas, owned=True)


def _median(values: Sequence[float]) -> float:
    return sorted(values)[len(values) // 2]


def _slowdown(took: Sequence[float], overlapped: Sequence[float], base: float) -> float | None:
    """Relative excess of round times `took` over `base` per unit of the share `overlapped` of each round that ran
    beside an update: least squares through zero over the rounds with any overlap (None: no round had)."""
    pairs = [(t, f) for t, f in zip(took, overlapped) if f > 0]
    covered = sum(f * f for _, f in pairs)
    return sum(f * (t - base) / base for t, f in pairs) / covered if covered > 0 else None


def _expect_updates_ok(results: Sequence[Any], stats: Any, logs: Sequence[str]) -> None:
    """Every update so far succeeded and was published."""
    failed = [r for r in results if not r.ok or getattr(r.value, "status", "ok") != "ok"]
    expect(
        not failed and stats.num_skipped_updates == 0 and stats.num_failed_publishes == 0,
        f"{len(failed)} updates failed or skipped, {stats.num_failed_publishes} publishes failed: "
        f"{[getattr(r.value, 'reason', r.error) for r in failed][:2]} {list(logs[:2])}",
    )


def _measure_update(ctx: Context, spec: ScaleSpec, drafter: Any, stand_in: VerifyStandIn) -> dict[str, Any]:
    """One drafter, through the serving path's own objects (Distiller, the executor make_executor gives serving,
    a WeightPublisher into a serving copy in SGLang's dtype):

    - update time: the median of `alone` updates (after one warm-up) with nothing else on the device, from the
      executor's timing (start of the update on its thread to its side-stream work complete);
    - per stride S: `cycles * S` rounds without TTS (the verify stand-in alone), then, after S warm-up rounds,
      `cycles * S` serving rounds (barrier, verify, observe) with the Distiller at stride S: `cycles` updates
      each submitted S rounds before the barrier that publishes it, so it overlaps S - 1 rounds. Their extra
      wall time per update is what the update costs serving; hidden = 1 - extra / update time; overhead = extra /
      (S rounds);
    - round slowdown while an update runs: each TTS round's excess over the median round without TTS, per
      share of the round that overlapped a running update (least squares through zero, all strides pooled).
    """
    from sglang_tts.config import TTSConfig
    from sglang_tts.core.distiller import Distiller, select_trainable
    from sglang_tts.core.executor import SideStreamExecutor, make_executor
    from sglang_tts.core.publish import WeightPublisher

    canvas = _scale_canvas(spec, drafter, ctx.device)
    named = list(drafter.trainable_named_parameters())
    selected = set(select_trainable(named, ctx.trainable))  # --tts-trainable's selection
    trained = {name: p for name, p in named if name in selected}
    # The serving copy in SGLang's dtype; publishing casts into it in place, as into SGLang's draft model.
    serving = {name: p.detach().to(spec.serving_dtype).clone() for name, p in trained.items()}
    before = {name: t.clone() for name, t in list(serving.items())[:4]}
    executor = make_executor(ctx.device, sync=False, cpu_thread=True)
    if ctx.cuda:
        expect(isinstance(executor, SideStreamExecutor), f"CUDA serving got {type(executor).__name__}")
    # The serving defaults (Adam at lr 1e-4, guard scoring each update, the fused loss); a guard window longer
    # than the run, so that a reset (a random drafter on a random canvas may score worse than base) cannot interleave.
    config = TTSConfig(update_stride=1, log_interval=0, scope="global", guard_window=10_000, trainable=ctx.trainable)
    distiller = Distiller(drafter, config, executor, publisher=WeightPublisher.from_name_map(serving, trained))
    results: list[Any] = []
    distiller.on_update_done = results.append
    try:
        with _captured_logs() as logs:
            for _ in range(1 + spec.alone):  # the first compiles kernels and allocates optimizer state
                distiller.observe(canvas, owned=True)
                distiller.barrier(force=True)
            _expect_updates_ok(results, distiller.stats, logs)  # before minutes of rounds on a broken update
            alone = sorted(r.timing.run_s for r in results[1:])
            update_s = alone[len(alone) // 2]
            runs = []
            for stride in spec.strides:
                distiller.set_update_stride(stride)
                distiller.barrier(force=True)
                stand_in.sync()  # the publish's copies are not the frozen rounds' work
                frozen: list[tuple[float, float]] = []
                frozen_gpu: list[float | None] = []
                start = time.perf_counter()
                _serve_rounds(None, stand_in, canvas, stride * spec.cycles, frozen, frozen_gpu)
                frozen_s = time.perf_counter() - start
                _serve_rounds(distiller, stand_in, canvas, stride, [], [])  # its last observe submits an update
                first = len(results)
                spans: list[tuple[float, float]] = []
                gpu: list[float | None] = []
                start = time.perf_counter()
                _serve_rounds(distiller, stand_in, canvas, stride * spec.cycles, spans, gpu)
                tts_s = time.perf_counter() - start
                distiller.barrier(force=True)  # the update the window's last round submitted, outside the window
                window = results[first : first + spec.cycles]
                runs.append(
                    _StrideRun(
                        stride, frozen_s, tts_s, len(window), sum(r.timing.wait_blocked_s for r in window),
                        [b - a for a, b in spans], gpu, [b - a for a, b in frozen], frozen_gpu, spans,
                        [(r.timing.started_at, r.timing.finished_at) for r in window],
                    )
                )  # fmt: skip
        stats = distiller.stats
    finally:
        distiller.close()
    _expect_updates_ok(results, stats, logs)
    expect(all(run.updates == spec.cycles for run in runs), f"updates per stride window: {[r.updates for r in runs]}")
    expect(
        any(not torch.equal(serving[name], old) for name, old in before.items()),
        "the serving copy never changed: nothing was published",
    )
    round_s = _median([s for run in runs for s in run.frozen_round_s])
    # Round slowdown while an update runs: each TTS round's excess over the median frozen round, per share of it
    # that overlapped a running update (least squares through zero over the rounds that overlapped one), on the
    # host's clock (what serving sees) and on the GPU's (the device's share of it).
    overlap = [
        [_overlap(span, run.update_spans) / max(span[1] - span[0], 1e-9) for span in run.round_spans] for run in runs
    ]
    slowdown = _slowdown([s for run in runs for s in run.round_s], sum(overlap, []), round_s)
    gpu_frozen = [s for run in runs for s in run.frozen_gpu_s if s is not None]
    gpu_slowdown = None
    if gpu_frozen:
        gpu_rounds = [s for run in runs for s in run.round_gpu_s]
        gpu_slowdown = _slowdown(gpu_rounds, sum(overlap, []), _median(gpu_frozen))
    covered = sum(sum(o) for o in overlap)
    strides = {}
    for run in runs:
        extra_s = (run.tts_s - run.frozen_s) / run.updates
        strides[str(run.stride)] = {
            "hidden": 1.0 - extra_s / update_s,
            "extra_ms_per_update": extra_s * 1e3,
            "overhead": extra_s / (run.stride * round_s),  # of serving time: what the update costs at this stride
            "barrier_wait_ms": run.wait_s / run.updates * 1e3,
        }
    return {
        "trained_params": sum(p.numel() for p in trained.values()),
        "update_ms": update_s * 1e3,
        "update_rounds": update_s / round_s,
        "round_ms": round_s * 1e3,
        "strides": strides,
        "round_slowdown": slowdown,
        "round_slowdown_gpu": gpu_slowdown,
        "rounds_overlapped": covered,
        "updates": len(results),
    }


def check_update_at_scale(ctx: Context) -> tuple[str, dict[str, Any]]:
    """One TTS update of EAGLE-3 (32K and 128K draft vocabularies) and DFlash drafters shaped for an 8B target,
    on the side stream against a memory-bound verify stand-in: update time, share hidden at strides 1-10, round
    slowdown (tiny sizes on CPU: the same code, rehearsed)."""
    spec = SCALES[ctx.scale_name]
    if spec.name == "8b" and not ctx.cuda:
        raise Skip("the 8b scale needs a GPU (about 30 GB and minutes on a CPU): on CPU run --scale tiny")
    if ctx.serving_priority is not None and ctx.cuda:
        serving = torch.cuda.Stream(ctx.device, priority=ctx.serving_priority)
        with torch.cuda.stream(serving):
            detail, metrics = _update_at_scale(ctx, spec)
        metrics["serving_priority"] = serving.priority
        return detail + f" (serving stream priority {serving.priority})", metrics
    return _update_at_scale(ctx, spec)


def _update_at_scale(ctx: Context, spec: ScaleSpec) -> tuple[str, dict[str, Any]]:
    stand_in = VerifyStandIn(spec, ctx.device)
    stand_in.calibrate(ctx.round_ms or spec.round_ms)
    builders: list[tuple[str, Callable[[], Any]]] = [
        (f"eagle3-{_count(v)}", lambda v=v: _scale_eagle3(spec, v, ctx.device)) for v in spec.draft_vocabs
    ]
    builders.append(("dflash", lambda: _scale_dflash(spec, ctx.device)))
    drafters: dict[str, Any] = {}
    for name, build in builders:
        drafter = build()
        try:
            drafters[name] = _measure_update(ctx, spec, drafter, stand_in)
        finally:
            del drafter
            gc.collect()
            if ctx.cuda:
                torch.cuda.empty_cache()
    metrics: dict[str, Any] = {
        "scale": spec.name,
        "serving_dtype": str(spec.serving_dtype).removeprefix("torch."),
        "trained_dtype": str(spec.trained_dtype).removeprefix("torch."),
        "batch": spec.batch,
        "context": spec.context,
        "trainable": list(ctx.trainable) if ctx.trainable else "all",
        "verify": {
            "layers": stand_in.layers,
            "gb_per_round": stand_in.gb_per_round,
            "decode_equivalents": stand_in.gb_per_round / _decode_gb(spec),
            "round_ms": stand_in.round_ms,
            "rows": spec.verify_rows,
        },
        "drafters": drafters,
        "targets": {
            "hidden_at_stride": HIDDEN_TARGET_STRIDE,
            "hidden": HIDDEN_TARGET,
            "round_slowdown": SLOWDOWN_TARGET,
        },
    }
    measured = ctx.cuda and spec.name == "8b"
    if measured:
        for result in drafters.values():
            slowdown = result["round_slowdown"]
            result["targets_met"] = result["strides"][str(HIDDEN_TARGET_STRIDE)]["hidden"] >= HIDDEN_TARGET and (
                slowdown is None or slowdown <= SLOWDOWN_TARGET
            )
    parts = []
    for name, result in drafters.items():
        hidden = "/".join(f"{result['strides'][str(s)]['hidden']:.0%}" for s in spec.strides)
        slowdown = _percent(result["round_slowdown"])
        verdict = "" if not measured else (" targets met" if result["targets_met"] else " TARGETS MISSED")
        parts.append(
            f"{name} ({_count(result['trained_params'])} trained) {result['update_ms']:.1f} ms = "
            f"{result['update_rounds']:.2f} rounds, hidden {hidden}, round slowdown {slowdown}{verdict}"
        )
    strides = "/".join(str(s) for s in spec.strides)
    head = (
        f"{spec.name}{'' if measured else ' (rehearsal: timings not meaningful)'}; round {stand_in.round_ms:.1f} ms "
        f"({stand_in.layers} layer passes, {stand_in.gb_per_round:.3g} GB); hidden at strides {strides}: "
    )
    return head + "; ".join(parts), metrics


# ----------------------------------------------------------------------------- driver


@dataclass(frozen=True)
class Check:
    name: str
    fn: Callable[[Context], str | tuple[str, dict[str, Any]]]  # the detail, and measurements if any
    where: str  # "cpu+cuda" | "cuda"


CHECKS = [
    Check("kernel_linear_kl", check_kernel_linear_kl, "cpu+cuda"),
    Check("kernel_gather_draft", check_kernel_gather_draft, "cpu+cuda"),
    Check("kernel_lowrank_delta", check_kernel_lowrank_delta, "cpu+cuda"),
    Check("executor_barrier", check_executor_barrier, "cpu+cuda"),
    Check("publish_all_or_nothing", check_publish_all_or_nothing, "cpu+cuda"),
    Check("graph_replay_publish", check_graph_replay_publish, "cuda"),
    Check("adapter_kernel_capture", check_adapter_kernel_capture, "cuda"),
    Check("sync_free_round", check_sync_free_round, "cuda"),
    Check("sampled_verify_ops", check_sampled_verify_ops, "cuda"),
    Check("update_at_scale", check_update_at_scale, "cpu+cuda"),
    Check("no_sglang_import", check_no_sglang_import, "cpu+cuda"),  # last: sees what everything above imported
]


def run_check(check: Check, ctx: Context) -> CheckResult:
    start = time.perf_counter()
    metrics = None
    try:
        status, detail = PASS, check.fn(ctx)
        if isinstance(detail, tuple):
            detail, metrics = detail
    except Skip as exc:
        status, detail = SKIP, str(exc)
    except CheckFailed as exc:
        status, detail = FAIL, str(exc)
    except Exception as exc:  # noqa: BLE001 - an unexpected error fails this check, the others still run
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        status, detail = FAIL, f"{type(exc).__name__}: {exc} ({Path(frame.filename).name}:{frame.lineno})"
    return CheckResult(check.name, status, time.perf_counter() - start, detail, metrics)


def run_checks(
    device: str | torch.device,
    names: Sequence[str] | None = None,
    scale: str = "auto",
    round_ms: float | None = None,
    trainable: Sequence[str] | None = None,
    serving_priority: int | None = None,
) -> list[CheckResult]:
    unknown = sorted(set(names or ()) - {c.name for c in CHECKS})
    if unknown:
        raise ValueError(f"unknown checks {unknown}; known: {[c.name for c in CHECKS]}")
    if scale not in ("auto", *SCALES):
        raise ValueError(f"unknown scale {scale!r}; known: auto, {', '.join(SCALES)}")
    ctx = Context(torch.device(device), scale, round_ms, tuple(trainable) if trainable else None, serving_priority)
    return [run_check(c, ctx) for c in CHECKS if not names or c.name in names]


def format_table(results: Sequence[CheckResult]) -> str:
    width = max(len("check"), *(len(r.name) for r in results))
    lines = [f"{'check':<{width}}  result  seconds  detail"]
    lines += [f"{r.name:<{width}}  {r.result.upper():<6}  {r.seconds:7.2f}  {r.detail}" for r in results]
    return "\n".join(lines)


def format_scale_table(metrics: dict[str, Any]) -> str:
    """update_at_scale's measurements as a Markdown table, one row per drafter."""
    strides = list(next(iter(metrics["drafters"].values()))["strides"])
    verify = metrics["verify"]
    lines = [
        f"update at scale ({metrics['scale']}): {metrics['batch']} requests, {metrics['context']} tokens of context "
        f"each; trained copy {metrics['trained_dtype']}, serving copy {metrics['serving_dtype']}; verify stand-in "
        f"{verify['round_ms']:.1f} ms per round ({verify['layers']} layer passes, {verify['gb_per_round']:.3g} GB = "
        f"{verify['decode_equivalents']:.2f} decodes of the target, {verify['rows']} rows)",
        "",
        "| drafter | trained | update ms | in rounds | "
        + " | ".join(f"hidden S={s}" for s in strides)
        + " | cost of serving time at "
        + "/".join(strides)
        + " | round slowdown | targets |",
        "|---" * (7 + len(strides)) + "|",
    ]
    for name, d in metrics["drafters"].items():
        hidden = " | ".join(f"{d['strides'][s]['hidden']:.0%}" for s in strides)
        cost = "/".join(f"{d['strides'][s]['overhead']:.0%}" for s in strides)
        slowdown = _percent(d["round_slowdown"])
        if d.get("round_slowdown_gpu") is not None:
            slowdown += f" (GPU {_percent(d['round_slowdown_gpu'])})"
        met = d.get("targets_met")
        verdict = "-" if met is None else ("met" if met else "missed")
        lines.append(
            f"| {name} | {_count(d['trained_params'])} | {d['update_ms']:.1f} | {d['update_rounds']:.2f} | {hidden} | "
            f"{cost} | {slowdown} | {verdict} |"
        )
    targets = metrics["targets"]
    lines += [
        "",
        f"targets: >= {targets['hidden']:.0%} hidden at stride {targets['hidden_at_stride']}, round slowdown <= "
        f"{targets['round_slowdown']:.0%} (judged on the 8b scale on CUDA only)",
    ]
    return "\n".join(lines)


def format_markdown(header: str, results: Sequence[CheckResult]) -> str:
    lines = ["# gpu_check", "", header, "", "| check | result | seconds | detail |", "|---|---|---|---|"]
    lines += [f"| {r.name} | {r.result} | {r.seconds:.2f} | {r.detail.replace('|', '/')} |" for r in results]
    for r in results:
        if r.metrics is not None and r.name == "update_at_scale":
            lines += ["", format_scale_table(r.metrics)]
    return "\n".join(lines) + "\n"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda if available, else cpu")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--markdown", type=Path, help="also write a Markdown report here")
    parser.add_argument(
        "--scale",
        choices=("auto", *SCALES),
        default="auto",
        help="update_at_scale's sizes: 8b (drafters for an 8B target), tiny (the rehearsal); auto: 8b on CUDA",
    )
    parser.add_argument(
        "--round-ms", type=float, help="update_at_scale: calibrate the verify stand-in to this (default: the scale's)"
    )
    parser.add_argument(
        "--trainable",
        nargs="+",
        metavar="PREFIX",
        help="update_at_scale: train only parameters whose names start with these (--tts-trainable); default all",
    )
    parser.add_argument(
        "--serving-priority",
        type=int,
        metavar="P",
        help="update_at_scale: serve on a CUDA stream of priority P (lower: more urgent); default: the default stream",
    )
    parser.add_argument("--only", action="append", metavar="CHECK", help="run only this check (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the checks and where they run, then exit")
    args = parser.parse_args(argv)
    if args.list:
        for c in CHECKS:
            summary = (c.fn.__doc__ or "").strip().splitlines()[0]
            print(f"{c.name:<24} {c.where:<9} {summary}")
        return 0
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    if device == "cpu":
        # Before any kernel module imports Triton: on CPU its kernels run through the interpreter.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    where = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
    header = f"gpu_check on {device} ({where}); torch {torch.__version__}, triton {_version('triton') or 'absent'}"
    print(header)
    results = run_checks(device, args.only, args.scale, args.round_ms, args.trainable, args.serving_priority)
    print(format_table(results))
    for r in results:
        if r.metrics is not None and r.name == "update_at_scale":
            print("\n" + format_scale_table(r.metrics) + "\n")
    failed = [r.name for r in results if r.result == FAIL]
    counts = {s: sum(r.result == s for r in results) for s in (PASS, FAIL, SKIP)}
    print(f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped")
    if args.json is not None:
        report = {
            "device": device,
            "device_name": where,
            "torch": torch.__version__,
            "triton": _version("triton"),
            "triton_interpret": os.environ.get("TRITON_INTERPRET"),
            "ok": not failed,
            "scale": Context(torch.device(device), args.scale).scale_name,
            "checks": [asdict(r) for r in results],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(format_markdown(header, results))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
