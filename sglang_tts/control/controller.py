"""The Controller: holds an action for `persistence` rounds, scores the window, asks the policy again.

Per verify round the engine calls ``controller.observe(obs)``. Every `persistence` (non-idle) rounds
the window closes:

    reward  = tokens committed by the batch in the window / seconds of the window
              seconds = the whole rounds (draft + verify + barrier/update wait), unlike Re-SpS's code
              whose timer misses drafting; reward="cost_model" divides by the fitted cost model's
              predicted seconds instead (timing noise does not reach the learner; acceptance noise does)
    policy.update(state at the decision, action, reward)        if config.learn
    next    = policy.select(state now, explore=config.explore)  and observe() returns it

Re-SpS's "action caching": one decision per window and the reward of the whole window as one
transition. Unlike Re-SpS's mean of per-step tokens/s (Eq. 5), the reward here is a ratio of sums,
which is the throughput the window actually achieved. Idle rounds (no requests) are ignored and do not
count towards the window. ``flush()`` closes a partial window (end of a workload), as Re-SpS flushes
at the end of a turn. The action takes effect when the engine switches to it; rounds the engine ran
with another chain length are counted in the window's `mismatched_rounds` (their time and tokens
still count: they are what the decision led to).

Not thread-safe: call it from the scheduler thread only.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sglang_tts.control.actions import Action, uses_suffix
from sglang_tts.control.cost import CostModel
from sglang_tts.control.observation import Observation, StateTracker
from sglang_tts.control.policy import ControllerPolicy

TRACE_FORMAT = "sglang-tts-controller-trace"
TRACE_VERSION = 1
REWARDS = ("tokens_per_second", "cost_model")


@dataclass
class ControllerConfig:
    persistence: int = 8  # rounds per decision (action persistence); Re-SpS: 10 training, 30 inference
    explore: bool = True  # policy.select(explore=...): False = the policy's greedy choice
    learn: bool = True  # update the policy online at each closed window
    reward: str = "tokens_per_second"  # or "cost_model": tokens / predicted seconds (needs cost_model)
    cost_model: CostModel | dict | None = None  # fitted round-time model (see cost.py)
    initial_action: Action | None = None  # None: the policy's choice on the empty state
    ema_alpha: float = 0.2  # StateTracker smoothing
    max_trace: int | None = 100_000  # records kept for write_trace (oldest dropped); 0 disables the trace

    def __post_init__(self) -> None:
        if int(self.persistence) < 1:
            raise ValueError(f"ControllerConfig.persistence must be >= 1, got {self.persistence}")
        if self.reward not in REWARDS:
            raise ValueError(f"ControllerConfig.reward must be one of {REWARDS}, got {self.reward!r}")
        if isinstance(self.cost_model, dict):
            self.cost_model = CostModel.from_dict(self.cost_model)
        if self.reward == "cost_model" and self.cost_model is None:
            raise ValueError('ControllerConfig.reward="cost_model" needs a cost_model')
        if self.max_trace is not None and self.max_trace < 0:
            raise ValueError(f"ControllerConfig.max_trace must be >= 0 or None, got {self.max_trace}")


@dataclass
class _Window:
    rounds: int = 0
    tokens: int = 0
    requests: int = 0
    seconds: float = 0.0
    predicted_seconds: float = 0.0
    update_seconds: float = 0.0
    batch_sum: float = 0.0
    position_sum: float = 0.0
    steps_sum: float = 0.0
    mismatched_rounds: int = 0
    suffix_offer_sum: float = 0.0
    suffix_rounds: int = 0
    losses: list[float] = field(default_factory=list)


class Controller:
    """Drives a ControllerPolicy from the engine's per-round Observations (see the module docstring)."""

    def __init__(self, policy: ControllerPolicy, config: ControllerConfig, max_steps: int) -> None:
        self.policy = policy
        self.config = config
        self.max_steps = int(max_steps)
        self.tracker = StateTracker(self.max_steps, ema_alpha=config.ema_alpha, suffix=uses_suffix(policy.actions))
        too_long = [str(a) for a in policy.actions if a.num_steps > self.max_steps]
        if too_long:
            raise ValueError(f"actions {too_long} draft more than max_steps={self.max_steps} steps")
        policy_dim = getattr(policy, "dim", None)
        if policy_dim is not None and policy_dim != self.tracker.dim:
            raise ValueError(
                f"policy expects {policy_dim} features but max_steps={self.max_steps} gives {self.tracker.dim}"
            )
        self.trace: deque[dict[str, Any]] = deque(maxlen=config.max_trace)
        self._counts: Counter[int] = Counter()
        self._decisions = 0
        self._rounds = 0
        self._last_reward: float | None = None
        self._reward_sum = 0.0
        self._window = _Window()
        features = self.tracker.features()
        if config.initial_action is not None:
            if config.initial_action not in policy.actions:
                raise ValueError(f"initial action {config.initial_action} is not in the policy's action set")
            self._index = policy.actions.index(config.initial_action)
        else:
            self._index = int(policy.select(features, config.explore))
        self._decision_features = features
        self._counts[self._index] += 1

    # -- per round ---------------------------------------------------------------------------------
    @property
    def current(self) -> Action:
        """The action in force (the engine should run it until observe() returns another)."""
        return self.policy.actions[self._index]

    def observe(self, obs: Observation) -> Action | None:
        """Fold one round in; at the end of a window return the next action (possibly the same one)."""
        if not obs.accept_lengths or obs.batch_size <= 0:
            return None
        self.tracker.observe(obs)
        self._rounds += 1
        w = self._window
        w.rounds += 1
        w.tokens += obs.tokens
        w.requests += len(obs.accept_lengths)
        w.seconds += max(float(obs.round_seconds), 0.0)
        w.update_seconds += max(float(obs.update_seconds), 0.0)
        w.batch_sum += obs.batch_size
        w.position_sum += obs.output_position
        w.steps_sum += obs.num_steps
        w.mismatched_rounds += int(obs.num_steps != self.current.num_steps)
        if obs.tts_loss is not None and math.isfinite(obs.tts_loss):
            w.losses.append(float(obs.tts_loss))
        if obs.suffix_offered is not None and math.isfinite(obs.suffix_offered):
            w.suffix_offer_sum += float(obs.suffix_offered)
            w.suffix_rounds += 1
        if self.config.cost_model is not None:
            w.predicted_seconds += self.config.cost_model.predict(
                obs.num_steps, obs.batch_size, self.current.update_stride
            )
        if w.rounds < self.config.persistence:
            return None
        return self._close_window()

    def flush(self) -> Action | None:
        """Close a partial window now (end of a workload); None if it is empty."""
        return self._close_window() if self._window.rounds else None

    def _close_window(self) -> Action:
        w = self._window
        seconds = w.predicted_seconds if self.config.reward == "cost_model" else w.seconds
        reward = w.tokens / max(seconds, 1e-9)
        if self.config.learn:
            self.policy.update(self._decision_features, self._index, reward)
        if self.config.max_trace != 0:
            self.trace.append(self._record(reward))
        self._decisions += 1
        self._last_reward = reward
        self._reward_sum += reward
        features = self.tracker.features()
        self._index = int(self.policy.select(features, self.config.explore))
        self._decision_features = features
        self._counts[self._index] += 1
        self._window = _Window()
        return self.current

    def _record(self, reward: float) -> dict[str, Any]:
        w = self._window
        action = self.current
        return {
            "decision": self._decisions,
            "features": np.asarray(self._decision_features, dtype=np.float64).tolist(),
            "action_index": self._index,
            "action": action.to_dict(),
            "reward": reward,
            "explore": self.config.explore,
            "window": {
                "rounds": w.rounds,
                "tokens": w.tokens,
                "requests": w.requests,
                "seconds": w.seconds,
                "predicted_seconds": w.predicted_seconds if self.config.cost_model is not None else None,
                "update_seconds": w.update_seconds,
                "num_steps": w.steps_sum / w.rounds,
                "update_stride": action.update_stride,
                "mean_batch_size": w.batch_sum / w.rounds,
                "mean_output_position": w.position_sum / w.rounds,
                "mean_accept_length": w.tokens / max(w.requests, 1),
                "mismatched_rounds": w.mismatched_rounds,
                "mean_tts_loss": float(np.mean(w.losses)) if w.losses else None,
                "mean_suffix_offer": w.suffix_offer_sum / w.suffix_rounds if w.suffix_rounds else None,
            },
        }

    # -- reporting ---------------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, Any]:
        """Decisions so far, how often each action was chosen (incl. the one in force), rewards."""
        return {
            "decisions": self._decisions,
            "rounds": self._rounds,
            "current": str(self.current),
            "action_counts": {str(self.policy.actions[i]): n for i, n in sorted(self._counts.items())},
            "last_reward": self._last_reward,
            "mean_reward": self._reward_sum / self._decisions if self._decisions else None,
        }

    def keep_trace(self, records: int | None) -> None:
        """Keep at most this many trace records in memory from now on (0: none; None: all); a
        server writes each record to its trace file as it is made and needs only the latest."""
        self.config = dataclasses.replace(self.config, max_trace=records)
        self.trace = deque(self.trace, maxlen=records) if records != 0 else deque(maxlen=0)

    def trace_header(self) -> dict[str, Any]:
        return {
            "type": "header",
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "max_steps": self.max_steps,
            "feature_names": list(self.tracker.names),
            "actions": [a.to_dict() for a in self.policy.actions],
            "persistence": self.config.persistence,
            "reward": self.config.reward,
            "policy_kind": getattr(self.policy, "kind", type(self.policy).__name__),
        }

    def write_trace(self, path: str | Path, append: bool = False) -> int:
        """Write the trace as JSONL: a header line, then one line per closed window. Returns the
        number of records written. append=True adds records to an existing file (no new header)."""
        path = Path(path)
        add_header = not (append and path.exists() and path.stat().st_size > 0)
        with path.open("a" if append else "w") as f:
            if add_header:
                f.write(json.dumps(self.trace_header()) + "\n")
            for record in self.trace:
                f.write(json.dumps({"type": "decision", **record}) + "\n")
        return len(self.trace)


def read_trace(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(header, decision records) of a JSONL trace written by Controller.write_trace."""
    header: dict[str, Any] | None = None
    records: list[dict[str, Any]] = []
    with Path(path).open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not JSON ({e})") from e
            if item.get("type") == "header":
                if item.get("format") != TRACE_FORMAT or item.get("version") != TRACE_VERSION:
                    raise ValueError(
                        f"{path}:{line_no}: trace format {item.get('format')!r} v{item.get('version')}, "
                        f"expected {TRACE_FORMAT!r} v{TRACE_VERSION}"
                    )
                if header is not None and item != header:
                    if (item["feature_names"], item["actions"]) != (header["feature_names"], header["actions"]):
                        raise ValueError(f"{path}:{line_no}: a second header with other features or actions")
                header = header or item
            elif item.get("type") == "decision":
                records.append(item)
    if header is None:
        raise ValueError(f"{path}: no trace header")
    return header, records
