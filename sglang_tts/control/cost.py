"""A linear model of the wall time of one verify round, fitted by least squares.

    round_seconds ~ intercept + per_step * n + per_request * b + per_step_request * n * b
                    + per_update * [n > 0] / S

n = chain length, b = batch size, S = update stride. The n * b term is the verify cost of the extra
tokens (b * (n + 1) tokens per verify pass: why deep drafting stops paying at large batch,
SpecActor's D(b) and V(b)); [n > 0] / S is the update time amortised over its stride (no drafting,
no canvas, no update). Used two ways (SpecActor's TGS idea): as a low-noise reward (accepted tokens /
predicted seconds, so timing jitter does not reach the learner).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

COEFFICIENTS = ("intercept", "per_step", "per_request", "per_step_request", "per_update")


def cost_design_row(num_steps: float, batch_size: float, update_stride: float) -> list[float]:
    """The regressors of one round (or of a window's means)."""
    n, b = float(num_steps), float(batch_size)
    return [1.0, n, b, n * b, (1.0 if n > 0 else 0.0) / max(float(update_stride), 1.0)]


@dataclass(frozen=True)
class CostModel:
    """Fitted seconds per round; see the module docstring for the terms."""

    intercept: float
    per_step: float = 0.0
    per_request: float = 0.0
    per_step_request: float = 0.0
    per_update: float = 0.0
    floor: float = 1e-6  # predictions never go below this (a negative fit must not make a reward blow up)

    def predict(self, num_steps: float, batch_size: float, update_stride: float) -> float:
        row = cost_design_row(num_steps, batch_size, update_stride)
        coef = (self.intercept, self.per_step, self.per_request, self.per_step_request, self.per_update)
        return max(float(np.dot(row, coef)), self.floor)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        unknown = set(d) - {*COEFFICIENTS, "floor"}
        if unknown:
            raise ValueError(f"unknown cost model keys {sorted(unknown)}; expected {list(COEFFICIENTS)}")
        return cls(**{k: float(v) for k, v in d.items()})

    @classmethod
    def fit(
        cls,
        num_steps: Sequence[float],
        batch_size: Sequence[float],
        update_stride: Sequence[float],
        round_seconds: Sequence[float],
        weights: Sequence[float] | None = None,
    ) -> CostModel:
        """Weighted least squares (weights: e.g. rounds per window). Terms with no variation in the
        data (a single chain length, say) get coefficient 0 instead of an arbitrary split."""
        x = np.array([cost_design_row(n, b, s) for n, b, s in zip(num_steps, batch_size, update_stride)])
        y = np.asarray(round_seconds, dtype=np.float64)
        if len(y) == 0 or x.shape[0] != len(y):
            raise ValueError("CostModel.fit needs one round time per design row, and at least one")
        w = np.sqrt(np.ones_like(y) if weights is None else np.asarray(weights, dtype=np.float64))
        # Drop columns that are constant 0 or copies of the intercept: they are not identifiable.
        keep = [0] + [j for j in range(1, x.shape[1]) if np.ptp(x[:, j]) > 1e-12]
        coef = np.zeros(x.shape[1])
        sol, *_ = np.linalg.lstsq(x[:, keep] * w[:, None], y * w, rcond=None)
        coef[keep] = sol
        return cls(*map(float, coef))

    @classmethod
    def fit_records(cls, records: Iterable[dict[str, Any]]) -> CostModel:
        """Fit from Controller trace records (their window means)."""
        rows = [r["window"] for r in records if r.get("window", {}).get("rounds", 0) > 0]
        return cls.fit(
            [r["num_steps"] for r in rows],
            [r["mean_batch_size"] for r in rows],
            [r["update_stride"] for r in rows],
            [r["seconds"] / r["rounds"] for r in rows],
            weights=[r["rounds"] for r in rows],
        )
