"""A policy that changes between RL steps: successive fine-tuned checkpoints of a target model.

An RL trainer moves the policy after every rollout step and pushes the new weights into the
rollout server (`/update_weights_from_disk`). To measure what that does to a drafter (the frozen
drafter goes stale; TTS follows), `scripts/bench_rollout.py --drift` needs real weight changes of
the target: this module makes them by supervised fine-tuning (a few torch.optim.AdamW steps on
question -> answer pairs, e.g. GSM8K's reference solutions, whose terse style with `<<a*b=c>>`
calculator notes the instruct model does not write), one checkpoint per "RL step":

    base -> ckpt-1 (M steps) -> ckpt-2 (M more steps) -> ...

Each checkpoint is a complete Hugging Face model folder (safetensors, config, tokenizer files) that
SGLang loads as the new policy. What moved is measured on held-out pairs: the mean KL between the
base model's and the checkpoint's next-token distributions over the answer tokens (teacher-forced),
and the share of those positions where their argmax agrees. Every finished
checkpoint has a `drift.json`; a rerun skips finished checkpoints and goes on from the last one.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

DONE = "drift.json"
# Files copied from the base model folder into every checkpoint besides the weights.
_KEEP_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja")
_SKIP_FILES = ("model.safetensors.index.json", DONE)


@dataclass(frozen=True)
class Example:
    """One supervised pair; the loss covers the answer's tokens only."""

    prompt: str
    answer: str


@dataclass
class DriftSettings:
    checkpoints: int = 2  # RL steps to make (each a folder ckpt-K)
    steps_per_checkpoint: int = 12  # optimizer steps between two checkpoints
    lr: float = 5e-5
    batch_size: int = 2
    max_tokens: int = 256  # prompt + answer, truncated
    train: str = "layers"  # "layers": the decoder layers (embeddings and head stay); "all"
    seed: int = 0
    threads: int | None = None


@dataclass
class CheckpointReport:
    name: str
    path: str
    optimizer_steps: int  # since the base model
    train_loss_first: float
    train_loss_last: float
    kl_from_base: float | None = None  # mean KL(base || checkpoint) per answer token, held-out
    argmax_agreement: float | None = None  # share of held-out positions where both pick the same token
    seconds: float = 0.0
    settings: dict = field(default_factory=dict)


def gsm8k_examples(path: Path) -> list[Example]:
    """GSM8K rows ({"question", "answer"}) as supervised pairs."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [Example(r["question"], r["answer"]) for r in rows if r.get("question") and r.get("answer")]


def encode(tokenizer, example: Example, max_tokens: int) -> tuple[list[int], int]:
    """Token ids of the chat-formatted pair and where the answer starts (loss from there on)."""
    messages = [{"role": "user", "content": example.prompt}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        prompt_ids = tokenizer(example.prompt + "\n")["input_ids"]
    answer_ids = tokenizer(example.answer, add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids = (list(prompt_ids) + list(answer_ids) + eos)[:max_tokens]
    return ids, min(len(prompt_ids), len(ids) - 1)


def _batch(encoded: Sequence[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids [B, T], attention_mask [B, T], labels [B, T] (-100 outside the answers)."""
    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for row, (ids, start) in enumerate(encoded):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = 1
        labels[row, start : len(ids)] = input_ids[row, start : len(ids)]
    return input_ids, mask, labels


def trainable_parameters(model: torch.nn.Module, train: str) -> list[torch.nn.Parameter]:
    if train not in ("layers", "all"):
        raise ValueError(f"train must be 'layers' or 'all', got {train!r}")
    chosen = []
    for name, param in model.named_parameters():
        keep = train == "all" or ".layers." in f".{name}"
        param.requires_grad_(keep)
        if keep:
            chosen.append(param)
    if not chosen:
        raise ValueError("no parameter selected for training (no decoder layers found)")
    return chosen


@torch.no_grad()
def measure_drift(base, model, held_out: Sequence[tuple[list[int], int]]) -> tuple[float, float]:
    """Mean KL(base || model) per answer token and argmax agreement, teacher-forced on `held_out`."""
    kl_sum, agree, count = 0.0, 0, 0
    for ids, start in held_out:
        x = torch.tensor([ids])
        p = torch.log_softmax(base(input_ids=x).logits[0, start - 1 : -1].float(), -1)
        q = torch.log_softmax(model(input_ids=x).logits[0, start - 1 : -1].float(), -1)
        kl_sum += float((p.exp() * (p - q)).sum())
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        count += p.shape[0]
    return kl_sum / max(count, 1), agree / max(count, 1)


def _copy_side_files(base_dir: Path, out: Path) -> None:
    for path in base_dir.iterdir():
        if path.is_file() and path.suffix in _KEEP_SUFFIXES and path.name not in _SKIP_FILES:
            if path.name != "config.json" or not (out / "config.json").exists():
                shutil.copy2(path, out / path.name)


def finished(out_dir: Path, k: int) -> CheckpointReport | None:
    marker = out_dir / f"ckpt-{k}" / DONE
    if not marker.is_file():
        return None
    return CheckpointReport(**json.loads(marker.read_text()))


def make_drift(
    base_dir: Path,
    out_dir: Path,
    train: Sequence[Example],
    held_out: Sequence[Example],
    settings: DriftSettings,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> list[CheckpointReport]:
    """Checkpoints ckpt-1..ckpt-K under `out_dir`, each `settings.steps_per_checkpoint` more AdamW
    steps on `train` than the one before; resumes after the last finished checkpoint (the optimizer
    state starts afresh there: a resumed run differs from an uninterrupted one in that only)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if settings.threads:
        torch.set_num_threads(settings.threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    reports = []
    start_k = 1
    while start_k <= settings.checkpoints and (done := finished(out_dir, start_k)) is not None:
        reports.append(done)
        start_k += 1
    if start_k > settings.checkpoints:
        return reports
    source = base_dir if start_k == 1 else out_dir / f"ckpt-{start_k - 1}"
    if start_k > 1:
        log(f"[drift] resuming from {source.name}")
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    params = trainable_parameters(model, settings.train)
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    encoded = [encode(tokenizer, e, settings.max_tokens) for e in train]
    probe = [encode(tokenizer, e, settings.max_tokens) for e in held_out]
    rng = random.Random(settings.seed + start_k)
    steps_before = (start_k - 1) * settings.steps_per_checkpoint
    for k in range(start_k, settings.checkpoints + 1):
        began = time.perf_counter()
        model.train()
        losses = []
        bar = tqdm(range(settings.steps_per_checkpoint), desc=f"ckpt-{k}", disable=not progress, dynamic_ncols=True)
        for _ in bar:
            input_ids, mask, labels = _batch(rng.sample(encoded, min(settings.batch_size, len(encoded))), pad_id)
            loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            losses.append(float(loss.detach()))
            bar.set_postfix_str(f"loss {losses[-1]:.3f}")
        model.eval()
        kl, agreement = measure_drift(base, model, probe) if probe else (None, None)
        path = out_dir / f"ckpt-{k}"
        partial = out_dir / f".ckpt-{k}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial, safe_serialization=True)
        _copy_side_files(base_dir, partial)
        steps_before += settings.steps_per_checkpoint
        report = CheckpointReport(
            f"ckpt-{k}",
            str(path),
            steps_before,
            losses[0],
            losses[-1],
            kl,
            agreement,
            time.perf_counter() - began,
            asdict(settings),
        )
        (partial / DONE).write_text(json.dumps(asdict(report), indent=1) + "\n")
        shutil.rmtree(path, ignore_errors=True)
        partial.rename(path)  # a checkpoint appears complete or not at all
        moved = "" if kl is None else f", KL from base {kl:.4f}, argmax agreement {agreement:.3f}"
        log(f"[drift] {path}: loss {losses[0]:.3f} -> {losses[-1]:.3f}{moved}")
        reports.append(report)
    return reports
