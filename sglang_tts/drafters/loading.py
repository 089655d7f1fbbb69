"""Load public EAGLE-3 / DFlash drafter checkpoints into the differentiable drafters.

A checkpoint directory holds `config.json` and one of `model.safetensors`,
`model.safetensors.index.json` (+ shards), `pytorch_model.bin`, `pytorch_model.bin.index.json`
(+ shards); DFlash may add `mask_embedding.pt`. The kind is read from `architectures`
(EAGLE-3: LlamaForCausalLMEagle3 -- what SGLang registers -- or AngelSlim's
Eagle3LlamaForCausalLM; DFlash: DFlashDraftModel) or, failing that, the presence of
`dflash_config`.

`check_compatible` applies the constraints SGLang 0.5.23 relies on when it pairs a drafter with a
target, naming the one that fails. Capture ids: SGLang captures target hidden states "before
layer id + 1" (models/llama.py:set_eagle3_layers_to_capture / set_dflash_layers_to_capture), so an
output-of-layer id must lie in [-1, N - 2] (DFlash: [0, N - 2]); captures are concatenated in
layer order and a repeated layer is captured once, so ids must be strictly increasing.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Literal

import torch

from sglang_tts.drafters.common import (
    CheckpointTensorError,
    IncompatibleDrafterError,
    UnsupportedDrafterConfigError,
    text_config,
)
from sglang_tts.drafters.dflash import DFLASH_ARCHITECTURES, DFlashConfig, DFlashDrafter, build_target_layer_ids
from sglang_tts.drafters.eagle3 import EAGLE3_ARCHITECTURES, Eagle3Config, Eagle3Drafter

logger = logging.getLogger(__name__)

DrafterKind = Literal["eagle3", "dflash"]

__all__ = [
    "IncompatibleDrafterError",
    "check_checkpoint",
    "check_compatible",
    "drafter_kind",
    "kind_from_config",
    "load_checkpoint_tensors",
    "load_drafter",
    "load_target_embedding_and_head",
    "read_config",
]


def read_config(path: str | Path) -> dict[str, Any]:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    return json.loads(config_file.read_text())


def kind_from_config(cfg: dict[str, Any]) -> DrafterKind:
    architectures = cfg.get("architectures") or []
    if any(a in EAGLE3_ARCHITECTURES for a in architectures):
        return "eagle3"
    if any(a in DFLASH_ARCHITECTURES for a in architectures) or "dflash_config" in cfg:
        return "dflash"
    raise IncompatibleDrafterError(
        f"unknown drafter architecture {architectures}: expected one of "
        f"{list(EAGLE3_ARCHITECTURES) + list(DFLASH_ARCHITECTURES)} (or a config with dflash_config)"
    )


def drafter_kind(path: str | Path) -> DrafterKind:
    """ "eagle3" or "dflash" for a checkpoint directory."""
    return kind_from_config(read_config(path))


# ----------------------------------------------------------------------------- tensors on disk


def _weight_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint directory, safetensors preferred (as SGLang's loader)."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [_shard_inside(path, index, shard) for shard in shards]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (path / single).is_file():
            return [path / single]
    raise FileNotFoundError(f"no model.safetensors / pytorch_model.bin (or index) in {path}")


def _shard_inside(path: Path, index: Path, shard: str) -> Path:
    """The shard file an index names, refused unless its name stays inside the checkpoint directory
    (an absolute name or `..` would read tensor files from anywhere). The check is on the name, not
    the resolved file: Hugging Face's cache keeps shards as symlinks into its blob store."""
    parts = Path(os.path.normpath(shard)).parts
    if not shard or Path(shard).is_absolute() or not parts or parts[0] == ".." or "\x00" in shard:
        raise ValueError(f"{index}: shard {shard!r} lies outside the checkpoint directory {path}; refusing to read it")
    return path / shard


def _read_file(file: Path, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(file), framework="pt", device="cpu") as f:
            stored = list(f.keys())
            return {k: f.get_tensor(k) for k in stored if names is None or k in names}
    state = torch.load(file, map_location="cpu", weights_only=True)
    return {k: v for k, v in state.items() if names is None or k in names}


def load_checkpoint_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (single file or sharded)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in _weight_files(Path(path)):
        tensors.update(_read_file(file))
    return tensors


_EMBED_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight", "model.language_model.embed_tokens.weight")
_LM_HEAD_NAMES = ("lm_head.weight", "model.lm_head.weight")


def load_target_embedding_and_head(target_path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and LM head weights [V, H] (the head is the embedding when
    the target ties them), reading only those tensors."""
    path = Path(target_path)
    wanted = set(_EMBED_NAMES + _LM_HEAD_NAMES)
    found: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        found.update(_read_file(file, wanted))
    embedding = next((found[n] for n in _EMBED_NAMES if n in found), None)
    if embedding is None:
        raise ValueError(f"target checkpoint {path} has no embed_tokens weight")
    lm_head = next((found[n] for n in _LM_HEAD_NAMES if n in found), None)
    if lm_head is None:
        if not text_config(read_config(path)).get("tie_word_embeddings", read_config(path).get("tie_word_embeddings")):
            raise ValueError(f"target checkpoint {path} has no lm_head weight and does not tie embeddings")
        lm_head = embedding
    return embedding, lm_head


# ----------------------------------------------------------------------------- compatibility


def _target_shape(target: dict[str, Any]) -> tuple[int, int, int]:
    return int(target["hidden_size"]), int(target["vocab_size"]), int(target["num_hidden_layers"])


def _check_eagle3(cfg: dict[str, Any], target: dict[str, Any]) -> None:
    t_hidden, t_vocab, t_layers = _target_shape(target)
    expects = int(cfg.get("target_hidden_size") or cfg["hidden_size"])
    if expects != t_hidden:
        raise IncompatibleDrafterError(
            f"hidden size mismatch: the EAGLE-3 drafter's fc expects target hidden size {expects} "
            f"(target_hidden_size or hidden_size), the target has hidden_size {t_hidden}"
        )
    if int(cfg["vocab_size"]) != t_vocab:
        raise IncompatibleDrafterError(
            f"vocab mismatch: EAGLE-3 drafter vocab_size {cfg['vocab_size']} != target vocab_size {t_vocab}"
        )
    draft_vocab = cfg.get("draft_vocab_size")
    if draft_vocab is not None and int(draft_vocab) > t_vocab:
        raise IncompatibleDrafterError(f"draft_vocab_size {draft_vocab} exceeds the target vocab_size {t_vocab}")
    eagle_config = cfg.get("eagle_config") or {}
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    num_aux = cfg.get("num_aux_hidden_states")
    if ids:
        num_aux = len(ids) if num_aux is None else int(num_aux)
        bad = [i for i in ids if not -1 <= int(i) <= t_layers - 2]
        if bad:
            raise IncompatibleDrafterError(
                f"target layer ids out of range: eagle_aux_hidden_state_layer_ids {bad} not in [-1, {t_layers - 2}] "
                f"for a {t_layers}-layer target (SGLang captures the input of layer id + 1)"
            )
        if list(ids) != sorted(set(ids)):
            raise IncompatibleDrafterError(
                f"eagle_aux_hidden_state_layer_ids {ids} must be strictly increasing "
                "(SGLang concatenates captures in layer order and captures a repeated layer once)"
            )
        if len(ids) != num_aux:
            raise IncompatibleDrafterError(f"{len(ids)} aux layer ids but num_aux_hidden_states = {num_aux}")
    else:
        num_aux = 3 if num_aux is None else int(num_aux)
        # models/llama.py:set_eagle3_layers_to_capture default (input-of-layer indices).
        default = [2, t_layers // 2, t_layers - 3]
        if num_aux != 3 or default != sorted(set(default)) or not all(0 <= i < t_layers for i in default):
            raise IncompatibleDrafterError(
                f"target layer ids out of range: SGLang's default EAGLE-3 capture {default} (inputs of layers) "
                f"does not give {num_aux} distinct layers of a {t_layers}-layer target; set "
                "eagle_config.eagle_aux_hidden_state_layer_ids"
            )


def _check_dflash(cfg: dict[str, Any], target: dict[str, Any]) -> None:
    t_hidden, t_vocab, t_layers = _target_shape(target)
    text = text_config(cfg)
    if int(text["hidden_size"]) != t_hidden:
        raise IncompatibleDrafterError(
            f"hidden size mismatch: DFlash drafter hidden_size {text['hidden_size']} != target hidden_size {t_hidden} "
            "(DFlash shares the target's embedding and LM head and projects its features with hidden-size chunks)"
        )
    if int(text["vocab_size"]) != t_vocab:
        raise IncompatibleDrafterError(
            f"vocab mismatch: DFlash drafter vocab_size {text['vocab_size']} != target vocab_size {t_vocab}"
        )
    dflash = cfg.get("dflash_config") or {}
    ids = dflash.get("target_layer_ids", cfg.get("target_layer_ids"))
    if ids is None:
        ids = build_target_layer_ids(t_layers, int(text["num_hidden_layers"]))
    bad = [i for i in ids if not 0 <= int(i) <= t_layers - 2]
    if bad:
        raise IncompatibleDrafterError(
            f"target layer ids out of range: DFlash target_layer_ids {bad} not in [0, {t_layers - 2}] for a "
            f"{t_layers}-layer target (SGLang captures the input of layer id + 1)"
        )
    if list(ids) != sorted(set(ids)):
        raise IncompatibleDrafterError(f"DFlash target_layer_ids {ids} must be strictly increasing")
    mask_id = dflash.get("mask_token_id", cfg.get("mask_token_id"))
    if mask_id is not None and not 0 <= int(mask_id) < t_vocab:
        raise IncompatibleDrafterError(
            f"vocab mismatch: DFlash mask_token_id {mask_id} outside the target vocab (size {t_vocab})"
        )


def check_compatible(drafter_config: dict[str, Any], target_config: dict[str, Any]) -> None:
    """Raise IncompatibleDrafterError naming the first reason the pair cannot run in SGLang."""
    target = text_config(target_config)
    kind = kind_from_config(drafter_config)
    if kind == "eagle3":
        _check_eagle3(drafter_config, target)
    else:
        _check_dflash(drafter_config, target)


# ----------------------------------------------------------------------------- loading


def _build_drafter(
    cfg: dict[str, Any], kind: DrafterKind, target_text: dict[str, Any]
) -> tuple[Eagle3Drafter | DFlashDrafter, bool, bool]:
    """The drafter a config describes (weights uninitialised), and whether it borrows the target's
    embedding and LM head."""
    if kind == "eagle3":
        e3 = Eagle3Config.from_dict(cfg)
        return Eagle3Drafter(e3), not e3.own_embedding, e3.lm_head_from_target
    depth = target_text.get("num_hidden_layers")
    dcfg = DFlashConfig.from_dict(cfg, target_num_layers=int(depth) if depth is not None else None)
    if dcfg.mask_token_id is None:
        raise UnsupportedDrafterConfigError(
            "DFlash config has no mask_token_id (SGLang would resolve it through the tokenizer); "
            "set dflash_config.mask_token_id"
        )
    return DFlashDrafter(dcfg), True, True


def _stored_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a weight file's tensors, read from its header (safetensors) or memory-mapped
    onto the meta device (torch files): no tensor data is read."""
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(file), framework="pt", device="cpu") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    state = torch.load(file, map_location="meta", weights_only=True, mmap=True)
    return {k: tuple(v.shape) for k, v in state.items()}


def check_checkpoint(path: str | Path, target_config: dict[str, Any] | None = None) -> None:
    """The launch check of a drafter checkpoint's tensors, reading headers only: every weight file
    opens (a truncated or corrupt one is named), and every tensor the drafter needs is there with its
    shape (the same rules as loading: `checkpoint_plan` on a meta-device drafter). Raises ValueError
    naming the file and the tensor."""
    path = Path(path)
    cfg = read_config(path)
    target_text = text_config(target_config) if target_config is not None else {}
    with torch.device("meta"):
        drafter = _build_drafter(cfg, kind_from_config(cfg), target_text)[0]
    files = _weight_files(path)
    shapes: dict[str, tuple[int, ...]] = {}
    origin: dict[str, Path] = {}
    for file in files:
        try:
            stored = _stored_shapes(file)
        except Exception as exc:  # safetensors / zip errors: torn, truncated, not a weight file
            raise ValueError(f"drafter weight file {file} cannot be read (truncated or corrupt?): {exc}") from None
        shapes.update(stored)
        origin.update(dict.fromkeys(stored, file))
    try:
        drafter.checkpoint_plan(shapes)
    except CheckpointTensorError as exc:
        where = origin[exc.tensor] if exc.tensor in origin else ", ".join(str(f) for f in files)
        raise ValueError(f"drafter checkpoint {where}: {exc}") from None
    mask_file = path / "mask_embedding.pt"
    if isinstance(drafter, DFlashDrafter) and mask_file.is_file():
        try:
            torch.load(mask_file, map_location="meta", weights_only=True, mmap=True)
        except Exception as exc:
            raise ValueError(f"{mask_file} cannot be read (truncated or corrupt?): {exc}") from None


def load_drafter(
    path: str | Path,
    target_embedding: torch.Tensor | None = None,
    target_lm_head: torch.Tensor | None = None,
    target_config: dict[str, Any] | None = None,
    *,
    target_path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Eagle3Drafter | DFlashDrafter:
    """Build the differentiable drafter of a checkpoint directory.

    The borrowed embedding / LM head are taken from the arguments, else from `target_path`'s
    weights; they are kept as given (no copy, frozen). `target_config` (or `target_path`'s
    config.json) enables `check_compatible` and lets DFlash resolve default layer ids against the
    runtime target depth. Trainable weights are cast to `dtype`.
    """
    path = Path(path)
    cfg = read_config(path)
    kind = kind_from_config(cfg)
    if target_config is None and target_path is not None:
        target_config = read_config(target_path)
    if target_config is not None:
        check_compatible(cfg, target_config)
    target_text = text_config(target_config) if target_config is not None else {}
    drafter, need_embedding, need_head = _build_drafter(cfg, kind, target_text)

    if target_path is not None and (
        (need_embedding and target_embedding is None) or (need_head and target_lm_head is None)
    ):
        loaded_embedding, loaded_head = load_target_embedding_and_head(target_path)
        target_embedding = target_embedding if target_embedding is not None else loaded_embedding
        target_lm_head = target_lm_head if target_lm_head is not None else loaded_head
    if need_head and target_lm_head is None and target_embedding is not None and target_text.get("tie_word_embeddings"):
        target_lm_head = target_embedding
    if need_embedding and target_embedding is None:
        raise ValueError(f"{kind} drafter needs the target embedding: pass target_embedding or target_path")
    if need_head and target_lm_head is None:
        raise ValueError(f"{kind} drafter needs the target LM head: pass target_lm_head or target_path")

    ignored = drafter.load_checkpoint_weights(load_checkpoint_tensors(path))
    if ignored:
        logger.info("drafter checkpoint %s: ignored tensors %s", path, ignored)
    drafter.to(device=device, dtype=dtype)
    if device is not None:
        target_embedding = target_embedding.to(device) if target_embedding is not None else None
        target_lm_head = target_lm_head.to(device) if target_lm_head is not None else None
    drafter.attach_target(target_embedding if need_embedding else None, target_lm_head if need_head else None)

    mask_file = path / "mask_embedding.pt"
    if isinstance(drafter, DFlashDrafter) and mask_file.is_file():
        saved = torch.load(mask_file, map_location="cpu", weights_only=True)
        if saved.get("per_position"):
            raise UnsupportedDrafterConfigError("per-position DFlash mask embeddings are not supported (nor by SGLang)")
        drafter.set_mask_embedding(saved["embedding"].to(device=device), int(saved["mask_token_id"]))
    return drafter
