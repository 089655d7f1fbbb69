"""The optimisation loop shared by both recipes: AdamW, warmup + cosine/constant LR, gradient
clipping, periodic checkpoints, and an exactly resumable training state.

Resumability: the state file (``<out>/train/state.pt``) holds the step, the drafter's state dict,
the optimizer and scheduler states and the metric history. It is read with PyTorch's weights-only
unpickler (tensors and plain containers, never code): the non-tensor state (step, scheduler,
history, settings) is one JSON string inside it, so a tampered output folder cannot run code on
``--resume``; a file that needs more than that is refused naming the file. Recipes must make step ``s``'s batch
and randomness a function of ``s`` alone (``target.batch_indices``, per-step generators), so a
resumed run takes exactly the steps the uninterrupted one would have taken.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from sglang_tts.training.data import atomic_save

logger = logging.getLogger(__name__)

STATE_FILE = "state.pt"
METRICS_FILE = "metrics.jsonl"


@dataclass
class OptimConfig:
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_ratio: float = 0.03  # of the total steps, at least one step
    schedule: str = "cosine"  # cosine | constant (after warmup)
    min_lr_ratio: float = 0.1  # cosine floor, as a fraction of lr
    grad_clip: float = 0.5  # max global grad norm (EAGLE-3 recipe); 0 disables


@dataclass
class LoopConfig:
    steps: int
    save_every: int = 200  # steps between checkpoints + state (and always at the end)
    log_every: int = 10
    time_budget_s: float | None = None  # stop cleanly (saving) once this much wall time is spent
    stop_after: int | None = None  # stop cleanly after this step (an interruption, for tests)
    progress: bool = True


@dataclass
class LoopResult:
    start_step: int  # where this run began (0, or the resumed step)
    step: int  # steps done in total
    finished: bool  # reached LoopConfig.steps
    history: list[dict[str, float]] = field(default_factory=list)


StepFn = Callable[[int], tuple[torch.Tensor, dict[str, float]]]


def lr_lambda(cfg: OptimConfig, total_steps: int) -> Callable[[int], float]:
    warmup = max(1, round(cfg.warmup_ratio * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    if cfg.schedule not in ("cosine", "constant"):
        raise ValueError(f"schedule must be cosine or constant, got {cfg.schedule!r}")
    return factor


def train_loop(
    model: nn.Module,
    step_fn: StepFn,
    optim: OptimConfig,
    loop: LoopConfig,
    state_dir: Path,
    save_fn: Callable[[int], None],
    resume: bool = False,
    desc: str = "training",
) -> LoopResult:
    """Run `loop.steps` optimizer steps of `step_fn` (loss, metrics) over `model`'s trainable
    parameters, saving with `save_fn(step)` and the state file every `save_every` steps and at the
    end (or when stopped early). With `resume`, continue from `state_dir`'s state if present."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)
    schedule = lr_lambda(optim, loop.steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    state_file = state_dir / STATE_FILE
    history: list[dict[str, float]] = []
    step = 0
    if resume and state_file.is_file():
        state = load_training_state(state_file)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, history = int(state["step"]), list(state["history"])
        # The saved states carry the old peak LR, which would silently beat a new --lr. The
        # requested LR and total steps govern the rest of the run; with unchanged flags this sets
        # exactly the LR the saved run would have used, so the resume stays exact.
        scheduler.base_lrs = [optim.lr] * len(optimizer.param_groups)
        for group in optimizer.param_groups:
            group["initial_lr"], group["lr"] = optim.lr, optim.lr * schedule(step)
        saved_lr = state.get("optim_config", {}).get("lr")
        if saved_lr is not None and saved_lr != optim.lr:
            logger.info("resuming with peak lr %g (the saved run used %g)", optim.lr, saved_lr)
        logger.info("resumed from %s at step %d", state_file, step)
    elif resume:
        logger.warning("--resume: no training state at %s, starting from scratch", state_file)
    start_step = step

    def save() -> None:
        save_fn(step)
        meta = {
            "step": step,
            "scheduler": scheduler.state_dict(),
            "history": history,
            "optim_config": asdict(optim),
            "steps": loop.steps,
        }
        atomic_save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "meta": json.dumps(meta)}, state_file
        )

    # The metric log restarts with a fresh run and drops what a killed run logged after its last save.
    metrics_file = state_dir / METRICS_FILE
    metrics_file.parent.mkdir(parents=True, exist_ok=True)
    kept = [r for r in read_metrics(state_dir) if r["step"] <= step] if step else []
    metrics_file.write_text("".join(json.dumps(r) + "\n" for r in kept))

    began = time.monotonic()
    model.train()
    bar = tqdm(total=loop.steps, initial=step, desc=desc, unit="step", disable=not loop.progress)
    while step < loop.steps:
        loss, metrics = step_fn(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, optim.grad_clip if optim.grad_clip > 0 else float("inf"))
        optimizer.step()
        lr = optimizer.param_groups[0]["lr"]  # the LR this step used
        scheduler.step()
        step += 1
        record = {"step": step, "loss": float(loss.detach()), "lr": lr, "grad_norm": float(grad_norm), **metrics}
        history.append(record)
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}")
        if step % loop.log_every == 0 or step == loop.steps:
            with metrics_file.open("a") as handle:
                handle.write(json.dumps(record) + "\n")
            logger.info("%s step %d: %s", desc, step, {k: round(v, 4) for k, v in record.items()})
        out_of_time = loop.time_budget_s is not None and time.monotonic() - began >= loop.time_budget_s
        stop = out_of_time or (loop.stop_after is not None and step >= loop.stop_after)
        if step % loop.save_every == 0 or step == loop.steps or stop:
            save()
        if stop:
            if out_of_time:
                logger.warning(
                    "%s: time budget of %.0f s spent at step %d/%d", desc, loop.time_budget_s, step, loop.steps
                )
            break
    bar.close()
    model.eval()
    if step == start_step and step >= loop.steps:
        save_fn(step)  # a resumed, already finished run still (re)writes its checkpoint
    return LoopResult(start_step=start_step, step=step, finished=step >= loop.steps, history=history)


def training_state_step(state_dir: Path) -> int | None:
    """The step stored in a training state, or None when there is none."""
    state_file = state_dir / STATE_FILE
    if not state_file.is_file():
        return None
    return int(load_training_state(state_file)["step"])


def load_training_state(state_file: Path) -> dict[str, Any]:
    """A training state file, read with the weights-only unpickler (it never runs code from the
    file): the tensors plus the JSON-encoded rest, flattened into one dict."""
    try:
        stored = torch.load(state_file, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle.UnpicklingError for disallowed globals, anything for a torn file
        raise ValueError(
            f"refusing to resume from {state_file}: it is not a weights-only training state "
            f"(tampered with, or not written by this trainer): {exc}. Delete it to start afresh."
        ) from exc
    if not isinstance(stored, dict) or not {"model", "optimizer"} <= stored.keys():
        raise ValueError(f"refusing to resume from {state_file}: not a training state (keys model, optimizer)")
    if "meta" not in stored:  # written before the JSON split: the same fields, stored flat
        return stored
    return {"model": stored["model"], "optimizer": stored["optimizer"], **json.loads(stored["meta"])}


def read_metrics(state_dir: Path) -> list[dict[str, Any]]:
    path = state_dir / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
