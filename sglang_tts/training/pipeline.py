"""End to end: target -> generated set -> target features -> EAGLE-3 / DFlash drafters on disk.

Output folders (config.json + model.safetensors, what SGLang's ``--speculative-draft-model-path``
and ``sglang_tts.drafters.load_drafter`` take) default to
``cache_root() / "drafters" / f"{target}-{kind}-{tag}"``. Each also holds ``train/``: the
resumable training state (``state.pt``), the metric log (``metrics.jsonl``) and ``summary.json``
(held-out metrics before and after training, timings, the full configuration), and the prompts of
the split as ``held_in.jsonl`` / ``held_out.jsonl`` (``scripts/bench_long.py --datasets`` reads them). SGLang
ignores the subfolder. Generated sets and features are cached under ``cache_root() / "drafters" / "data"``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from sglang_tts.assets import cache_root, resolve_model
from sglang_tts.drafters.eagle3 import Eagle3Config
from sglang_tts.drafters.loading import kind_from_config, load_checkpoint_tensors, read_config
from sglang_tts.drafters.shipped import shipped_answers, shipped_drafter
from sglang_tts.training.data import DataConfig, build_sequence_set, prompt_pool, write_prompt_split
from sglang_tts.training.dflash import (
    DFlashObjective,
    DFlashTrainConfig,
    build_dflash,
    evaluate_dflash,
    pick_mask_token_id,
)
from sglang_tts.training.eagle3 import (
    Eagle3Objective,
    Eagle3TrainConfig,
    build_eagle3,
    evaluate_eagle3,
    frequency_draft_vocab,
)
from sglang_tts.training.loop import (
    STATE_FILE,
    LoopConfig,
    OptimConfig,
    load_training_state,
    train_loop,
    training_state_step,
)
from sglang_tts.training.target import compute_features, load_target
from sglang_tts.training.weights import write_drafter

logger = logging.getLogger(__name__)

KINDS = ("eagle3", "dflash")
TRAIN_SUBDIR = "train"


@dataclass
class TrainRequest:
    """Everything one `train_drafters` run needs; CLI flags map onto these fields."""

    target: Path | str | None = None  # a folder or a MODELS name; None: the default (SmolLM2-135M-Instruct)
    kinds: tuple[str, ...] = KINDS
    out: Path | None = None  # one kind: its folder; several: the parent of the default-named folders
    tag: str | None = None  # None: f"len{max_new_tokens}"
    data: DataConfig = field(default_factory=DataConfig)
    train_context: int | None = 1024  # prompt tokens kept before each answer for training (None: all)
    eval_sequences: int = 16  # held out of training, for the reported metrics
    epochs: float = 3.0
    steps: int | None = None  # overrides epochs
    optim: OptimConfig = field(default_factory=OptimConfig)
    eagle3: Eagle3TrainConfig = field(default_factory=Eagle3TrainConfig)
    dflash: DFlashTrainConfig = field(default_factory=DFlashTrainConfig)
    seed: int = 0
    resume: bool = False
    init_from: Path | str | None = None  # a trained drafter folder, or "shipped", to start from instead of random
    save_every: int = 200
    log_every: int = 10
    time_budget_s: float | None = None  # per kind
    stop_after: int | None = None  # per kind: stop (saving a resumable state) after this step
    cache_dir: Path | None = None  # generated sets and features; None: cache_root()/drafters/data
    progress: bool = True


def tiny_request(**overrides: Any) -> TrainRequest:
    """A configuration that trains both drafters end to end in well under a few minutes on 2 cores
    (few prompts, short answers, few steps, small vocabulary and blocks): for tests and smoke runs."""
    request = TrainRequest(
        tag="tiny",
        data=DataConfig(num_prompts=8, max_new_tokens=32, batch_size=8),
        eval_sequences=2,
        steps=30,
        optim=OptimConfig(lr=1e-3, warmup_ratio=0.1),
        eagle3=Eagle3TrainConfig(draft_vocab_size=512, ttt_steps=4, batch_size=2),
        dflash=DFlashTrainConfig(block_size=4, num_layers=1, num_anchors=8, batch_size=2),
        save_every=10,
        log_every=5,
    )
    return replace(request, **overrides)


@dataclass
class KindResult:
    kind: str
    path: Path
    start_step: int
    step: int
    finished: bool
    history: list[dict[str, float]]
    eval_before: dict[str, Any] | None
    eval_after: dict[str, Any]
    seconds: float


def default_out(target_name: str, kind: str, tag: str) -> Path:
    return cache_root() / "drafters" / f"{target_name}-{kind}-{tag}"


def output_dir(request: TrainRequest, target_name: str, kind: str) -> Path:
    tag = request.tag or f"len{request.data.max_new_tokens}"
    if request.out is None:
        return default_out(target_name, kind, tag)
    if len(request.kinds) == 1:
        return Path(request.out)
    return Path(request.out) / f"{target_name}-{kind}-{tag}"


def num_steps(request: TrainRequest, num_sequences: int, batch_size: int) -> int:
    if request.steps is not None:
        return int(request.steps)
    return max(1, math.ceil(request.epochs * num_sequences / batch_size))


def saved_draft_vocab(state_dir: Path, resume: bool) -> torch.Tensor | None:
    """On ``--resume``, the draft vocabulary (target ids) the saved EAGLE-3 state was trained with: its weights
    only mean something over those ids, even when the resumed run's data (whose frequencies would choose
    another vocabulary) has grown. None when not resuming or nothing is saved."""
    state_file = state_dir / STATE_FILE
    if not resume or not state_file.is_file():
        return None
    return draft_vocab_of(load_training_state(state_file)["model"]["d2t"])


def draft_vocab_of(d2t: torch.Tensor) -> torch.Tensor:
    """The target ids of an EAGLE-3 draft vocabulary from its ``d2t`` offsets (draft id i -> i + d2t[i])."""
    return d2t + torch.arange(d2t.numel())


def dflash_choices_of(folder: Path, cfg: DFlashTrainConfig, flag: str) -> DFlashTrainConfig:
    """``cfg`` with the MASK id and target layers the DFlash drafter in ``folder`` was trained with: its weights
    only mean something for those. A value given explicitly must agree (``flag`` names the option in the error)."""
    saved = json.loads((folder / "config.json").read_text())["dflash_config"]
    choices = {"mask_token_id": int(saved["mask_token_id"]), "target_layer_ids": list(saved["target_layer_ids"])}
    for name, value in choices.items():
        given = getattr(cfg, name)
        given = list(given) if isinstance(given, (list, tuple)) else given
        if given is not None and given != value:
            raise ValueError(f"{flag}: the DFlash drafter in {folder} was trained with {name} {value}, not {given}")
    return replace(cfg, **choices)


def saved_dflash_choices(out: Path, cfg: DFlashTrainConfig, resume: bool) -> DFlashTrainConfig:
    """On ``--resume``, the saved DFlash drafter's choices (`dflash_choices_of`): a grown data set could pick
    another MASK id."""
    if not resume or not (out / TRAIN_SUBDIR / STATE_FILE).is_file() or not (out / "config.json").is_file():
        return cfg
    return dflash_choices_of(out, cfg, "--resume")


def eagle3_choices_of(folder: Path, cfg: Eagle3TrainConfig) -> Eagle3TrainConfig:
    """``cfg`` with the target layers the EAGLE-3 drafter in ``folder`` reads (explicit ones must agree)."""
    saved = Eagle3Config.from_dict(read_config(folder)).aux_layer_ids
    given = list(cfg.aux_layer_ids) if cfg.aux_layer_ids is not None else None
    if saved is None:
        return cfg
    if given is not None and given != saved:
        raise ValueError(f"--init-from: the EAGLE-3 drafter in {folder} reads layers {saved}, not {given}")
    return replace(cfg, aux_layer_ids=saved)


def init_source(request: TrainRequest, target_name: str) -> tuple[Path, str] | None:
    """The ``--init-from`` drafter folder and its kind (None without one). ``shipped`` names the drafter that ships
    for the target (sglang_tts/drafters/shipped). It must hold the one kind being trained."""
    if request.init_from is None:
        return None
    folder = Path(request.init_from)
    if str(request.init_from) == "shipped":
        found = shipped_drafter(target_name, request.kinds[0]) if len(request.kinds) == 1 else None
        if found is None:
            raise ValueError(f"--init-from shipped: no {'/'.join(request.kinds)} drafter ships for {target_name}")
        folder = found
    kind = kind_from_config(read_config(folder))
    if tuple(request.kinds) != (kind,):
        raise ValueError(f"--init-from {folder} holds a {kind} drafter: train --kind {kind} alone")
    return folder, kind


def train_drafters(request: TrainRequest) -> dict[str, KindResult]:
    """Build the data (cached), then train, evaluate and write each requested drafter kind."""
    unknown = set(request.kinds) - set(KINDS)
    if unknown or not request.kinds:
        raise ValueError(f"kinds must be among {KINDS}, got {request.kinds}")
    torch.manual_seed(request.seed)
    target_path = resolve_model(request.target, progress=request.progress)
    source = init_source(request, target_path.name)  # checked before hours of data generation
    data_dir = Path(request.cache_dir) if request.cache_dir is not None else cache_root() / "drafters" / "data"
    timings: dict[str, float] = {}

    began = time.monotonic()
    model, tokenizer, target = load_target(target_path)
    sequences = build_sequence_set(
        model, tokenizer, target_path, request.data, data_dir, request.progress, shipped_answers(target_path.name)
    )
    timings["generation_s"] = time.monotonic() - began
    # Held-out sequences come from the first source only: extra prompts (--extra-source) always train.
    first = {p.id for p in prompt_pool(replace(request.data, extra_source=None, extra_prompts=0))}
    among = sum(key in first for key in sequences.keys)  # the first source's sequences come first
    train_idx, held_idx = sequences.split_indices(request.eval_sequences, request.seed, among)
    windows = sequences.windowed(request.train_context)
    train_set, held_set = windows.subset(train_idx), windows.subset(held_idx)
    pool = prompt_pool(request.data)  # the prompts behind the sequences, for the split files
    logger.info(
        "training set: %d sequences (%d answer tokens), held out: %d",
        len(train_set),
        train_set.num_answer_tokens(),
        len(held_set),
    )

    # --init-from: the kind's choices (draft vocabulary, MASK id, layers) and weights come from that drafter,
    # unless a saved state is resumed (it already descends from it).
    resuming = {
        kind: request.resume
        and training_state_step(output_dir(request, target_path.name, kind) / TRAIN_SUBDIR) is not None
        for kind in request.kinds
    }
    init_folder, init = source if source is not None and not resuming[source[1]] else (None, None)
    init_tensors = load_checkpoint_tensors(init_folder) if init is not None else {}
    drafters: dict[str, tuple[torch.nn.Module, dict[str, Any]]] = {}
    if "eagle3" in request.kinds:
        used = saved_draft_vocab(output_dir(request, target_path.name, "eagle3") / TRAIN_SUBDIR, request.resume)
        if used is None and init == "eagle3":
            used = draft_vocab_of(init_tensors["d2t"])
        if used is None:
            used = frequency_draft_vocab(train_set, target.vocab_size, request.eagle3.draft_vocab_size)
        eagle3_cfg = request.eagle3
        if init == "eagle3":
            eagle3_cfg = eagle3_choices_of(init_folder, eagle3_cfg)
        drafters["eagle3"] = build_eagle3(target, eagle3_cfg, used, request.seed)
    if "dflash" in request.kinds:
        dflash_cfg = saved_dflash_choices(
            output_dir(request, target_path.name, "dflash"), request.dflash, request.resume
        )
        if init == "dflash":
            dflash_cfg = dflash_choices_of(init_folder, dflash_cfg, "--init-from")
        mask_id = dflash_cfg.mask_token_id
        if mask_id is None:
            mask_id = pick_mask_token_id(tokenizer, sequences, target.vocab_size)
        drafters["dflash"] = build_dflash(target, dflash_cfg, mask_id, request.seed)
    if init is not None:
        drafter = drafters[init][0]
        ignored = drafter.load_checkpoint_weights(init_tensors)  # copied in as fp32
        logger.info("%s drafter initialised from %s (ignored: %s)", init, init_folder, ignored or "none")
    layer_ids = sorted(
        {
            i
            for d, _ in drafters.values()
            for i in (d.cfg.aux_layer_ids if d.kind == "eagle3" else d.cfg.target_layer_ids)
        }
    )

    began = time.monotonic()
    features = compute_features(
        model, target_path, sequences, layer_ids, data_dir, request.progress, context=request.train_context
    )
    timings["features_s"] = time.monotonic() - began
    del model  # only its (borrowed) embedding / LM head / norm tensors are needed from here on
    train_feats, held_feats = features.subset(train_idx), features.subset(held_idx)

    results: dict[str, KindResult] = {}
    for kind, (drafter, config) in drafters.items():
        out = output_dir(request, target_path.name, kind)
        state_dir = out / TRAIN_SUBDIR
        for name, subset in (("held_in", train_set), ("held_out", held_set)):
            write_prompt_split(state_dir / f"{name}.jsonl", pool, subset.keys)
        if kind == "eagle3":
            cfg = request.eagle3
            objective = Eagle3Objective(drafter, cfg, train_set, train_feats, target, request.seed)
            evaluate = lambda obj=objective: evaluate_eagle3(obj, held_set, held_feats)
        else:
            cfg = request.dflash
            objective = DFlashObjective(drafter, cfg, train_set, train_feats, request.seed)
            evaluate = lambda obj=objective: evaluate_dflash(obj, held_set, held_feats)
        steps = num_steps(request, len(train_set), cfg.batch_size)
        eval_before = evaluate() if held_set.ids and not resuming[kind] else None

        began = time.monotonic()
        loop = LoopConfig(
            steps=steps,
            save_every=request.save_every,
            log_every=request.log_every,
            time_budget_s=request.time_budget_s,
            stop_after=request.stop_after,
            progress=request.progress,
        )
        result = train_loop(
            drafter,
            objective,
            request.optim,
            loop,
            state_dir,
            lambda step, d=drafter, c=config, o=out: write_drafter(o, d, c),
            resume=request.resume,
            desc=f"{kind}",
        )
        seconds = time.monotonic() - began
        eval_after = evaluate() if held_set.ids else {}
        results[kind] = KindResult(
            kind, out, result.start_step, result.step, result.finished, result.history, eval_before, eval_after, seconds
        )
        summary = {
            "kind": kind,
            "target": str(target_path),
            "checkpoint": str(out),
            "steps": {"planned": steps, "done": result.step, "resumed_from": result.start_step},
            "init_from": init_folder.name if kind == init else None,
            "eval_before": eval_before,
            "eval_after": eval_after,
            "last_train_record": result.history[-1] if result.history else None,
            "timings_s": {**timings, "training_s": seconds},
            "data": {**sequences.meta, "train_sequences": len(train_set), "held_out": len(held_set)},
            "request": {k: v for k, v in asdict(request).items() if k not in ("data",)},
        }
        (state_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        logger.info("%s drafter written to %s (eval after: %s)", kind, out, eval_after)
    return results
