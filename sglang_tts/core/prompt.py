"""Prompt-time adaptation: the drafter learns the request's prompt before it drafts the answer.

Verify rounds teach the drafter only after it has drafted, so every request starts with the
offline drafter. The prompt is supervision that arrives first: prefill runs the target over every
prompt token, and the drafter's inputs there (the target features EAGLE-3 and DFlash condition on)
are what SGLang's draft extend consumes anyway. The engine keeps, per request, the last N prompt
positions of those inputs (a `PromptWindow`) and the Distiller trains on them with the drafter's
own training objective before (and while) the first rounds decode:

- EAGLE-3: the training-time-test unroll (`Eagle3Drafter.ttt_hidden`) over the window, `depth`
  draft steps; row t of step j predicts the prompt token t + j + 2 (weights 0.8 ** j);
- DFlash: blocks anchored at evenly spaced window positions, each slot k predicting the token k
  after its anchor (weights exp(-(k - 1) / 7)), context = the window's features before the anchor.

Labels are the prompt's own next tokens (hard labels). The target's distribution at prompt
positions would be the exact teacher, but SGLang's prefill computes the target's logits at the last
position only, and a full LM head over the prompt costs [L, V] (152K columns for Qwen2.5): not
cheap, so not used. Prompt text that the answer copies or continues (code edits, documents) is
exactly what these labels teach.

Window layout (one request): `token_ids` [T + 1] are the tokens at positions start .. start + T,
`features` [T, F] the target features of `token_ids[:T]` (feature row t belongs to token t, so the
draft-extend row that consumes it embeds token t + 1). The last token may be the first output
token (SGLang's prefill samples it). Positions cached by a prefix hit were not run by this prefill
and have no features: a window covers what the prefill computed (chunks of a chunked prefill
concatenate), at most the last N positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PromptWindow:
    """One request's captured prompt positions (see the module docstring for the layout)."""

    request_id: str
    token_ids: torch.Tensor  # [T + 1] int64, positions start .. start + T
    features: torch.Tensor  # [T, F] float, target features of token_ids[:T]
    start: int  # absolute position of token_ids[0]

    @property
    def num_positions(self) -> int:
        return int(self.features.shape[0])

    def extended(self, token_ids: torch.Tensor, features: torch.Tensor, start: int, keep: int) -> PromptWindow:
        """This window followed by the next prefill chunk (which must start where this one's
        features end), cut to its last `keep` positions. Otherwise (a gap) the new chunk alone."""
        if start != self.start + self.num_positions:
            return cut_window(PromptWindow(self.request_id, token_ids, features, start), keep)
        ids = torch.cat((self.token_ids[:-1], token_ids.to(self.token_ids.device)))
        feats = torch.cat((self.features, features.to(self.features.device, self.features.dtype)))
        return cut_window(PromptWindow(self.request_id, ids, feats, self.start), keep)


def cut_window(window: PromptWindow, keep: int) -> PromptWindow:
    """The last `keep` positions of a window (a copy of those rows only)."""
    n = window.num_positions
    if n <= keep:
        return window
    drop = n - keep
    return PromptWindow(
        window.request_id, window.token_ids[drop:].clone(), window.features[drop:].clone(), window.start + drop
    )


@dataclass
class PromptBatch:
    """Windows padded into one batch (on the update's device, owned by the update).

    token_ids  [B, T + 1] int64   (padding repeats the last real token)
    positions  [B, T + 1] int64   absolute positions (keep increasing in padding)
    features   [B, T, F]  float
    real       [B, T + 1] bool    real tokens
    slots      [B] int64 per-request adapter slot (-1: none), or None without adapters
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    features: torch.Tensor
    real: torch.Tensor
    request_ids: list[str]
    slots: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def feature_mask(self) -> torch.Tensor:
        """[B, T] real feature rows (row t is real when token t + 1 is)."""
        return self.real[:, 1:]

    @property
    def num_positions(self) -> int:
        """Feature rows that are real (what the update reads)."""
        return int(self.feature_mask.sum())


def collate_windows(
    windows: Sequence[PromptWindow], device: torch.device | str, slots: Sequence[int] | None = None
) -> PromptBatch:
    """Pad windows into a PromptBatch on `device`, outside inference mode (autograd may use it)."""
    if not windows:
        raise ValueError("no prompt windows to collate")
    device = torch.device(device)
    b = len(windows)
    t = max(w.num_positions for w in windows)
    f = int(windows[0].features.shape[-1])
    with torch.inference_mode(False), torch.no_grad():
        token_ids = torch.zeros(b, t + 1, dtype=torch.long, device=device)
        positions = torch.zeros(b, t + 1, dtype=torch.long, device=device)
        features = torch.zeros(b, t, f, dtype=torch.float32, device=device)
        real = torch.zeros(b, t + 1, dtype=torch.bool, device=device)
        steps = torch.arange(t + 1, device=device)
        for i, w in enumerate(windows):
            n = w.num_positions
            token_ids[i, : n + 1] = w.token_ids.to(device)
            token_ids[i, n + 1 :] = token_ids[i, n]
            positions[i] = w.start + steps
            features[i, :n] = w.features.to(device, torch.float32)
            real[i, : n + 1] = True
        slot_tensor = None if slots is None else torch.tensor(list(slots), dtype=torch.long, device=device)
    return PromptBatch(token_ids, positions, features, real, [w.request_id for w in windows], slot_tensor)


@dataclass
class PromptTerms:
    """What a drafter's prompt forward gives the loss: its labelled rows only.

    hidden      [N, H] normed hidden the LM head reads
    labels      [N] int64 ids in the drafter's output vocabulary
    weights     [N] float per-row loss weight (depth / block-slot decay)
    batch_rows  [N] int64 PromptBatch row of each (its request: per-request adapters)
    """

    hidden: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    batch_rows: torch.Tensor


#: A drafter's prompt forward calls this with the PromptBatch row of every row of each forward it
#: runs (per-request adapters select each row's slot from it).
RowsHook = Callable[[torch.Tensor], None]


def prompt_loss(
    terms: PromptTerms,
    head_weight: torch.Tensor,
    head_delta: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
) -> torch.Tensor:
    """Weighted mean cross-entropy of the labelled rows: sum_n w_n CE_n / sum_n w_n.

    head_delta(hidden, batch_rows): per-row addition to the logits (an adapted LM head), or None."""
    logits = terms.hidden @ head_weight.T
    if head_delta is not None:
        logits = logits + head_delta(terms.hidden, terms.batch_rows)
    ce = F.cross_entropy(logits.float(), terms.labels, reduction="none")
    return (terms.weights * ce).sum() / terms.weights.sum().clamp(min=1e-12)
