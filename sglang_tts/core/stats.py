"""Counters the Distiller keeps; read by the metrics exporter and the benchmark scripts."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class DistillerStats:
    # Global totals: never reset.
    rounds: int = 0
    num_updates: int = 0  # updates that completed and were kept
    num_skipped_updates: int = 0  # non-finite or failed updates, rolled back
    num_empty_updates: int = 0  # no canvas position entered the loss: nothing to train on
    num_resets: int = 0
    num_failed_publishes: int = 0  # publishes that failed part-way (the old weights were written back)
    num_guard_resets: int = 0  # units the do-no-harm guard reset to base (core/guard.py)
    guard_gain: float = math.nan  # the guard's pooled gain of the adapted drafter over base (last measured)
    guard_gain_bound: float = math.nan  # its lower confidence bound (one standard error): what the budget spends
    weight_version: int = 0  # bumped each time new weights are published to the serving copy
    update_ms_total: float = 0.0
    update_rows_total: int = 0  # canvas rows the submitted updates trained on (rounds x requests)
    update_ms_last: float = 0.0
    wait_ms_total: float = 0.0  # time the serving thread was blocked waiting for updates
    hidden_ms_total: float = 0.0  # update time that overlapped serving instead
    last_loss: float = math.nan
    last_kl_teacher: float = math.nan
    last_update_round: int = -1  # the distiller round whose canvas the last kept update trained on
    # Prompt updates (core/prompt.py): counted apart from verify-round updates.
    num_prompt_updates: int = 0
    num_skipped_prompt_updates: int = 0  # also in num_skipped_updates
    prompt_positions_total: int = 0
    prompt_steps_total: int = 0
    prompt_ms_total: float = 0.0
    last_prompt_loss: float = math.nan  # before the first step of the last kept prompt update
    last_prompt_loss_after: float = math.nan  # before its last step
    # Per scope: cleared by Distiller.reset().
    scope_rounds: int = 0
    scope_updates: int = 0

    def snapshot(self) -> dict[str, float | int]:
        return asdict(self)
