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
    no_sglang_import         no sglang module got imported                 same

Usage (the exit status is 1 when a check fails; skips are fine)::

    .venv/bin/python scripts/gpu_check.py                    # cuda if available, else cpu
    .venv/bin/python scripts/gpu_check.py --device cpu --json gpu_check.json
    python scripts/gpu_check.py --list

On CPU the script sets TRITON_INTERPRET=1 before anything imports Triton (unless the variable is already set);
on CUDA a set TRITON_INTERPRET=1 fails the kernel checks (they exist to test the compiled kernels). The script
runs from a bare checkout: when `sglang_tts` is not installed it puts the repository root on sys.path.
"""

from __future__ import annotations

import argparse
import copy
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

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def generator(self, seed: int) -> torch.Generator:
        # CPU generator: tensors are drawn on the host and moved, so CPU and CUDA runs see the same numbers.
        return torch.Generator().manual_seed(seed)


@dataclass
class CheckResult:
    name: str
    result: str  # pass | fail | skip
    seconds: float
    detail: str


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


# ----------------------------------------------------------------------------- driver


@dataclass(frozen=True)
class Check:
    name: str
    fn: Callable[[Context], str]
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
    Check("no_sglang_import", check_no_sglang_import, "cpu+cuda"),  # last: sees what everything above imported
]


def run_check(check: Check, ctx: Context) -> CheckResult:
    start = time.perf_counter()
    try:
        status, detail = PASS, check.fn(ctx)
    except Skip as exc:
        status, detail = SKIP, str(exc)
    except CheckFailed as exc:
        status, detail = FAIL, str(exc)
    except Exception as exc:  # noqa: BLE001 - an unexpected error fails this check, the others still run
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        status, detail = FAIL, f"{type(exc).__name__}: {exc} ({Path(frame.filename).name}:{frame.lineno})"
    return CheckResult(check.name, status, time.perf_counter() - start, detail)


def run_checks(device: str | torch.device, names: Sequence[str] | None = None) -> list[CheckResult]:
    unknown = sorted(set(names or ()) - {c.name for c in CHECKS})
    if unknown:
        raise ValueError(f"unknown checks {unknown}; known: {[c.name for c in CHECKS]}")
    ctx = Context(torch.device(device))
    return [run_check(c, ctx) for c in CHECKS if not names or c.name in names]


def format_table(results: Sequence[CheckResult]) -> str:
    width = max(len("check"), *(len(r.name) for r in results))
    lines = [f"{'check':<{width}}  result  seconds  detail"]
    lines += [f"{r.name:<{width}}  {r.result.upper():<6}  {r.seconds:7.2f}  {r.detail}" for r in results]
    return "\n".join(lines)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda if available, else cpu")
    parser.add_argument("--json", type=Path, help="also write the results here")
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
    print(f"gpu_check on {device} ({where}); torch {torch.__version__}, triton {_version('triton') or 'absent'}")
    results = run_checks(device, args.only)
    print(format_table(results))
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
            "checks": [asdict(r) for r in results],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
