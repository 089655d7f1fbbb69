"""The controller's action set: a draft chain length and a TTS update stride, chosen per batch.

SGLang 0.5.23 switches speculation settings only per batch, between pre-built states (one CUDA graph
per (steps, topk, draft tokens) on GPU), so the action set is a small discrete grid the server builds
at launch, as in Re-SpS (a Cartesian grid of draft-tree limits). Here the tree is a chain (topk 1,
draft tokens = num_steps + 1) and the second axis is the TTS update stride S, the paper's future
work "adaptive stride": small S adapts the drafter faster but puts more update time on the serving
path.

A third axis, with `--tts-hybrid on`: the proposer (core/hybrid.py MODES): the learned drafter for
every request, the hybrid rule (per request, the suffix chain when its record is at least the
drafter's), or the suffix proposer for every request (no drafter forward at all). Actions without
it (policy files from before it existed) have proposer "drafter" and leave the choice to the rule.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# The proposer modes of core/hybrid.py (MODES, same names and order), spelled out here so that this
# numpy-only package does not import the torch-side core; a test holds the two equal.
DRAFTER = "drafter"
SUFFIX = "suffix"
MODES = (DRAFTER, "hybrid", SUFFIX)


@dataclass(frozen=True, order=True)
class Action:
    """One controller decision, held for `persistence` verify rounds."""

    num_steps: int  # draft chain length (topk 1, draft tokens = num_steps + 1); 0 = no drafting
    update_stride: int  # TTS update stride S >= 1
    proposer: str = DRAFTER  # who drafts (core/hybrid.py MODES); needs --tts-hybrid on unless "drafter"

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
        if self.proposer not in MODES:
            raise ValueError(f"Action.proposer must be one of {MODES}, got {self.proposer!r}")

    @property
    def num_draft_tokens(self) -> int:
        """Tokens per request in the verify pass (the chain plus the root)."""
        return self.num_steps + 1

    def to_dict(self) -> dict[str, int | str]:
        d: dict[str, int | str] = {"num_steps": self.num_steps, "update_stride": self.update_stride}
        if self.proposer != DRAFTER:  # files without the axis stay as they were
            d["proposer"] = self.proposer
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Action:
        return cls(num_steps=d["num_steps"], update_stride=d["update_stride"], proposer=d.get("proposer", DRAFTER))

    def __str__(self) -> str:
        tail = "" if self.proposer == DRAFTER else f",{self.proposer}"
        return f"steps={self.num_steps},S={self.update_stride}{tail}"


def uses_suffix(actions: Sequence[Action]) -> bool:
    """Whether the action set has the proposer axis (and so needs the hybrid and its state features)."""
    return any(a.proposer != DRAFTER for a in actions)


def action_grid(
    steps: Sequence[int],
    strides: Sequence[int],
    proposers: Sequence[str] = (DRAFTER,),
    suffix_steps: Sequence[int] = (),
) -> list[Action]:
    """The sorted Cartesian grid steps x strides x proposers, without duplicates, plus
    `suffix_steps` x strides with the suffix proposer alone.

    num_steps = 0 (no drafting) produces no canvas and hence no TTS update, and no chain to propose,
    so neither the stride nor the proposer has an effect there: it appears once, with the smallest
    stride and the drafter, instead of once per combination (copies would only split the learner's
    samples between identical arms).

    `suffix_steps` are chains only the suffix proposer drafts: a copied span can be verified far
    longer than the learned drafter's chain is worth running (SGLang's NGRAM verifies up to 12
    tokens), and a drafter or rule action that long would run the drafter's steps for nothing.
    """
    if not steps or not strides or not proposers:
        raise ValueError("action_grid needs at least one chain length, one stride and one proposer")
    unique_steps = sorted(set(steps))
    unique_strides = sorted(set(strides))
    unique_proposers = [m for m in MODES if m in set(proposers)]
    unknown = set(proposers) - set(MODES)
    if unknown:
        raise ValueError(f"unknown proposers {sorted(unknown)}; known: {MODES}")
    actions: list[Action] = []
    for n in unique_steps:
        if n == 0:
            actions.append(Action(num_steps=0, update_stride=unique_strides[0]))
            continue
        for s in unique_strides:
            for m in unique_proposers:
                actions.append(Action(num_steps=n, update_stride=s, proposer=m))
    if any(n < 1 for n in suffix_steps):
        raise ValueError(f"suffix_steps must be chain lengths >= 1, got {list(suffix_steps)}")
    for n in sorted(set(suffix_steps) - (set(unique_steps) if SUFFIX in unique_proposers else set())):
        actions.extend(Action(num_steps=n, update_stride=s, proposer=SUFFIX) for s in unique_strides)
    return sorted(actions, key=lambda a: (a.num_steps, a.update_stride, MODES.index(a.proposer)))
