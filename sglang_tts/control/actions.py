"""The controller's action set: a draft chain length and a TTS update stride, chosen per batch.

SGLang 0.5.23 switches speculation settings only per batch, between pre-built states (one CUDA graph
per (steps, topk, draft tokens) on GPU), so the action set is a small discrete grid the server builds
at launch, as in Re-SpS (a Cartesian grid of draft-tree limits). Here the tree is a chain (topk 1,
draft tokens = num_steps + 1) and the second axis is the TTS update stride S, the paper's future
work "adaptive stride": small S adapts the drafter faster but puts more update time on the serving
path.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, order=True)
class Action:
    """One controller decision, held for `persistence` verify rounds."""

    num_steps: int  # draft chain length (topk 1, draft tokens = num_steps + 1); 0 = no drafting
    update_stride: int  # TTS update stride S >= 1

    def __post_init__(self) -> None:
        for name in ("num_steps", "update_stride"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"Action.{name} must be an int, got {value!r}")
            object.__setattr__(self, name, int(value))  # numpy ints from a caller: store plain ints
        if self.num_steps < 0:
            raise ValueError(f"Action.num_steps must be >= 0, got {self.num_steps}")
        if self.update_stride < 1:
            raise ValueError(f"Action.update_stride must be >= 1, got {self.update_stride}")

    @property
    def num_draft_tokens(self) -> int:
        """Tokens per request in the verify pass (the chain plus the root)."""
        return self.num_steps + 1

    def to_dict(self) -> dict[str, int]:
        return {"num_steps": self.num_steps, "update_stride": self.update_stride}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Action:
        return cls(num_steps=d["num_steps"], update_stride=d["update_stride"])

    def __str__(self) -> str:
        return f"steps={self.num_steps},S={self.update_stride}"


def action_grid(steps: Sequence[int], strides: Sequence[int]) -> list[Action]:
    """The sorted Cartesian grid steps x strides, without duplicates.

    num_steps = 0 (no drafting) produces no canvas and hence no TTS update, so the stride has no
    effect there: it appears once, with the smallest stride, instead of once per stride (copies would
    only split the learner's samples between identical arms).
    """
    if not steps or not strides:
        raise ValueError("action_grid needs at least one chain length and one stride")
    unique_steps = sorted(set(steps))
    unique_strides = sorted(set(strides))
    actions: list[Action] = []
    for n in unique_steps:
        for s in unique_strides[:1] if n == 0 else unique_strides:
            actions.append(Action(num_steps=n, update_stride=s))
    return actions
