"""A synthetic serving environment with a known best action per context, for testing and pre-training.

Contexts (2 x 3 x 2 = 12): acceptance regime high/low x batch size 1/4/8 x output position
early/late. Per verify round with action (n, S) and batch b:

* acceptance: draft position k is accepted with probability rate_k = p * depth_decay^(k-1), until the
  first rejection (chain verification), so a request commits 1 + (accepted drafts) tokens, at most
  n + 1. Late in long outputs the frozen drafter has drifted: p falls by `late_drift`, and TTS updates
  win it back the more often they run: p_late(S) = p * (1 - late_drift * (1 - S^-1/2)). Early in the
  output there is nothing to win back, so the stride there only costs.
* round time: t0 + t_draft * n * (1 + draft_batch_slope * b) + t_verify * (1 + verify_token_slope *
  b * (n + 1)) + [n > 0] * t_update * (1 + update_batch_slope * b) / S, times lognormal noise.
  Verify cost grows with the b * (n + 1) verified tokens, so deep chains stop paying at large batch.

The best action per context is computed exactly (expected tokens / expected time); the defaults make
it differ across contexts in both chain length and stride. Simplifications: acceptance reacts to the
stride at once (a real drafter adapts over many rounds) and per-position rates are the same for every
request of a batch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from sglang_tts.control.actions import Action, action_grid
from sglang_tts.control.controller import Controller
from sglang_tts.control.observation import Observation

DEFAULT_STEPS = (0, 1, 3, 6)
DEFAULT_STRIDES = (1, 4, 16)


@dataclass(frozen=True)
class Context:
    regime: str  # "high" | "low" acceptance
    batch_size: int
    phase: str  # "early" | "late" in the output

    def __str__(self) -> str:
        return f"{self.regime}/b{self.batch_size}/{self.phase}"


@dataclass(frozen=True)
class SyntheticConfig:
    accept_rate: tuple[tuple[str, float], ...] = (("high", 0.89), ("low", 0.57))
    batch_sizes: tuple[int, ...] = (1, 4, 8)
    depth_decay: float = 0.97
    late_drift: float = 0.38
    early_position: tuple[float, float] = (50.0, 500.0)
    late_position: tuple[float, float] = (4000.0, 12000.0)
    t0: float = 0.0083
    t_draft: float = 0.0018
    draft_batch_slope: float = 0.11
    t_verify: float = 0.010
    verify_token_slope: float = 0.099
    t_update: float = 0.0133
    update_batch_slope: float = 0.09
    noise_sigma: float = 0.08  # lognormal sigma of each round's time
    steps: tuple[int, ...] = DEFAULT_STEPS
    strides: tuple[int, ...] = DEFAULT_STRIDES

    @property
    def max_steps(self) -> int:
        return max(self.steps)

    def actions(self) -> list[Action]:
        return action_grid(self.steps, self.strides)

    def contexts(self) -> list[Context]:
        regimes = [r for r, _ in self.accept_rate]
        return [Context(r, b, ph) for r, b, ph in itertools.product(regimes, self.batch_sizes, ("early", "late"))]

    # -- the model ---------------------------------------------------------------------------------
    def rates(self, ctx: Context, action: Action) -> np.ndarray:
        """Per-position acceptance rate_1..rate_n under this action."""
        p = dict(self.accept_rate)[ctx.regime]
        if ctx.phase == "late":
            p *= 1.0 - self.late_drift * (1.0 - action.update_stride**-0.5)
        return p * self.depth_decay ** np.arange(action.num_steps)

    def mean_round_seconds(self, ctx: Context, action: Action) -> float:
        n, b, s = action.num_steps, ctx.batch_size, action.update_stride
        seconds = self.t0 + self.t_draft * n * (1 + self.draft_batch_slope * b)
        seconds += self.t_verify * (1 + self.verify_token_slope * b * (n + 1))
        if n > 0:
            seconds += self.t_update * (1 + self.update_batch_slope * b) / s
        return seconds

    def update_seconds(self, ctx: Context, action: Action) -> float:
        """The amortised update time on the serving path per round (reported in Observations)."""
        if action.num_steps == 0:
            return 0.0
        return self.t_update * (1 + self.update_batch_slope * ctx.batch_size) / action.update_stride

    def expected_reward(self, ctx: Context, action: Action) -> float:
        """Expected tokens per second of the batch (noise has mean 1)."""
        tokens = ctx.batch_size * (1.0 + float(np.sum(np.cumprod(self.rates(ctx, action)))))
        return tokens / self.mean_round_seconds(ctx, action)

    def reward_table(self) -> dict[Context, np.ndarray]:
        actions = self.actions()
        return {c: np.array([self.expected_reward(c, a) for a in actions]) for c in self.contexts()}

    def best_action_index(self, ctx: Context) -> int:
        return int(np.argmax([self.expected_reward(ctx, a) for a in self.actions()]))


@dataclass
class SyntheticEnv:
    """Stochastic rounds from a SyntheticConfig; the context changes every `episode_rounds` rounds."""

    config: SyntheticConfig = field(default_factory=SyntheticConfig)
    episode_rounds: int = 320
    seed: int = 0

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.contexts = self.config.contexts()
        self.context = self.contexts[0]
        self.round_in_episode = 0
        self.episode = 0
        self._position = 0.0
        self.new_episode()

    def new_episode(self, context: Context | None = None) -> None:
        self.context = context or self.contexts[int(self.rng.integers(len(self.contexts)))]
        lo, hi = self.config.early_position if self.context.phase == "early" else self.config.late_position
        self._position = float(self.rng.uniform(lo, hi))
        self.round_in_episode = 0
        self.episode += 1

    def step(self, action: Action) -> Observation:
        """One verify round under `action`; switches context first when the episode is over."""
        if self.round_in_episode >= self.episode_rounds:
            self.new_episode()
        cfg, ctx = self.config, self.context
        b, n = ctx.batch_size, action.num_steps
        if n > 0:
            accepted = self.rng.random((b, n)) < cfg.rates(ctx, action)
            drafts = np.cumprod(accepted, axis=1).sum(axis=1)
        else:
            drafts = np.zeros(b, dtype=np.int64)
        accept_lengths = (drafts + 1).astype(int).tolist()
        noise = math.exp(cfg.noise_sigma * float(self.rng.standard_normal()) - 0.5 * cfg.noise_sigma**2)
        seconds = cfg.mean_round_seconds(ctx, action) * noise
        obs = Observation(
            accept_lengths=accept_lengths,
            num_steps=n,
            batch_size=b,
            output_position=self._position,
            round_seconds=seconds,
            update_seconds=cfg.update_seconds(ctx, action),
            tts_loss=None,
        )
        self._position += float(np.mean(accept_lengths))
        self.round_in_episode += 1
        return obs


@dataclass
class Decision:
    """One closed window of a synthetic run."""

    context: Context
    action_index: int
    best_index: int
    expected_reward: float  # of the action that ran, in its context
    oracle_reward: float  # of the best action in that context
    measured_reward: float
    windows_since_switch: int


@dataclass
class RunSummary:
    decisions: list[Decision]

    def tail(self, fraction: float) -> list[Decision]:
        return self.decisions[int(len(self.decisions) * (1.0 - fraction)) :]

    @staticmethod
    def accuracy(decisions: Sequence[Decision]) -> float:
        return float(np.mean([d.action_index == d.best_index for d in decisions])) if decisions else float("nan")

    @staticmethod
    def oracle_ratio(decisions: Sequence[Decision]) -> float:
        """Expected throughput achieved / the oracle's, both as total tokens over total time (each
        decision weighted equally: the mean of per-window ratios would favour small batches)."""
        if not decisions:
            return float("nan")
        return float(sum(d.expected_reward for d in decisions) / sum(d.oracle_reward for d in decisions))


def run_controller(controller: Controller, env: SyntheticEnv, windows: int, progress: bool = False) -> RunSummary:
    """Run `controller` in `env` for `windows` closed windows; score every window's action against the
    known best one of the context the window ran in (the context of its last round)."""
    cfg = env.config
    actions = controller.policy.actions
    decisions: list[Decision] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=windows, desc="synthetic windows", unit="win", leave=False)
    last_episode, since_switch = env.episode, 0
    while len(decisions) < windows:
        action = controller.current
        index = controller._index
        obs = env.step(action)
        if controller.observe(obs) is None:
            continue
        ctx = env.context
        if env.episode != last_episode:
            last_episode, since_switch = env.episode, 0
        best = cfg.best_action_index(ctx)
        decisions.append(
            Decision(
                context=ctx,
                action_index=index,
                best_index=best,
                expected_reward=cfg.expected_reward(ctx, actions[index]),
                oracle_reward=cfg.expected_reward(ctx, actions[best]),
                measured_reward=float(controller.stats["last_reward"]),
                windows_since_switch=since_switch,
            )
        )
        since_switch += 1
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return RunSummary(decisions)
