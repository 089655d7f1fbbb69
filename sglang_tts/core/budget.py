"""The update budget: the share of serving time TTS updates may take, and the stride that keeps it.

An update costs serving time however it runs: inline (--tts-sync) it blocks the round that
submits it; on a worker thread or a side stream it slows the rounds it overlaps (on a small CPU
the update and the forward share the cores) and may block the barrier. `StrideGovernor` measures
that cost online, from the rounds' own wall times, and picks the stride S:

    a round is *touched* if an update was still running when it started or was submitted in it;
    base(b)  = EMA of untouched rounds' wall time, per batch size b
    excess   = sum over touched rounds of (wall - base(b)), at least 0   (the updates' cost)
    cost     = EMA of excess per update, at least the time the serving thread was blocked on it
               (the update's own run time until a base is known)
    share(S) = cost / (cost + S * base)      ->   S_budget = smallest S with share(S) <= budget

The budget is `--tts-update-budget F`, or by default ("auto") the drafter's measured gain: the
do-no-harm guard (core/guard.py) scores the adapted drafter against the base drafter on every
update's canvas, which gives g, the relative gain in its drafts' acceptance (the budget takes a
lower confidence bound of it, one standard error below: it spends on gains it has measured, not on
noise), and so g_r = g (tau - 1) / tau in tokens per round (tau: tokens a round commits; the bonus
token does not grow); spending at most g_r / (1 + g_r) of the time on updates keeps tokens/s at or
above the frozen drafter's, (1 + g_r)(1 - share) >= 1, on whatever machine the server runs. A
drafter needs updates before it can show a gain:
for its first `guard_window` updates in a scope (the engine says when it has had them) the budget is
`initial_budget` (10%); after that at least `min_budget` (2%), so that a drafter that gains nothing
costs little but can still start gaining. `scale` (--tts-update-budget-scale K, 0 < K <= 1) multiplies
the auto budget, warm-up included: with K = 1 updates may spend the whole measured gain, which keeps
tokens/s at frozen's at the margin; K < 1 keeps part of the gain as speed (fewer, longer strides:
every round of a stride is still trained, in one larger update).

A window of rounds (`window` rounds of `window_rows` rows at most, config.py) trains on every round of a
stride only while the stride fits in it: at a batch of B it holds min(window, window_rows // B) rounds,
and a longer stride drops its earlier rounds instead of training on them (4 in flight: 8 rounds). The
stride is therefore capped at the rounds the window holds at the last batch size, but never below the
stride the whole gain buys (the budget at K = 1): past the window a longer stride saves update time by
learning less, and K < 1 is meant to keep speed, not to stop learning (docs/update-cost.md).

With a second proposer beside the drafter (--tts-hybrid: the suffix proposer drafts the rounds
whose continuation the context already holds), a gain of the drafter pays only on the rounds it
drafts: the budget, the warm-up's included, is scaled by the drafter's share of request-rounds
(slow EMA, `observe_drafted`), and tau and the trend read the drafter's rounds alone. The guard
scores every trained row, copied spans included, where an adapted drafter soon looks far better
than the base (a span it has seen) while the suffix proposer drafts those rounds anyway.

Until an untouched round has been seen (every round ran beside an update, e.g. S = 1 with updates
longer than a round) the cost has no base: the stride then lengthens by one per update until one is.

Acceptance trend: a fast and a slow EMA of tokens per round. Falling (fast below slow by more than
`trend_tolerance`): S = S_budget, the shortest the budget allows. Otherwise S lengthens by one per
decision, up to 2 x S_budget: a drafter that keeps up needs fewer updates. Always within
[min_stride, max_stride].

Engine independent: the engine adapter reports rounds (`round_done`) and finished updates
(`update_done`), and asks `decide()` for the stride between rounds when no update is in flight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sglang_tts.config import MAX_WINDOW_ROWS, rounds_held

MAX_BATCH_KEYS = 64  # base round times kept per batch size (larger batches share a power-of-two key)
GAP_FACTOR = 20.0  # a "round" this many times the base round is a gap (idle server), not a round


def _batch_key(batch_size: int) -> int:
    if batch_size <= 16:
        return batch_size
    return 1 << (batch_size - 1).bit_length()


@dataclass
class BudgetState:
    """What the governor measured; reported in logs, meta_info and Prometheus."""

    budget: float  # the share in force (fixed, or auto from the gain)
    share: float  # measured share of serving time the updates took (EMA), nan before any update
    cost_ms: float  # serving time one update costs (EMA), nan before any update
    base_round_ms: float  # an untouched round's wall time at the last batch size, nan before one
    gain: float  # the guard's measured gain (nan: none yet)
    gain_bound: float  # its lower confidence bound: what `auto` spends (nan: none yet)
    stride: int
    trend: float  # fast / slow EMA of tokens per round - 1
    drafter_share: float = math.nan  # share of request-rounds the drafter drafted (hybrid; nan: all)


class StrideGovernor:
    def __init__(
        self,
        stride: int,
        budget: float | None = None,
        *,
        min_stride: int = 1,
        max_stride: int = 32,
        initial_budget: float = 0.10,
        min_budget: float = 0.02,
        max_budget: float = 0.5,
        scale: float = 1.0,
        window: int = 1,
        window_rows: int = MAX_WINDOW_ROWS,
        trend_tolerance: float = 0.03,
        alpha: float = 0.2,
    ) -> None:
        if budget is not None and not 0.0 < budget < 1.0:
            raise ValueError(f"update budget must be in (0, 1), got {budget}")
        if not 0.0 < scale <= 1.0:
            raise ValueError(f"budget scale must be in (0, 1], got {scale}")
        if window < 1 or window_rows < 1:
            raise ValueError(f"window must be >= 1 rounds of >= 1 rows, got {window}, {window_rows}")
        if not 1 <= min_stride <= max_stride:
            raise ValueError(f"stride bounds must satisfy 1 <= min <= max, got {min_stride}, {max_stride}")
        self.fixed_budget = budget
        self.min_stride, self.max_stride = min_stride, max_stride
        self.initial_budget, self.min_budget, self.max_budget = initial_budget, min_budget, max_budget
        self.scale = scale  # the auto budget spends this share of what it would (warm-up and gain alike)
        self.window, self.window_rows = window, window_rows  # what one update trains on (held_rounds)
        self.trend_tolerance = trend_tolerance
        self.alpha = alpha
        self._last_batch = 1  # the batch size of the last round
        self.stride = min(max(stride, min_stride), max_stride)
        self._base: dict[int, float] = {}  # batch key -> EMA of untouched round seconds
        self._last_key: int | None = None
        self._excess = 0.0  # touched rounds' excess since the last finished update
        self._touched_unbased = 0.0  # touched rounds' seconds with no base for their batch size
        self.cost_s = math.nan
        self.share = math.nan
        self.gain = math.nan
        self.gain_bound = math.nan  # what the budget spends: a lower confidence bound of the gain
        self._fast = math.nan
        self._slow = math.nan
        self.drafter_share = math.nan  # EMA of the drafter's share of request-rounds (nan: it drafts all)
        self.num_updates = 0
        self.settled = False
        self.total_cost_s = 0.0  # what the finished updates cost serving (sum of `cost` below)
        self.total_round_s = 0.0

    # --- measurements -------------------------------------------------------------------------

    def round_done(self, seconds: float, batch_size: int, touched: bool) -> None:
        """One decode round's wall time; touched: an update was pending at its start or submitted in it."""
        if not (seconds >= 0.0 and math.isfinite(seconds)) or batch_size < 1:
            return
        key = _batch_key(batch_size)
        base = self._base.get(key)
        if base is not None and seconds > GAP_FACTOR * base:
            return  # not a round: the server sat idle (or did other work) in between
        self.total_round_s += seconds
        self._last_batch = batch_size
        self._last_key = key if key in self._base or len(self._base) < MAX_BATCH_KEYS else self._last_key
        if not touched:
            if base is None:
                if len(self._base) < MAX_BATCH_KEYS:
                    self._base[key] = seconds
                    self._last_key = key
            else:  # quicker down than up: a slow outlier (a gap, a neighbour) must not set the base
                rate = self.alpha if seconds >= base else 0.5
                self._base[key] = base + rate * (seconds - base)
            return
        if base is not None and seconds < base:
            # A round with an update in flight cannot be quicker than one without: the base is too high.
            self._base[key] = base = base + 0.5 * (seconds - base)
        if base is None:
            self._touched_unbased += seconds
        else:
            self._excess += max(0.0, seconds - base)

    def update_done(self, run_s: float, blocked_s: float) -> None:
        """An update finished (kept, skipped or empty): fold the excess of the rounds it touched (its
        run time while no base is known). Inline or not, the same measure: inline, the excess of the
        round that ran it is its whole run."""
        self.num_updates += 1
        if self._touched_unbased > 0.0 or (self._excess == 0.0 and math.isnan(self.base_round_s)):
            cost = max(run_s, blocked_s)  # no base for the rounds it touched: charge its whole run
        else:
            # At least the time the serving thread was blocked on it: with a base taken from slow
            # rounds (the first after a long prefill), touched rounds show no excess, the cost reads
            # ~0 and the stride 1, where every round is touched and the base recovers only slowly.
            cost = max(self._excess, blocked_s)
        self._excess = 0.0
        self._touched_unbased = 0.0
        if not math.isfinite(cost):
            return
        self.total_cost_s += cost
        self.cost_s = cost if math.isnan(self.cost_s) else self.cost_s + self.alpha * (cost - self.cost_s)
        base = self.base_round_s
        if not math.isnan(base):
            self.share = self.cost_s / (self.cost_s + self.stride * base) if self.cost_s + base > 0 else 0.0

    def observe_gain(self, gain: float | None, settled: bool = True, bound: float | None = None) -> None:
        """The guard's pooled gain (core/guard.py) and its lower confidence bound, which the budget
        spends (None: the gain itself); None keeps the last ones. `settled`: the drafter has had its
        warm-up updates in this scope (before that the gain is not yet the drafter's to show, and the
        budget stays at `initial_budget`)."""
        self.settled = settled
        if gain is not None and math.isfinite(gain):
            self.gain = gain
            self.gain_bound = bound if bound is not None and math.isfinite(bound) else gain

    def observe_drafted(self, drafter_rounds: int, rounds: int) -> None:
        """--tts-hybrid: of a verify round's `rounds` request-rounds, how many the learned drafter
        drafted (the suffix proposer the rest). A slow EMA (about 50 rounds)."""
        if rounds <= 0 or not 0 <= drafter_rounds <= rounds:
            return
        share = drafter_rounds / rounds
        if math.isnan(self.drafter_share):
            self.drafter_share = share
        else:
            self.drafter_share += 0.02 * (share - self.drafter_share)

    @property
    def _drafted(self) -> float:
        return 1.0 if math.isnan(self.drafter_share) else self.drafter_share

    def observe_tokens(self, tokens_per_round: float) -> None:
        """Mean tokens a round committed (bonus included), for the acceptance trend."""
        if not math.isfinite(tokens_per_round):
            return
        if math.isnan(self._fast):
            self._fast = self._slow = tokens_per_round
            return
        self._fast += 0.2 * (tokens_per_round - self._fast)
        self._slow += 0.02 * (tokens_per_round - self._slow)

    # --- decision -----------------------------------------------------------------------------

    @property
    def base_round_s(self) -> float:
        if self._last_key is None or self._last_key not in self._base:
            return math.nan
        return self._base[self._last_key]

    @property
    def budget(self) -> float:
        return self._budget(self.scale)

    def _budget(self, scale: float) -> float:
        if self.fixed_budget is not None:
            return self.fixed_budget
        if math.isnan(self.gain) or not self.settled:
            return max(self.min_budget, scale * self.initial_budget * self._drafted)
        gain = self.round_gain
        share_for_gain = gain / (1.0 + gain) if gain > 0 else 0.0
        return min(self.max_budget, max(self.min_budget, scale * share_for_gain))

    @property
    def held_rounds(self) -> int | None:
        """The rounds one update trains on at the last batch size (None: the latest round only,
        whatever the stride, so no stride drops a round it would have trained on)."""
        if self.window <= 1:
            return None
        return rounds_held(self.window, self.window_rows, self._last_batch)

    @property
    def round_gain(self) -> float:
        """The guard's gain (its lower bound) as a gain in tokens per round: g x (tau - 1) / tau, tau
        the tokens a round commits (slow EMA). The guard measures the drafts' acceptance, and a round's bonus token does
        not grow with it: at tau = 1.65 a +10% better drafter commits about +4% more tokens per round
        (first order; a conservative reading, as a chain's later positions gain a little more).
        With the hybrid, times the drafter's share of request-rounds: it gains nothing on the others."""
        tau = self._slow
        drafted = 1.0 if math.isnan(tau) else max(0.0, tau - 1.0) / max(tau, 1.0)
        return self.gain_bound * drafted * self._drafted

    @property
    def trend(self) -> float:
        if math.isnan(self._fast) or self._slow <= 0:
            return 0.0
        return self._fast / self._slow - 1.0

    def budget_stride(self, scale: float | None = None) -> int | None:
        """The shortest stride whose update share stays within the budget (None: not measured yet);
        `scale`: the budget at that scale instead of the governor's own."""
        base = self.base_round_s
        if math.isnan(self.cost_s) or math.isnan(base) or base <= 0:
            return None
        budget = self._budget(self.scale if scale is None else scale)
        needed = self.cost_s * (1.0 - budget) / (budget * base)
        return min(self.max_stride, max(self.min_stride, math.ceil(needed - 1e-9)))

    def decide(self) -> int:
        """The stride for the next window (call between rounds, with no update in flight)."""
        floor = self.budget_stride()
        if floor is None:
            if self.num_updates >= 2 and math.isnan(self.base_round_s):
                # Every round so far ran beside an update: lengthen the stride until one does not.
                self.stride = min(self.max_stride, self.stride + 1)
            return self.stride
        if self.trend < -self.trend_tolerance:
            stride = floor
        else:
            stride = min(max(self.stride + 1, floor), 2 * floor)
        held = self.held_rounds
        if held is not None and stride > held:
            # Past the window a longer stride trains on fewer of its rounds: stop at what the window
            # holds, unless even the whole gain (the budget at K = 1) cannot pay for that many updates.
            stride = max(held, self.budget_stride(1.0) or held)
        self.stride = min(self.max_stride, max(self.min_stride, stride))
        return self.stride

    def state(self) -> BudgetState:
        ms = 1e3
        return BudgetState(
            budget=self.budget,
            share=self.share,
            cost_ms=self.cost_s * ms,
            base_round_ms=self.base_round_s * ms,
            gain=self.gain,
            gain_bound=self.gain_bound,
            stride=self.stride,
            trend=self.trend,
            drafter_share=self.drafter_share,
        )

    @property
    def measured_share(self) -> float:
        """Whole-run share of serving time the updates took (0 before any round)."""
        return min(1.0, self.total_cost_s / self.total_round_s) if self.total_round_s > 0 else 0.0
