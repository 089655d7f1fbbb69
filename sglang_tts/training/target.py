"""The target model side of drafter training: loading it, and its hidden states on the training set.

Layer ids are *output-of-layer* ids, the convention of the drafter configs
(``eagle_aux_hidden_state_layer_ids``, ``dflash_config.target_layer_ids``): id i is the output of
decoder layer i, which is what SGLang captures as the input of layer i + 1, and what transformers
returns as ``hidden_states[i + 1]`` with ``output_hidden_states=True`` (id -1: the embeddings).

Why cache rather than recompute in the training loop: on a 2-core CPU one target forward over a
~350-token sequence costs about as much as a whole drafter training step, and training runs
several epochs over a few hundred sequences, so the features are computed once and stored with
``torch.save``: per token the requested layers plus the final (normed) hidden state, from which
the teacher logits are recomputed on the fly through the target's LM head (storing logits would
cost V floats per token), plus the target's top-1 id. The cache is keyed by target, sequence set
and layer ids, written incrementally, and resumes like the sequence set.

Long prompts (the long-context workload's 1-6.5K-token files) are read whole by the target, but
only a window is stored and trained on: at most `context` prompt tokens before each answer
(``SequenceSet.windowed``), as public EAGLE-3 recipes train on windows of about 2K tokens. That
bounds the cache (4 floats x (K + 1) x H per stored token) and a training step, whose attention
grows with the square of the window.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from sglang_tts.training.data import SequenceSet, atomic_save, fingerprint, target_identity

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclass
class TargetWeights:
    """The target tensors the drafters borrow or start from (all frozen, fp32)."""

    path: Path
    config: dict[str, Any]
    embedding: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H] (the embedding when tied)
    final_norm: torch.Tensor  # [H] weight of the target's last RMSNorm

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])


def load_target(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, TargetWeights]:
    """The target as a transformers causal LM (fp32, eval mode), its tokenizer, and its weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer, target_weights(model, path)


@dataclass
class OfflineModels:
    """A target and a drafter for it, as the offline scripts use them (fp32, eval mode)."""

    target_path: Path
    model: PreTrainedModel  # the target as a transformers causal LM
    target: TargetWeights
    drafter: Any  # Eagle3Drafter or DFlashDrafter (drafters/loading.py)
    drafter_path: Path


def load_target_and_drafter(model: str, drafter: str | None = None, kind: type | None = None) -> OfflineModels:
    """The target (a model name the cache knows, or a folder) as `load_target` gives it, and a drafter
    for it: the folder `drafter`, by default the one shipped for the model. ValueError when none ships,
    or when the drafter is not a `kind` (e.g. Eagle3Drafter)."""
    from sglang_tts.assets import resolve_model
    from sglang_tts.drafters.loading import load_drafter
    from sglang_tts.drafters.shipped import shipped_drafter

    target_path = Path(resolve_model(model))
    drafter_path = Path(drafter) if drafter else shipped_drafter(target_path.name)
    if drafter_path is None:
        raise ValueError(f"no drafter ships for {target_path.name}: give one with --drafter")
    lm, _, weights = load_target(target_path)
    loaded = load_drafter(drafter_path, target_embedding=weights.embedding.float(), target_config=weights.config)
    if kind is not None and not isinstance(loaded, kind):
        raise ValueError(f"{drafter_path} is not a {kind.__name__}")
    return OfflineModels(target_path, lm, weights, loaded.eval(), drafter_path)


def target_weights(model: PreTrainedModel, path: Path) -> TargetWeights:
    hidden = int(model.config.hidden_size)
    norm = getattr(getattr(model, "model", None), "norm", None)
    final_norm = norm.weight.detach().clone() if norm is not None else torch.ones(hidden)
    return TargetWeights(
        path=path,
        config=json.loads((path / "config.json").read_text()),
        embedding=model.get_input_embeddings().weight.detach(),
        lm_head=model.get_output_embeddings().weight.detach(),
        final_norm=final_norm,
    )


@dataclass
class TargetFeatures:
    """Per sequence: hidden [L, K, H] of `layer_ids` (in that order), final [L, H] (post-norm, the
    LM head's input) and top1 [L] (the target's argmax after each token)."""

    layer_ids: list[int]
    hidden: list[torch.Tensor]
    final: list[torch.Tensor]
    top1: list[torch.Tensor]

    def subset(self, indices: list[int]) -> TargetFeatures:
        return TargetFeatures(
            self.layer_ids,
            [self.hidden[i] for i in indices],
            [self.final[i] for i in indices],
            [self.top1[i] for i in indices],
        )

    def layers(self, wanted: list[int]) -> list[int]:
        """Indices into the K axis for `wanted` layer ids."""
        missing = [i for i in wanted if i not in self.layer_ids]
        if missing:
            raise ValueError(f"layers {missing} were not captured (have {self.layer_ids})")
        return [self.layer_ids.index(i) for i in wanted]


@torch.no_grad()
def sequence_features(
    model: PreTrainedModel, ids: torch.Tensor, layer_ids: list[int], start: int = 0
) -> dict[str, torch.Tensor]:
    """One full-sequence forward: the captured layers, the final hidden state and the top-1 ids of
    the positions from `start` on (logits are computed for those positions only)."""
    out = model(input_ids=ids[None], output_hidden_states=True, logits_to_keep=len(ids) - start)
    states = out.hidden_states
    return {
        "hidden": torch.stack([states[i + 1][0, start:] for i in layer_ids], dim=1).contiguous(),
        "final": states[-1][0, start:].contiguous(),
        "top1": out.logits[0].argmax(-1),
    }


def sequences_fingerprint(keys: list[str], ids: list[torch.Tensor]) -> str:
    """What a feature file's ``sequences`` entry names: the keys and token ids of the set it was computed for."""
    return fingerprint({"keys": keys, "ids": [row.tolist() for row in ids]})


def reuse_features(
    cache_dir: Path,
    target_name: str,
    meta: dict[str, Any],
    sequences: SequenceSet,
    starts: list[int],
    first: int = 0,
) -> dict[int, dict[str, torch.Tensor]]:
    """Features other cached feature files of the same target and layers already hold for ``sequences``:
    index -> features of a sequence with the same key, the same ids and the same window start. The sequences
    behind a feature file are found through the sequence caches beside it (its ``sequences`` fingerprint), so a
    training set that extends an older one computes only the new sequences. Only indices from ``first`` on are
    looked for (those before it are already in this set's own file)."""
    wanted = {
        (key, int(start)): index for index, (key, start) in enumerate(zip(sequences.keys, starts)) if index >= first
    }
    known: dict[str, tuple[list[str], list[torch.Tensor]]] = {}
    for path in cache_dir.glob(f"{target_name}-seqs-*.pt"):
        saved = torch.load(path, map_location="cpu", weights_only=True)
        known[sequences_fingerprint(saved["keys"], saved["ids"])] = (saved["keys"], saved["ids"])
    found: dict[int, dict[str, torch.Tensor]] = {}
    for path in sorted(cache_dir.glob(f"{target_name}-feats-*.pt")):
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        other = payload["meta"]
        if other.get("target") != meta["target"] or other.get("layer_ids") != meta["layer_ids"]:
            continue
        if other.get("sequences") not in known:
            continue
        keys, ids = known[other["sequences"]]
        other_starts = other.get("window_starts") or [0] * len(keys)
        feats = payload["features"]
        for j in range(len(feats["top1"])):
            index = wanted.get((keys[j], int(other_starts[j])))
            if index is None or index in found or not torch.equal(ids[j], sequences.ids[index]):
                continue
            found[index] = {name: feats[name][j].clone() for name in ("hidden", "final", "top1")}
    return found


def compute_features(
    model: PreTrainedModel,
    target_path: Path,
    sequences: SequenceSet,
    layer_ids: list[int],
    cache_dir: Path,
    progress: bool = True,
    save_every: int = 32,
    context: int | None = None,
) -> TargetFeatures:
    """Target features of every sequence (cached, resumable; see the module docstring), of the
    positions of its training window (`sequences.windowed(context)` holds the matching ids)."""
    layer_ids = sorted(set(layer_ids))
    n_layers = int(model.config.num_hidden_layers)
    bad = [i for i in layer_ids if not -1 <= i <= n_layers - 2]
    if bad:
        raise ValueError(
            f"layer ids {bad} are not capturable on a {n_layers}-layer target (range [-1, {n_layers - 2}])"
        )
    meta = {
        "target": target_identity(target_path),
        "sequences": sequences_fingerprint(sequences.keys, sequences.ids),
        "layer_ids": layer_ids,
    }
    starts = sequences.window_starts(context)
    if any(starts):  # a window that cuts nothing leaves the cache key as it was
        meta["window_starts"] = starts
    cache_file = cache_dir / f"{target_path.name}-feats-{fingerprint(meta)}.pt"
    saved: dict[str, list[torch.Tensor]] = {"hidden": [], "final": [], "top1": []}
    if cache_file.is_file():
        saved = torch.load(cache_file, map_location="cpu", weights_only=True)["features"]
        logger.info("loaded features of %d sequences from %s", len(saved["top1"]), cache_file)

    model.eval()
    start = len(saved["top1"])
    reusable = (
        reuse_features(cache_dir, target_path.name, meta, sequences, starts, start) if start < len(sequences) else {}
    )
    if reusable:
        logger.info("reusing the features of %d sequences from other cached sets of this target", len(reusable))
    bar = tqdm(total=len(sequences), initial=start, desc="target features", unit="seq", disable=not progress)
    for index in range(start, len(sequences)):
        feats = reusable.pop(index, None) or sequence_features(model, sequences.ids[index], layer_ids, starts[index])
        for key in saved:
            saved[key].append(feats[key])
        bar.update(1)
        if (index + 1) % save_every == 0 or index + 1 == len(sequences):
            atomic_save({"meta": meta, "features": saved}, cache_file)
    bar.close()
    return TargetFeatures(layer_ids, saved["hidden"], saved["final"], saved["top1"])


@dataclass
class Batch:
    """Right-padded sequences and their target features."""

    ids: torch.Tensor  # [B, L] int64, 0 where padded
    real: torch.Tensor  # [B, L] bool: a real token
    answer: torch.Tensor  # [B, L] bool: a token of the greedy answer (what drafters learn to predict)
    hidden: torch.Tensor  # [B, L, K, H] captured layers (TargetFeatures.layer_ids order)
    final: torch.Tensor  # [B, L, H]
    top1: torch.Tensor  # [B, L] int64

    @property
    def lengths(self) -> torch.Tensor:
        return self.real.sum(1)


def collate(sequences: SequenceSet, features: TargetFeatures, indices: list[int]) -> Batch:
    """Batch the given sequences, right padded to the longest."""
    width = max(len(sequences.ids[i]) for i in indices)
    b = len(indices)
    k, h = features.hidden[indices[0]].shape[1:]
    batch = Batch(
        ids=torch.zeros(b, width, dtype=torch.long),
        real=torch.zeros(b, width, dtype=torch.bool),
        answer=torch.zeros(b, width, dtype=torch.bool),
        hidden=torch.zeros(b, width, k, h),
        final=torch.zeros(b, width, h),
        top1=torch.zeros(b, width, dtype=torch.long),
    )
    for row, i in enumerate(indices):
        n = len(sequences.ids[i])
        batch.ids[row, :n] = sequences.ids[i]
        batch.real[row, :n] = True
        batch.answer[row, sequences.prompt_lens[i] : n] = True
        batch.hidden[row, :n] = features.hidden[i]
        batch.final[row, :n] = features.final[i]
        batch.top1[row, :n] = features.top1[i]
    return batch


def batch_indices(num_items: int, batch_size: int, step: int, seed: int) -> list[int]:
    """The items of training step `step`: consecutive slices of per-epoch seeded permutations, so
    any step's batch is known without replaying the earlier ones (exact resume)."""
    if num_items <= 0:
        raise ValueError("no training sequences")
    out = []
    for flat in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(flat, num_items)
        perm = torch.randperm(num_items, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(perm[offset]))
    return out


def cached_greedy_answers(
    model: PreTrainedModel, prompts: Sequence[Any], max_new_tokens: int, cache: Path
) -> dict[str, tuple[list[int], list[int]]]:
    """The target's greedy answer to each prompt (objects with ``id`` and ``input_ids``, e.g. the
    bench's chat prompts), generated once and cached in ``cache`` (``torch.save``; written after
    each prompt, so a stop loses at most the answer being generated): id -> (prompt ids, answer ids)."""
    return cached_answers(model, prompts, max_new_tokens, cache)


def cached_answers(
    model: PreTrainedModel,
    prompts: Sequence[Any],
    max_new_tokens: int,
    cache: Path,
    temperature: float = 0.0,
    seed: int = 0,
) -> dict[str, tuple[list[int], list[int]]]:
    """`cached_greedy_answers`, or with `temperature` > 0 one answer sampled at that temperature (top_p 1)
    per prompt, seeded by `seed` and the prompt's position in `prompts` (name `cache` after both: a cached
    answer is returned whatever the arguments)."""
    done = torch.load(cache) if cache.exists() else {}
    for i, p in enumerate(tqdm(prompts, desc="target answers", unit="prompt")):
        if p.id in done:
            continue
        ids = torch.tensor([p.input_ids])
        sampling: dict[str, Any] = {"do_sample": False}
        if temperature > 0:
            torch.manual_seed(seed * 1_000_003 + i)
            sampling = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **sampling)
        done[p.id] = (list(p.input_ids), out[0, ids.shape[1] :].tolist())
        atomic_save(done, cache)
    return done
