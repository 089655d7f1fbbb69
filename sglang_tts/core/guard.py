"""Do no harm: reset an adapted drafter that drafts worse than the drafter it started from.

Every update trains on a canvas the adapted drafter has not seen yet (the round it just drafted).
Before its step, the update scores two drafters on that canvas, with no gradient: the adapted
drafter as it served the round, and the base drafter (the weights the scope started from). The
score of a canvas row is the number of leading canvas positions at which the drafter's top token
is the target's top token: the tokens a greedy chain drafted by that drafter would have kept along
the verified path (positions outside the loss end it). The Distiller scores the first position only
(score 1 or 0: is the round's first drafted token the target's?): it decides whether a round gains
anything, and it keeps the base drafter's extra forward to one draft step. Both drafters are scored
on the same positions, so the comparison is paired: the text's difficulty cancels.

Why the top token and not a smooth score such as sum_v min(p, q) (speculative sampling's acceptance
probability): KL training towards a sharp target makes q sharper, which raises min(p, q) where the
top token does not change; on the demo that smooth score claimed +30-130% over base while the
served tokens per round rose 2-9%. The top-token match moves only when drafts would.

`DoNoHarmGuard` keeps, per unit (the shared drafter's scope, or one request's adapter slot),
the last `window` paired scores. The unit is reset to base, and its window cleared, when the
window is full, the adapted drafter's mean score is below (1 - margin) x the base drafter's, and
the paired differences are clearly negative (their mean below -z standard errors): one canvas
holds the few positions of one round, so a single score is noisy, and a drafter as good as base
must not be reset by chance. The same windows give `gain()`: the adapted drafter's measured
acceptance gain over base, pooled over the units, which the update budget (core/budget.py) uses
as its default.

Caveat: the canvas is the path the adapted drafter's own draft left accepted, so positions past the
first lean towards where that drafter was right; the first position, the one the Distiller scores,
is the same for both drafters, so its comparison is paired and unbiased.

Both drafters read the canvas's context K/V, which the serving drafter wrote: a comparison that
means anything needs those K/V to be the base drafter's own, or close to them. Per-request EAGLE-3
adapters therefore leave the layers that write them at base (sglang/adapters.py: adapted_layers); a
shared drafter's update moves them slowly at its learning rate (the offline replay measured the
base score on the served cache within 0.01 of the score on its own cache: docs/update-cost.md).

Engine independent; the Distiller computes the scores (`greedy_scores`) in the update and
feeds them here on the serving thread.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

SCOPE_UNIT = -1  # the unit of a shared drafter (batch / global scope)


def greedy_scores(logits: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Leading canvas positions where the drafter's top token is the target's (module docstring).

    logits:  [B, C, V] the drafter's logits at the canvas positions
    teacher: [B, C, V] the target's probabilities (or logits) over the same vocabulary
    mask:    [B, C] bool, the positions that enter the loss
    returns: [B] float32
    """
    match = (logits.argmax(-1) == teacher.argmax(-1)) & mask
    return match.to(torch.float32).cumprod(dim=1).sum(dim=1)


def _paired(scores: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    """Paired (adapted, base) scores -> the differences' mean and standard error, and base's sum."""
    n = len(scores)
    diffs = [a - b for a, b in scores]
    mean_d = sum(diffs) / n
    var = sum((d - mean_d) ** 2 for d in diffs) / max(n - 1, 1)
    return mean_d, math.sqrt(var / n), sum(b for _, b in scores)


@dataclass
class GuardVerdict:
    """What one batch of scores decided."""

    reset_units: list[int]  # units whose adapted drafter goes back to base


class DoNoHarmGuard:
    def __init__(self, window: int = 16, margin: float = 0.02, z: float = 2.0, max_units: int = 4096) -> None:
        if window < 1:
            raise ValueError(f"guard window must be >= 1, got {window}")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"guard margin must be in [0, 1), got {margin}")
        self.window = window
        self.margin = margin
        self.z = z
        self.max_units = max_units  # bounded state: units are scopes or adapter slots, never requests
        self._scores: dict[int, deque[tuple[float, float]]] = {}
        self.num_resets = 0

    def observe(self, units: Iterable[int], adapted: Iterable[float], base: Iterable[float]) -> GuardVerdict:
        """One update's paired scores, one per canvas row (rows of one unit are summed first)."""
        per_unit: dict[int, list[float]] = {}
        for unit, a, b in zip(units, adapted, base):
            acc = per_unit.setdefault(int(unit), [0.0, 0.0])
            acc[0] += float(a)
            acc[1] += float(b)
        resets = []
        for unit, (a, b) in per_unit.items():
            scores = self._scores.get(unit)
            if scores is None:
                if len(self._scores) >= self.max_units:
                    continue
                scores = self._scores[unit] = deque(maxlen=self.window)
            scores.append((a, b))
            if len(scores) == self.window and self._worse(scores):
                resets.append(unit)
        for unit in resets:
            self._scores.pop(unit, None)
        self.num_resets += len(resets)
        return GuardVerdict(resets)

    def _worse(self, scores: deque[tuple[float, float]]) -> bool:
        """Is the adapted drafter worse than base over the window: its mean score below (1 - margin)
        x base's, and the paired differences clearly negative (mean below -z standard errors)? One
        canvas holds a few positions of one round, so single scores are noisy: both must hold."""
        mean_d, se_d, sum_b = _paired(scores)
        if mean_d >= -self.margin * sum_b / len(scores):
            return False
        return mean_d < -self.z * se_d

    def forget(self, unit: int | None = None) -> None:
        """A unit went back to base by other means (its scope ended, its slot was freed); None: all."""
        if unit is None:
            self._scores.clear()
        else:
            self._scores.pop(unit, None)

    def gain(self) -> float | None:
        """Adapted over base score minus 1, pooled over the units' windows (None: no scores yet). One
        match is added to each side: scores are counts of matches, and a window where base matched
        nothing must not report an infinite gain."""
        pairs = [s for scores in self._scores.values() for s in scores]
        if not pairs:
            return None
        sum_a = sum(a for a, _ in pairs)
        sum_b = sum(b for _, b in pairs)
        return (sum_a + 1.0) / (sum_b + 1.0) - 1.0

    def gain_bound(self, z: float = 1.0) -> float | None:
        """A lower confidence bound on gain(): the pooled paired differences' mean minus `z` standard
        errors, relative to base's mean score (with gain()'s one match added), None below two scores.
        What the update budget spends on: a gain measured on a handful of scores swings from -0.7 to
        +2.0 from one update to the next (Qwen testbed, one request), and a budget that follows
        it pays for noise."""
        pairs = [s for scores in self._scores.values() for s in scores]
        if len(pairs) < 2:
            return None
        mean_d, se_d, sum_b = _paired(pairs)
        return (mean_d - z * se_d) / ((sum_b + 1.0) / len(pairs))

    @property
    def num_units(self) -> int:
        return len(self._scores)
