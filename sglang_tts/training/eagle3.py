"""EAGLE-3 drafter training (EAGLE-3 / SpecForge recipe, on short sequences).

- Features: the concat of three target layers, by default the ones SGLang captures when the
  drafter config names none (models/llama.py:set_eagle3_layers_to_capture: inputs of layers
  2, N // 2, N - 3, i.e. output-of-layer ids 1, N // 2 - 1, N - 4), written explicitly into
  ``eagle_config.eagle_aux_hidden_state_layer_ids``. Targets too shallow for that default (the
  tiny test targets) use ``default_eagle3_aux_layer_ids``.
- Draft vocabulary: the ``draft_vocab_size`` most frequent target ids among the answer tokens of
  the training set (ties: prompt frequency, then id), laid out as ``d2t``/``t2d`` exactly like
  ``drafter_checkpoints.draft_vocab_maps``.
- Training-time test: ``Eagle3Drafter.ttt_hidden`` unrolls ``ttt_steps`` (7) draft steps over whole
  sequences; step j feeds the drafter its own hidden from step j - 1 (RoPE positions advance with
  j, as in SGLang's chain drafting). Row t of step j predicts the token at t + j + 2. Steps after the
  first run only from the first row any step labels (``first_labelled_row``): a window's prompt rows
  feed the answer rows through step 0's keys alone.
- Loss: per step, soft cross-entropy against the target distribution restricted to the draft
  vocabulary and renormalised (teacher logits recomputed from the cached final hidden state through
  the target LM head rows of the draft vocabulary), over answer tokens whose target top-1 lies in
  the draft vocabulary, averaged over those rows; steps weighted 0.8 ** j and summed.
- Initialisation: layers N(0, 0.02), norms 1; the draft LM head starts from the target's LM-head
  rows of the draft vocabulary and the final norm from the target's (a warm start that matters on a
  CPU budget; ``lm_head_from_target=False`` gives the plain random start). The embedding is the
  target's, frozen (a buffer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sglang_tts.drafters.checkpoints import default_eagle3_aux_layer_ids, draft_vocab_maps, eagle3_config
from sglang_tts.drafters.eagle3 import EAGLE3_POSITION_DECAY, Eagle3Config, Eagle3Drafter
from sglang_tts.training.data import SequenceSet
from sglang_tts.training.target import Batch, TargetFeatures, TargetWeights, batch_indices, collate, sequence_features
from sglang_tts.training.weights import init_weights_


@dataclass
class Eagle3TrainConfig:
    draft_vocab_size: int = 8192
    num_layers: int = 1
    ttt_steps: int = 7
    step_decay: float = EAGLE3_POSITION_DECAY
    aux_layer_ids: list[int] | None = None  # None: SGLang's default capture for the target
    batch_size: int = 4
    init_std: float = 0.02
    lm_head_from_target: bool = True


def sglang_default_aux_layer_ids(num_target_layers: int) -> list[int]:
    """SGLang's EAGLE-3 capture without explicit ids (inputs of layers 2, N // 2, N - 3), as
    output-of-layer ids."""
    n = num_target_layers
    return [i - 1 for i in (2, n // 2, n - 3)]


def eagle3_aux_layer_ids(num_target_layers: int) -> list[int]:
    ids = sglang_default_aux_layer_ids(num_target_layers)
    if ids == sorted(set(ids)) and all(-1 <= i <= num_target_layers - 2 for i in ids):
        return ids
    return default_eagle3_aux_layer_ids(num_target_layers)


def frequency_draft_vocab(sequences: SequenceSet, vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """Sorted target ids of the draft vocabulary: most frequent answer tokens first, ties broken by
    prompt-token frequency, then by id (so small sets still fill the vocabulary deterministically)."""
    size = min(draft_vocab_size, vocab_size)
    answer = torch.bincount(torch.cat(list(sequences.answer_ids())), minlength=vocab_size)[:vocab_size]
    everything = torch.bincount(torch.cat(sequences.ids), minlength=vocab_size)[:vocab_size]
    key = answer * (int(everything.max()) + 1) + everything
    order = torch.sort(key, descending=True, stable=True).indices  # stable: equal keys keep id order
    return order[:size].sort().values


def build_eagle3(
    target: TargetWeights, cfg: Eagle3TrainConfig, used_ids: torch.Tensor, seed: int
) -> tuple[Eagle3Drafter, dict[str, Any]]:
    """A freshly initialised drafter for `target` over the draft vocabulary `used_ids`, and its config."""
    aux_ids = list(cfg.aux_layer_ids) if cfg.aux_layer_ids is not None else eagle3_aux_layer_ids(target.num_layers)
    config = eagle3_config(
        target.config, draft_vocab_size=int(used_ids.numel()), aux_layer_ids=aux_ids, num_layers=cfg.num_layers
    )
    drafter = Eagle3Drafter(Eagle3Config.from_dict(config), target_embedding=target.embedding)
    init_weights_(drafter, seed, cfg.init_std)
    d2t, t2d = draft_vocab_maps(used_ids, target.vocab_size)
    with torch.no_grad():
        drafter.d2t.copy_(d2t)
        drafter.t2d.copy_(t2d)
        if cfg.lm_head_from_target:
            drafter.lm_head.weight.copy_(target.lm_head[drafter.draft_to_target_ids()])
            drafter.norm.weight.copy_(target.final_norm)
    return drafter, config


@dataclass
class Unroll:
    """One TTT forward over a batch: per step, the rows that carry a label."""

    hidden: list[torch.Tensor]  # per step [B, T - first, H]: rows first..T - 1
    teacher_logp: torch.Tensor  # [B, L, V_draft] target log-probs on the draft vocabulary
    t: int  # rows per sequence (L - 1)
    first: int  # the first row any step labels (first_labelled_row)


def first_labelled_row(batch: Batch, steps: int) -> int:
    """Row t of step j predicts the token at t + j + 2, so no step labels a row before the batch's first
    answer position - steps - 1: the unroll runs steps > 0 from there (``Eagle3Drafter.ttt_hidden``)."""
    has_answer = batch.answer.any(1)
    if not bool(has_answer.any()):
        return 0
    first_answer = int(batch.answer.int().argmax(1)[has_answer].min())
    return min(max(0, first_answer - steps - 1), batch.ids.shape[1] - 2)


def unroll(
    drafter: Eagle3Drafter, batch: Batch, aux_index: list[int], teacher_head: torch.Tensor, steps: int
) -> Unroll:
    b, length = batch.ids.shape
    features = batch.hidden[:, :, aux_index].flatten(2)
    positions = torch.arange(1, length).expand(b, length - 1)
    first = first_labelled_row(batch, steps)
    hidden = drafter.ttt_hidden(batch.ids[:, 1:], features[:, :-1], positions, batch.real[:, 1:], steps, first)
    teacher_logp = torch.log_softmax(batch.final @ teacher_head.T, dim=-1)
    return Unroll(hidden, teacher_logp, length - 1, first)


def step_rows(batch: Batch, step: int, rows: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """For TTT step `step`, over rows first..rows - 1: [B, rows - first] mask of rows t whose prediction
    (the token at t + step + 2) is an answer token, and the teacher position t + step + 1 of every row
    (clamped)."""
    length = batch.ids.shape[1]
    predicted = torch.arange(first, rows) + step + 2
    in_range = predicted < length
    label = torch.zeros(batch.ids.shape[0], rows - first, dtype=torch.bool)
    label[:, in_range] = batch.answer[:, predicted[in_range]]
    return label, (predicted - 1).clamp(max=length - 1)


class Eagle3Objective:
    """Step s -> (loss, metrics) for the training loop; see the module docstring."""

    def __init__(
        self,
        drafter: Eagle3Drafter,
        cfg: Eagle3TrainConfig,
        sequences: SequenceSet,
        features: TargetFeatures,
        target: TargetWeights,
        seed: int,
    ) -> None:
        self.drafter, self.cfg, self.sequences, self.features, self.seed = drafter, cfg, sequences, features, seed
        self.aux_index = features.layers(drafter.cfg.aux_layer_ids or [])
        self.teacher_head = target.lm_head[drafter.draft_to_target_ids()].float()
        self.weights = [cfg.step_decay**j for j in range(cfg.ttt_steps)]

    def batch(self, step: int) -> Batch:
        return collate(
            self.sequences, self.features, batch_indices(len(self.sequences), self.cfg.batch_size, step, self.seed)
        )

    def loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        out = unroll(self.drafter, batch, self.aux_index, self.teacher_head, self.cfg.ttt_steps)
        in_draft = self.drafter.t2d[batch.top1]  # [B, L]: target top-1 inside the draft vocabulary
        head = self.drafter.lm_head_weight()
        total = out.hidden[0].sum() * 0.0  # stays in the graph when no row carries a label
        metrics: dict[str, float] = {}
        for j, weight in enumerate(self.weights):
            label, teacher_pos = step_rows(batch, j, out.t, out.first)
            rows = label & in_draft.gather(1, teacher_pos.expand_as(label))
            b_idx, t_idx = rows.nonzero(as_tuple=True)
            if b_idx.numel() == 0:
                continue
            log_q = torch.log_softmax(out.hidden[j][b_idx, t_idx] @ head.T, dim=-1)
            teacher = out.teacher_logp[b_idx, teacher_pos[t_idx]].exp()
            ce = -(teacher * log_q).sum(-1).mean()
            total = total + weight * ce
            metrics[f"ce_{j}"] = float(ce.detach())
            metrics[f"acc_{j}"] = float((log_q.argmax(-1) == teacher.argmax(-1)).float().mean())
        return total, metrics

    def __call__(self, step: int) -> tuple[torch.Tensor, dict[str, float]]:
        return self.loss(self.batch(step))


@torch.no_grad()
def evaluate_eagle3(objective: Eagle3Objective, sequences: SequenceSet, features: TargetFeatures) -> dict[str, Any]:
    """Held-out metrics, one sequence at a time, with the drafter's greedy pick at every TTT step.

    - ``acc``: per step j, the fraction of rows whose pick equals the target's top-1 (over all answer
      positions, top-1 inside the draft vocabulary or not), given the true previous tokens --
      the acceptance rate of draft step j given that steps < j were accepted;
    - ``accept_len``: mean number of leading accepted steps of the chain anchored at each row
      whose whole chain lies inside the answer (greedy verification, at most ``ttt_steps``);
    - ``loss``: the training loss, averaged over sequences.
    """
    drafter, steps = objective.drafter, objective.cfg.ttt_steps
    correct = torch.zeros(steps)
    counted = torch.zeros(steps)
    accepted, chains, losses = 0.0, 0, []
    d2t_ids = drafter.draft_to_target_ids()
    head = drafter.lm_head_weight()
    for i in range(len(sequences)):
        batch = collate(sequences, features, [i])
        losses.append(float(objective.loss(batch)[0]))
        out = unroll(drafter, batch, objective.aux_index, objective.teacher_head, steps)
        hits = []
        for j in range(steps):
            label, teacher_pos = step_rows(batch, j, out.t, out.first)
            pick = d2t_ids[(out.hidden[j] @ head.T).argmax(-1)]
            hit = (pick == batch.top1.gather(1, teacher_pos[None])) & label
            correct[j] += hit.sum()
            counted[j] += label.sum()
            hits.append(hit)
        full, _ = step_rows(batch, steps - 1, out.t, out.first)  # rows whose whole chain is labelled
        run = torch.stack(hits, -1).cumprod(-1).sum(-1)
        accepted += float(run[full].sum())
        chains += int(full.sum())
    acc = (correct / counted.clamp(min=1)).tolist()
    return {
        "acc": [round(a, 4) for a in acc],
        "accept_len": accepted / max(chains, 1),
        "loss": sum(losses) / max(len(losses), 1),
        "sequences": len(sequences),
        "chains": chains,
    }


@torch.no_grad()
def chain_hits(model: Any, drafter: Eagle3Drafter, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """[L - 1, steps] bool: row t's draft step j equals the target's pick for position t + j + 2 (teacher
    forced: the true tokens before it); rows whose position runs past the sequence are False."""
    layer_ids = sorted(set(drafter.cfg.aux_layer_ids))
    features = sequence_features(model, ids, layer_ids)
    order = [layer_ids.index(i) for i in drafter.cfg.aux_layer_ids]
    feats = features["hidden"][:, order].flatten(1)  # [L, K * H] in the drafter's layer order
    length = len(ids)
    hidden = drafter.ttt_hidden(ids[None, 1:], feats[None, :-1], torch.arange(1, length)[None], steps=steps)
    d2t, head = drafter.draft_to_target_ids(), drafter.lm_head_weight()
    hits = torch.zeros(length - 1, steps, dtype=torch.bool)
    for j in range(steps):
        rows = length - 2 - j  # row t predicts position t + j + 2, which must exist
        if rows <= 0:
            continue
        pick = d2t[(hidden[j][0, :rows] @ head.T).argmax(-1)]
        hits[:rows, j] = pick == features["top1"][j + 1 : j + 1 + rows]
    return hits
