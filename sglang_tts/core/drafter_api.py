"""The small interface the TTS update needs from a drafter (EAGLE-3, DFlash, or a test model).

Like vLLM v1's proposer interfaces: the update knows nothing of architectures; a drafter knows
nothing of optimisers, strides or engines.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from sglang_tts.core.canvas import Canvas


@runtime_checkable
class DifferentiableDrafter(Protocol):
    """A plain nn.Module whose `canvas_logits` is differentiable in its trainable parameters."""

    #: "eagle3" | "dflash" | anything a test defines
    kind: str

    def canvas_hidden(self, canvas: Canvas) -> torch.Tensor:
        """Final (normed) hidden states [B, C, H] at every canvas position, differentiable; the
        logits are `canvas_hidden(c) @ lm_head_weight().T` (split so the loss can fuse the head),
        unless the drafter sets `lm_head_per_row = True` (per-request LM-head adapters), in which
        case the update takes its logits from `canvas_logits`."""
        ...

    def lm_head_weight(self) -> torch.Tensor:
        """[V_draft, H] weight of the drafter's LM head (trainable or borrowed)."""
        ...

    def canvas_logits(self, canvas: Canvas) -> torch.Tensor:
        """Drafter logits [B, C, V_draft] at every canvas position (same indexing as the canvas)."""
        ...

    def teacher_probs(self, canvas: Canvas) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's distribution on the drafter's vocabulary, [B, C, V_draft], and a [B, C] bool
        mask of positions the loss may use (EAGLE-3: target top-1 inside the draft vocabulary)."""
        ...

    # Optional: `teacher_vocab(device) -> core.canvas.TeacherVocab | None`, the target ids the loss reads
    # (a reduced draft vocabulary), so that capture keeps only those logits (EAGLE-3 has it).

    def default_position_weights(self, length: int) -> torch.Tensor:
        """w_k for k = 1..length, from the drafter's own training recipe."""
        ...

    def trainable_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Parameters TTS may train (borrowed target embedding / LM head excluded)."""
        ...
