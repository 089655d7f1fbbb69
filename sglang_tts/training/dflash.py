"""DFlash drafter training (DFlash / SpecForge block recipe, on short sequences).

- Features: the concat of ``num_target_features`` target layers (output-of-layer ids), spaced as
  SGLang/SpecForge space them (``build_target_layer_ids``: 1 .. N - 3) and written to
  ``dflash_config.target_layer_ids``; targets too shallow for that spacing use
  ``default_dflash_target_layer_ids``. Explicit ids (``target_layer_ids``) may choose others, e.g. the
  EAGLE-3 drafter's capture, so that both kinds train from one cached feature file.
- Blocks: each step samples up to ``num_anchors`` anchors a per sequence (without replacement)
  among positions whose next token is an answer token. Block = ``[x_a, MASK * (block_size - 1)]``
  at positions a .. a + block_size - 1; it sees the target features of every token before a
  (what SGLang's draft cache holds when the block runs) and all of its own slots.
  ``DFlashDrafter.anchored_block_hidden`` runs all blocks of a batch at once, the context K/V
  computed once per sequence.
- Loss: slot k (1 .. block_size - 1) predicts the token at a + k through the target's (frozen) LM
  head; hard cross-entropy against that token (the target's own greedy token, so this is the
  target's top-1 on answer positions), weighted w_k = exp(-(k - 1) / gamma) and averaged with those
  weights over labelled slots (slots beyond the answer are dropped). gamma defaults to the DFlash
  setting for the block size: 7 for 16, 5 for 10, 4 for 8 (else 7 * block_size / 16). The LM head
  and the cross-entropy run fused (``linear_ce.LinearCrossEntropy``: one logits buffer kept across
  steps, no [N, V] tensor allocated per step).
- Mask token: an unused special token of the tokenizer (highest id among special tokens that never
  occur in the training set and are not bos/eos/pad/unk), else the highest id never seen; written
  to ``dflash_config.mask_token_id``. Its embedding is the target's row (no mask_embedding.pt).
- Initialisation: layers N(0, 0.02), norms 1, the final norm copied from the target's (the output
  feeds the target's LM head). Embedding and LM head are the target's, frozen (buffers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sglang_tts.drafters.checkpoints import default_dflash_target_layer_ids, dflash_config
from sglang_tts.drafters.dflash import DFlashConfig, DFlashDrafter, build_target_layer_ids
from sglang_tts.training.data import SequenceSet
from sglang_tts.training.linear_ce import LinearCrossEntropy
from sglang_tts.training.target import Batch, TargetFeatures, TargetWeights, batch_indices, collate
from sglang_tts.training.weights import init_weights_

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DFLASH_GAMMA_BY_BLOCK = {16: 7.0, 10: 5.0, 8: 4.0}


@dataclass
class DFlashTrainConfig:
    block_size: int = 8
    num_layers: int = 2
    num_target_features: int = 3
    target_layer_ids: list[int] | None = None  # None: num_target_features spaced over the target (module docstring)
    num_anchors: int = 32  # blocks per sequence per step
    loss_gamma: float | None = None  # None: DFLASH_GAMMA_BY_BLOCK / 7 * block_size / 16
    mask_token_id: int | None = None  # None: pick_mask_token_id
    batch_size: int = 4
    init_std: float = 0.02

    def gamma(self) -> float:
        if self.loss_gamma is not None:
            return float(self.loss_gamma)
        return DFLASH_GAMMA_BY_BLOCK.get(self.block_size, 7.0 * self.block_size / 16)


def capturable_layer_ids(ids: list[int], num_target_layers: int) -> bool:
    """Distinct increasing output-of-layer ids SGLang can capture for DFlash (0 .. N - 2)."""
    return ids == sorted(set(ids)) and all(0 <= i <= num_target_layers - 2 for i in ids)


def dflash_target_layer_ids(num_target_layers: int, count: int) -> list[int]:
    try:
        ids = build_target_layer_ids(num_target_layers, count)
    except ValueError:
        ids = []
    if len(ids) == count and capturable_layer_ids(ids, num_target_layers):
        return ids
    return default_dflash_target_layer_ids(num_target_layers, count)


def pick_mask_token_id(tokenizer: PreTrainedTokenizerBase, sequences: SequenceSet, vocab_size: int) -> int:
    """An id the drafter can use as MASK without colliding with real text (module docstring)."""
    seen = set(torch.unique(torch.cat(sequences.ids)).tolist())
    reserved = {getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")} - {None}
    specials = sorted(
        int(i) for i, tok in tokenizer.added_tokens_decoder.items() if getattr(tok, "special", False) and i < vocab_size
    )
    for candidate in reversed(specials):
        if candidate not in seen and candidate not in reserved:
            return candidate
    for candidate in range(vocab_size - 1, -1, -1):
        if candidate not in seen and candidate not in reserved:
            return candidate
    raise ValueError("every token id occurs in the training set: no id is free for DFlash's MASK")


def build_dflash(
    target: TargetWeights, cfg: DFlashTrainConfig, mask_token_id: int, seed: int
) -> tuple[DFlashDrafter, dict[str, Any]]:
    """A freshly initialised DFlash drafter for `target`, and its config."""
    if cfg.target_layer_ids is None:
        layer_ids = dflash_target_layer_ids(target.num_layers, cfg.num_target_features)
    else:
        layer_ids = [int(i) for i in cfg.target_layer_ids]
        if not capturable_layer_ids(layer_ids, target.num_layers):
            raise ValueError(
                f"DFlash target layers {layer_ids}: give distinct increasing output-of-layer ids "
                f"in 0..{target.num_layers - 2} (the target has {target.num_layers} layers)"
            )
    config = dflash_config(
        target.config,
        block_size=cfg.block_size,
        num_layers=cfg.num_layers,
        target_layer_ids=layer_ids,
        mask_token_id=mask_token_id,
    )
    dcfg = DFlashConfig.from_dict(config, target_num_layers=target.num_layers)
    drafter = DFlashDrafter(dcfg, target_embedding=target.embedding, target_lm_head=target.lm_head)
    init_weights_(drafter, seed, cfg.init_std)
    with torch.no_grad():
        drafter.norm.weight.copy_(target.final_norm)
    return drafter, config


def sample_anchors(batch: Batch, num_anchors: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors [B, A] (sorted; 0 where unused) and keep [B, A]: positions a >= 1 whose next token
    is an answer token, at most `num_anchors` per sequence, drawn without replacement."""
    b, length = batch.ids.shape
    anchors = torch.zeros(b, num_anchors, dtype=torch.long)
    keep = torch.zeros(b, num_anchors, dtype=torch.bool)
    for row in range(b):
        candidates = torch.nonzero(batch.answer[row, 2:]).flatten() + 1  # a in [1, L - 2], answer[a + 1]
        chosen = candidates[torch.randperm(candidates.numel(), generator=gen)[:num_anchors]].sort().values
        anchors[row, : chosen.numel()] = chosen
        keep[row, : chosen.numel()] = True
    return anchors, keep


@dataclass
class BlockOutput:
    hidden: torch.Tensor  # [N, D] for the labelled slots, before the LM head
    labels: torch.Tensor  # [N]
    slot: torch.Tensor  # [N] slot index k - 1 (0 .. block_size - 2)
    labelled: torch.Tensor  # [B, A, S - 1] bool


def block_forward(
    drafter: DFlashDrafter, batch: Batch, feature_index: list[int], anchors: torch.Tensor, keep: torch.Tensor
) -> BlockOutput:
    b, length = batch.ids.shape
    s = drafter.block_size
    blocks = drafter.block_ids_for(batch.ids.gather(1, anchors).flatten()).view(b, -1, s)
    positions = anchors[..., None] + torch.arange(s)
    features = batch.hidden[:, :, feature_index].flatten(2)
    context_positions = torch.arange(length).expand(b, length)
    hidden = drafter.anchored_block_hidden(blocks, positions, features, context_positions, batch.real)
    label_pos = positions[..., 1:]  # [B, A, S - 1]
    clamped = label_pos.clamp(max=length - 1).flatten(1)
    labels = batch.ids.gather(1, clamped).view_as(label_pos)
    labelled = keep[..., None] & (label_pos < length) & batch.answer.gather(1, clamped).view_as(label_pos)
    slot = torch.arange(s - 1).expand_as(label_pos)[labelled]
    return BlockOutput(hidden[:, :, 1:][labelled], labels[labelled], slot, labelled)


class DFlashObjective:
    """Step s -> (loss, metrics) for the training loop; see the module docstring."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        cfg: DFlashTrainConfig,
        sequences: SequenceSet,
        features: TargetFeatures,
        seed: int,
    ) -> None:
        self.drafter, self.cfg, self.sequences, self.features, self.seed = drafter, cfg, sequences, features, seed
        self.feature_index = features.layers(drafter.cfg.target_layer_ids)
        self.slot_weights = torch.exp(-torch.arange(cfg.block_size - 1, dtype=torch.float32) / cfg.gamma())
        self.head_loss = LinearCrossEntropy()  # the [N, V] logits live in one buffer kept across steps

    def weighted_ce(self, out: BlockOutput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slot-weighted mean cross-entropy, per-slot cross-entropy [N], greedy picks [N]) of a block pass."""
        weights = self.slot_weights[out.slot]
        return self.head_loss(out.hidden, self.drafter.lm_head_weight(), out.labels, weights)

    def loss(self, batch: Batch, gen: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        anchors, keep = sample_anchors(batch, self.cfg.num_anchors, gen)
        out = block_forward(self.drafter, batch, self.feature_index, anchors, keep)
        if out.labels.numel() == 0:
            return self.drafter.fc.weight.sum() * 0.0, {}
        loss, ce, picks = self.weighted_ce(out)
        hits = (picks == out.labels).float()
        metrics = {"ce": float(ce.mean())}
        for k in range(self.cfg.block_size - 1):
            in_slot = out.slot == k
            if in_slot.any():
                metrics[f"acc_{k + 1}"] = float(hits[in_slot].mean())
        return loss, metrics

    def __call__(self, step: int) -> tuple[torch.Tensor, dict[str, float]]:
        indices = batch_indices(len(self.sequences), self.cfg.batch_size, step, self.seed)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)  # step-determined: exact resume
        return self.loss(collate(self.sequences, self.features, indices), gen)


@torch.no_grad()
def evaluate_dflash(
    objective: DFlashObjective, sequences: SequenceSet, features: TargetFeatures, chunk: int = 64
) -> dict[str, Any]:
    """Held-out metrics over every anchor of every held-out sequence:

    - ``acc``: per slot k, the fraction of labelled slots whose greedy pick equals the token at a + k;
    - ``accept_len``: mean number of leading correct slots of blocks whose every slot is labelled
      (greedy verification of one block, at most block_size - 1);
    - ``loss``: the weighted training loss over all anchors.
    """
    drafter, s = objective.drafter, objective.cfg.block_size
    correct = torch.zeros(s - 1)
    counted = torch.zeros(s - 1)
    accepted, blocks, loss_sum, weight_sum = 0.0, 0, 0.0, 0.0
    for i in range(len(sequences)):
        batch = collate(sequences, features, [i])
        candidates = torch.nonzero(batch.answer[0, 2:]).flatten() + 1
        for start in range(0, candidates.numel(), chunk):
            anchors = candidates[start : start + chunk][None]
            out = block_forward(
                drafter, batch, objective.feature_index, anchors, torch.ones_like(anchors, dtype=torch.bool)
            )
            _, ce, picks = objective.weighted_ce(out)
            hits = picks == out.labels
            weights = objective.slot_weights[out.slot]
            loss_sum += float((weights * ce).sum())
            weight_sum += float(weights.sum())
            correct += torch.bincount(out.slot[hits], minlength=s - 1).float()
            counted += torch.bincount(out.slot, minlength=s - 1).float()
            grid = torch.zeros_like(out.labelled)
            grid[out.labelled] = hits
            full = out.labelled.all(-1)  # [1, A]
            accepted += float(grid.long().cumprod(-1).sum(-1)[full].sum())
            blocks += int(full.sum())
    return {
        "acc": [round(a, 4) for a in (correct / counted.clamp(min=1)).tolist()],
        "accept_len": accepted / max(blocks, 1),
        "loss": loss_sum / max(weight_sum, 1e-9),
        "sequences": len(sequences),
        "blocks": blocks,
    }
