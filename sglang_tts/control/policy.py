"""Policies that map the controller's state to an action index: contextual bandits and a softmax policy.

Re-SpS trains PPO, but in its code every transition ends the episode (done=True, next value 0), so
the advantage is r - V(s) and gamma/lambda do nothing: it is a contextual bandit. The learners here
are bandits outright:

* ``LinUCBPolicy`` (kind "linucb", the default): one ridge regression per action of the transformed
  reward on the feature vector, optimism bonus alpha * sigma * sqrt(x' A^-1 x).
* ``LinearThompsonPolicy`` ("thompson"): the same regressions, a posterior sample per decision.
* ``SoftmaxPolicy`` ("softmax"): a linear softmax policy trained by REINFORCE with a linear baseline
  and an entropy bonus (Re-SpS's max-entropy PPO reduced to its one-step case); online only.
* ``StaticPolicy`` ("static"): always the same action: the best-static-configuration baseline.
* ``RoundRobinPolicy`` ("round_robin"): a scripted cycle through the actions (tests; trace collection).
* ``UniformPolicy`` ("uniform"): a seeded uniformly random action per decision: the logging policy for
  offline fitting (every action sees the same distribution of states, which a fixed cycle does not
  give: there each action always follows the same one).

Reward transform. Rewards are tokens per second, whose scale varies by orders of magnitude with
batch size and hardware; the bandits regress log(reward) (multiplicative effects of acceptance and
cost become additive, and argmax is unchanged). Each regression shrinks towards the mean transformed
reward of all decisions so far (a ridge prior on the bias weight), so an untried action is predicted
at the global mean plus its bonus rather than at 0. The noise scale sigma is estimated online from
the residuals (an EMA), so alpha is unit-free and the same default works across engines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from sglang_tts.control.actions import Action


@runtime_checkable
class ControllerPolicy(Protocol):
    """What the Controller needs from a policy."""

    actions: list[Action]

    def select(self, features: Any, explore: bool) -> int:
        """Index into `actions` for this state; explore=False: the policy's best guess."""
        ...

    def update(self, features: Any, action_index: int, reward: float) -> None:
        """Learn from one closed window: the state at decision time, the action, its reward."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, d: dict) -> None: ...


def as_vector(features: Any, dim: int | None = None) -> np.ndarray:
    """Features (numpy array, torch tensor or list) as a finite float64 vector of length `dim`."""
    if hasattr(features, "detach"):  # torch tensor, possibly on a device
        features = features.detach().cpu().numpy()
    x = np.asarray(features, dtype=np.float64).reshape(-1)
    if dim is not None and x.shape[0] != dim:
        raise ValueError(f"expected {dim} features, got {x.shape[0]}")
    if not np.all(np.isfinite(x)):
        raise ValueError("features contain NaN or Inf")
    return x


def transform_reward(reward: float, kind: str) -> float:
    if kind == "log":
        return math.log(max(float(reward), 1e-12))
    if kind == "none":
        return float(reward)
    raise ValueError(f"unknown reward transform {kind!r} (use 'log' or 'none')")


def _check_index(index: int, n: int) -> int:
    if not 0 <= int(index) < n:
        raise IndexError(f"action index {index} outside 0..{n - 1}")
    return int(index)


def _argmax_random_ties(values: np.ndarray, rng: np.random.Generator) -> int:
    best = np.flatnonzero(values >= values.max() - 1e-12)
    return int(best[0] if len(best) == 1 else rng.choice(best))


def _rng_state(rng: np.random.Generator) -> dict:
    return rng.bit_generator.state


def _rng_from_state(state: dict) -> np.random.Generator:
    bit_generator = getattr(np.random, state["bit_generator"])()
    bit_generator.state = state
    return np.random.Generator(bit_generator)


class _LinearBandit:
    """Per-action ridge regressions with a shared shrinkage target; see the module docstring."""

    kind: ClassVar[str] = ""

    def __init__(
        self,
        actions: Sequence[Action],
        dim: int,
        *,
        alpha: float = 1.0,
        ridge: float = 1.0,
        reward_transform: str = "log",
        noise_init: float = 0.5,
        noise_ema: float = 0.05,
        noise_floor: float = 0.02,
        bias_index: int | None = 0,
        seed: int = 0,
    ) -> None:
        if not actions:
            raise ValueError("a policy needs at least one action")
        if dim < 1 or ridge <= 0 or alpha < 0:
            raise ValueError(f"bad bandit settings: dim={dim}, ridge={ridge}, alpha={alpha}")
        transform_reward(1.0, reward_transform)  # validates the name
        self.actions = list(actions)
        self.dim = int(dim)
        self.alpha = float(alpha)
        self.ridge = float(ridge)
        self.reward_transform = reward_transform
        self.noise_ema = float(noise_ema)
        self.noise_floor = float(noise_floor)
        self.bias_index = bias_index
        self.seed = int(seed)
        k = len(self.actions)
        self.a_inv = np.repeat((np.eye(self.dim) / self.ridge)[None], k, axis=0)
        self.b = np.zeros((k, self.dim))
        self.counts = np.zeros(k, dtype=np.int64)
        self.y_sum = 0.0
        self.y_count = 0
        self.noise_var = float(noise_init) ** 2
        self.rng = np.random.default_rng(self.seed)

    # -- model -------------------------------------------------------------------------------------
    def prior_mean(self) -> float:
        return self.y_sum / self.y_count if self.y_count else 0.0

    def theta(self) -> np.ndarray:
        """Posterior mean weights, one row per action."""
        target = self.b.copy()
        if self.bias_index is not None:
            target[:, self.bias_index] += self.ridge * self.prior_mean()
        return np.einsum("kij,kj->ki", self.a_inv, target)

    def predict(self, features: Any) -> tuple[np.ndarray, np.ndarray]:
        """(mean, width) of the transformed reward per action; width = sqrt(x' A^-1 x)."""
        x = as_vector(features, self.dim)
        mean = self.theta() @ x
        width = np.sqrt(np.maximum(np.einsum("kij,i,j->k", self.a_inv, x, x), 0.0))
        return mean, width

    @property
    def sigma(self) -> float:
        return max(math.sqrt(self.noise_var), self.noise_floor)

    def select(self, features: Any, explore: bool) -> int:
        mean, width = self.predict(features)
        if not explore:
            return int(np.argmax(mean))
        return _argmax_random_ties(self._explore_scores(features, mean, width), self.rng)

    def _explore_scores(self, features: Any, mean: np.ndarray, width: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def update(self, features: Any, action_index: int, reward: float) -> None:
        x = as_vector(features, self.dim)
        a = _check_index(action_index, len(self.actions))
        y = transform_reward(reward, self.reward_transform)
        if not math.isfinite(y):
            return  # a broken timer must not poison the regression
        residual = y - float(self.theta()[a] @ x)
        self.noise_var += self.noise_ema * (residual * residual - self.noise_var)
        # Sherman-Morrison rank-one update of A^-1 (A = ridge * I + X'X for this action).
        ax = self.a_inv[a] @ x
        self.a_inv[a] -= np.outer(ax, ax) / (1.0 + float(x @ ax))
        self.a_inv[a] = 0.5 * (self.a_inv[a] + self.a_inv[a].T)  # keep it symmetric despite rounding
        self.b[a] += y * x
        self.counts[a] += 1
        self.y_sum += y
        self.y_count += 1

    # -- persistence -------------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        return {
            "dim": self.dim,
            "alpha": self.alpha,
            "ridge": self.ridge,
            "reward_transform": self.reward_transform,
            "noise_ema": self.noise_ema,
            "noise_floor": self.noise_floor,
            "bias_index": self.bias_index,
            "seed": self.seed,
        }

    def state_dict(self) -> dict:
        return {
            "config": self.config(),
            "a_inv": self.a_inv.tolist(),
            "b": self.b.tolist(),
            "counts": self.counts.tolist(),
            "y_sum": self.y_sum,
            "y_count": self.y_count,
            "noise_var": self.noise_var,
            "rng": _rng_state(self.rng),
        }

    def load_state_dict(self, d: dict) -> None:
        k, dim = len(self.actions), self.dim
        a_inv = np.asarray(d["a_inv"], dtype=np.float64)
        b = np.asarray(d["b"], dtype=np.float64)
        counts = np.asarray(d["counts"], dtype=np.int64)
        if a_inv.shape != (k, dim, dim) or b.shape != (k, dim) or counts.shape != (k,):
            raise ValueError(
                f"{self.kind} state has shapes a_inv {a_inv.shape}, b {b.shape}, counts {counts.shape}; "
                f"expected ({k}, {dim}, {dim}), ({k}, {dim}), ({k},) for {k} actions and {dim} features"
            )
        if not (np.all(np.isfinite(a_inv)) and np.all(np.isfinite(b))):
            raise ValueError(f"{self.kind} state contains NaN or Inf")
        self.a_inv, self.b, self.counts = a_inv, b, counts
        self.y_sum = float(d["y_sum"])
        self.y_count = int(d["y_count"])
        self.noise_var = float(d["noise_var"])
        if "rng" in d:
            self.rng = _rng_from_state(d["rng"])

    @classmethod
    def from_state_dict(cls, actions: Sequence[Action], d: dict) -> _LinearBandit:
        policy = cls(actions, **d["config"])
        policy.load_state_dict(d)
        return policy


class LinUCBPolicy(_LinearBandit):
    """Disjoint LinUCB over the feature vector (see the module docstring)."""

    kind = "linucb"

    def _explore_scores(self, features: Any, mean: np.ndarray, width: np.ndarray) -> np.ndarray:
        return mean + self.alpha * self.sigma * width


class LinearThompsonPolicy(_LinearBandit):
    """Linear Thompson sampling: theta_a ~ N(mean_a, (alpha * sigma)^2 A_a^-1) at every decision."""

    kind = "thompson"

    def _explore_scores(self, features: Any, mean: np.ndarray, width: np.ndarray) -> np.ndarray:
        # Sampling theta and projecting on x equals sampling the prediction: N(mean, (alpha sigma width)^2).
        return mean + self.alpha * self.sigma * width * self.rng.standard_normal(len(self.actions))


class SoftmaxPolicy:
    """Linear softmax policy trained online by REINFORCE with a linear value baseline and an entropy
    bonus. A bandit's one-step REINFORCE is what Re-SpS's PPO reduces to (every transition ends its
    episode); it learns only from its own (on-policy) decisions, so it is not fitted offline."""

    kind: ClassVar[str] = "softmax"

    def __init__(
        self,
        actions: Sequence[Action],
        dim: int,
        *,
        lr: float = 0.1,
        baseline_lr: float = 0.1,
        entropy_coef: float = 0.01,
        temperature: float = 1.0,
        reward_transform: str = "log",
        seed: int = 0,
    ) -> None:
        if not actions:
            raise ValueError("a policy needs at least one action")
        transform_reward(1.0, reward_transform)
        self.actions = list(actions)
        self.dim = int(dim)
        self.lr, self.baseline_lr = float(lr), float(baseline_lr)
        self.entropy_coef, self.temperature = float(entropy_coef), float(temperature)
        self.reward_transform = reward_transform
        self.seed = int(seed)
        self.weights = np.zeros((len(self.actions), self.dim))
        self.value = np.zeros(self.dim)
        self.adv_var = 1.0
        self.rng = np.random.default_rng(self.seed)

    def probs(self, features: Any) -> np.ndarray:
        logits = self.weights @ as_vector(features, self.dim) / self.temperature
        p = np.exp(logits - logits.max())
        return p / p.sum()

    def select(self, features: Any, explore: bool) -> int:
        p = self.probs(features)
        return int(self.rng.choice(len(p), p=p)) if explore else int(np.argmax(p))

    def update(self, features: Any, action_index: int, reward: float) -> None:
        x = as_vector(features, self.dim)
        a = _check_index(action_index, len(self.actions))
        y = transform_reward(reward, self.reward_transform)
        if not math.isfinite(y):
            return
        scale = 1.0 / max(float(x @ x), 1.0)  # normalised step: feature vectors of any norm behave alike
        advantage = y - float(self.value @ x)
        self.value += self.baseline_lr * scale * advantage * x
        self.adv_var += 0.05 * (advantage * advantage - self.adv_var)
        advantage /= math.sqrt(self.adv_var) + 1e-8
        p = self.probs(x)
        grad_logp = -p
        grad_logp[a] += 1.0
        entropy = -float(np.sum(p * np.log(p + 1e-12)))
        grad_entropy = -p * (np.log(p + 1e-12) + entropy)
        self.weights += self.lr * scale * np.outer(advantage * grad_logp + self.entropy_coef * grad_entropy, x)

    def config(self) -> dict[str, Any]:
        return {
            "dim": self.dim,
            "lr": self.lr,
            "baseline_lr": self.baseline_lr,
            "entropy_coef": self.entropy_coef,
            "temperature": self.temperature,
            "reward_transform": self.reward_transform,
            "seed": self.seed,
        }

    def state_dict(self) -> dict:
        return {
            "config": self.config(),
            "weights": self.weights.tolist(),
            "value": self.value.tolist(),
            "adv_var": self.adv_var,
            "rng": _rng_state(self.rng),
        }

    def load_state_dict(self, d: dict) -> None:
        weights = np.asarray(d["weights"], dtype=np.float64)
        value = np.asarray(d["value"], dtype=np.float64)
        if weights.shape != (len(self.actions), self.dim) or value.shape != (self.dim,):
            raise ValueError(
                f"softmax state has shapes weights {weights.shape}, value {value.shape}; "
                f"expected ({len(self.actions)}, {self.dim}), ({self.dim},)"
            )
        if not (np.all(np.isfinite(weights)) and np.all(np.isfinite(value))):
            raise ValueError("softmax state contains NaN or Inf")
        self.weights, self.value = weights, value
        self.adv_var = float(d["adv_var"])
        if "rng" in d:
            self.rng = _rng_from_state(d["rng"])

    @classmethod
    def from_state_dict(cls, actions: Sequence[Action], d: dict) -> SoftmaxPolicy:
        policy = cls(actions, **d["config"])
        policy.load_state_dict(d)
        return policy


class StaticPolicy:
    """Always the same action (the best-static-configuration baseline); learns nothing."""

    kind: ClassVar[str] = "static"

    def __init__(self, actions: Sequence[Action], index: int = 0) -> None:
        if not actions:
            raise ValueError("a policy needs at least one action")
        self.actions = list(actions)
        self.index = _check_index(index, len(self.actions))

    def select(self, features: Any, explore: bool) -> int:
        return self.index

    def update(self, features: Any, action_index: int, reward: float) -> None:
        return None

    def state_dict(self) -> dict:
        return {"config": {"index": self.index}}

    def load_state_dict(self, d: dict) -> None:
        self.index = _check_index(d["config"]["index"], len(self.actions))

    @classmethod
    def from_state_dict(cls, actions: Sequence[Action], d: dict) -> StaticPolicy:
        return cls(actions, **d["config"])


class RoundRobinPolicy:
    """Cycles through `order` (action indices; default every action in turn), one entry per decision.

    Scripted, not learnt: for collecting traces that cover every action evenly (the logging policy
    for offline training: each action is tried in every kind of state) and for tests that need the
    engine to switch configurations at known points. It ignores the state and the reward."""

    kind: ClassVar[str] = "round_robin"

    def __init__(self, actions: Sequence[Action], order: Sequence[int] | None = None, position: int = 0) -> None:
        if not actions:
            raise ValueError("a policy needs at least one action")
        self.actions = list(actions)
        self.order = [
            _check_index(i, len(self.actions)) for i in (range(len(self.actions)) if order is None else order)
        ]
        if not self.order:
            raise ValueError("round_robin needs a non-empty order")
        self.position = int(position)

    def select(self, features: Any, explore: bool) -> int:
        index = self.order[self.position % len(self.order)]
        self.position += 1
        return index

    def update(self, features: Any, action_index: int, reward: float) -> None:
        return None

    def state_dict(self) -> dict:
        return {"config": {"order": list(self.order)}, "position": self.position}

    def load_state_dict(self, d: dict) -> None:
        self.order = [_check_index(i, len(self.actions)) for i in d["config"]["order"]]
        if not self.order:
            raise ValueError("round_robin needs a non-empty order")
        self.position = int(d.get("position", 0))

    @classmethod
    def from_state_dict(cls, actions: Sequence[Action], d: dict) -> RoundRobinPolicy:
        policy = cls(actions, **d["config"])
        policy.load_state_dict(d)
        return policy


class UniformPolicy:
    """A uniformly random action per decision, from a seeded generator saved with the policy.

    Scripted, not learnt: the logging policy for offline fitting. With a fixed cycle (round_robin) each
    action always follows the same one, so the state it is tried in (acceptance EMA, the chain the
    engine was running) depends on its predecessor; random choice gives every action the same state
    distribution, which the per-action regressions of the bandits assume."""

    kind: ClassVar[str] = "uniform"

    def __init__(self, actions: Sequence[Action], seed: int = 0) -> None:
        if not actions:
            raise ValueError("a policy needs at least one action")
        self.actions = list(actions)
        self.seed = int(seed)
        self.rng = np.random.default_rng(self.seed)

    def select(self, features: Any, explore: bool) -> int:
        return int(self.rng.integers(len(self.actions)))

    def update(self, features: Any, action_index: int, reward: float) -> None:
        return None

    def state_dict(self) -> dict:
        return {"config": {"seed": self.seed}, "rng": _rng_state(self.rng)}

    def load_state_dict(self, d: dict) -> None:
        self.seed = int(d["config"]["seed"])
        self.rng = _rng_from_state(d["rng"]) if "rng" in d else np.random.default_rng(self.seed)

    @classmethod
    def from_state_dict(cls, actions: Sequence[Action], d: dict) -> UniformPolicy:
        policy = cls(actions, **d["config"])
        policy.load_state_dict(d)
        return policy


# kind -> class; every class has from_state_dict(actions, state) and the ControllerPolicy methods.
POLICY_KINDS: dict[str, type] = {
    cls.kind: cls
    for cls in (LinUCBPolicy, LinearThompsonPolicy, SoftmaxPolicy, StaticPolicy, RoundRobinPolicy, UniformPolicy)
}
# Kinds whose select() reads the feature vector (their state has the feature dimension in it).
STATEFUL_KINDS = ("linucb", "thompson", "softmax")
SEEDED_KINDS = (*STATEFUL_KINDS, "uniform")  # kinds that take a seed


def make_policy(kind: str, actions: Sequence[Action], dim: int, **kwargs: Any) -> ControllerPolicy:
    """A fresh policy by kind name: "linucb", "thompson", "softmax" (learners, need `dim`), "static"
    (index=) or "round_robin" (order=)."""
    if kind in STATEFUL_KINDS:
        return POLICY_KINDS[kind](actions, dim, **kwargs)
    if kind in POLICY_KINDS:
        return POLICY_KINDS[kind](actions, **kwargs)
    raise ValueError(f"unknown policy kind {kind!r}; known: {', '.join(POLICY_KINDS)}")
