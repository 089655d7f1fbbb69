"""What the engine reports per verify round (Observation) and the controller's state (StateTracker).

The state is a small fixed-size vector of cheap CPU-side statistics, not Re-SpS's 4096-d hidden
state: Re-SpS's code feeds the mean-pooled EAGLE-3 features of the last accepted token and nothing
else (no load, no acceptance history); in a batched server the best draft budget depends mainly on
load and on acceptance (SpecActor, Seer), and those are what this vector carries.

Feature order (`feature_names(max_steps, suffix)`, M = max_steps; dim = 2 * M + 7, + 2 with suffix):

    bias                     1.0
    accept_ema               EMA of the batch-mean accepted length (bonus incl.) / (M + 1), over
                             drafting rounds only (a no-drafting round commits 1 token by construction)
    rate_1 .. rate_M         per-position conditional acceptance P(draft k accepted | draft k-1
                             accepted), from decayed counts over the rounds that drafted position k
                             (RADAR/Re-SpS style); a position not drafted lately shrinks towards the
                             rate of the position before it (prior 0.5 at position 1); rounds without
                             drafting age every count, so all rates drift back to the prior
    log_batch                log2(batch_size) / 8          (0 at 1 request, 1 at 256)
    inv_batch                1 / batch_size                (fixed per-round costs amortise as 1/b)
    log_position             log2(1 + output_position) / 16
    loss_ema                 EMA of log(1 + TTS loss), 0 until a loss is reported
    update_share             EMA of update_seconds / round_seconds (update time on the serving path)
    log_tokens_1 .. _M       log(E_n) / log(M + 1), E_n = 1 + sum_{k<=n} prod_{j<=k} rate_j: expected
                             tokens per request per round at chain length n under the current rates
                             (RADAR's quantity; it makes log throughput nearly linear in the state)
    suffix_offer             (suffix=True: action sets with the proposer axis) EMA of the share of the
                             batch's requests the suffix proposer offered a chain of the rule's length
    suffix_expected          EMA of the suffix proposer's expected accepted tokens per request / chain
                             length (core/hybrid.py's per-request record; scored in every mode)

All entries are finite and roughly in [0, 1]; features() returns a fresh float64 numpy array.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

RATE_PRIOR = 0.5  # acceptance assumed at position 1 before any evidence
RATE_PSEUDO_COUNT = 1.0  # weight of the prior (and of the previous position's rate) in rate_k


@dataclass
class Observation:
    """What the engine reports each verify round (cheap, CPU-side)."""

    accept_lengths: list[int]  # per request in the batch: tokens committed this round (bonus incl.)
    num_steps: int  # the chain length used this round
    batch_size: int
    output_position: float  # mean number of output tokens generated so far by the batch's requests
    round_seconds: float  # wall time of this round (draft + verify + any barrier wait)
    update_seconds: float  # update time that ran on the serving path this round (sync/barrier wait), 0 otherwise
    tts_loss: float | None = None  # last TTS loss if known
    suffix_offered: float | None = None  # share of the batch with a suffix chain offered (hybrid only)
    suffix_expected: float | None = None  # suffix proposer's expected accepted tokens / chain length

    @property
    def tokens(self) -> int:
        """Tokens committed this round by the whole batch."""
        return int(sum(self.accept_lengths))


SUFFIX_FEATURES = ("suffix_offer", "suffix_expected")


def feature_names(max_steps: int, suffix: bool = False) -> list[str]:
    """Names of the StateTracker features, in order (see the module docstring); `suffix`: with the
    suffix proposer's two (an action set with the proposer axis)."""
    m = int(max_steps)
    return [
        "bias",
        "accept_ema",
        *[f"rate_{k}" for k in range(1, m + 1)],
        "log_batch",
        "inv_batch",
        "log_position",
        "loss_ema",
        "update_share",
        *[f"log_tokens_{k}" for k in range(1, m + 1)],
        *(SUFFIX_FEATURES if suffix else ()),
    ]


def expected_tokens(rates: np.ndarray) -> np.ndarray:
    """E_n for n = 0..len(rates): expected committed tokens per request at chain length n (bonus incl.).

    A draft position counts only if every position before it was accepted (chain verification), so
    E_n = 1 + sum_{k<=n} prod_{j<=k} rate_j.
    """
    survive = np.cumprod(np.asarray(rates, dtype=np.float64))
    return np.concatenate(([1.0], 1.0 + np.cumsum(survive)))


@dataclass
class _Ema:
    alpha: float
    value: float | None = None

    def update(self, x: float) -> None:
        self.value = x if self.value is None else (1.0 - self.alpha) * self.value + self.alpha * x

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


@dataclass
class StateTracker:
    """Turns the stream of Observations into a fixed-size feature vector (order: module docstring)."""

    max_steps: int
    ema_alpha: float = 0.2
    # Decay per round of the per-position counts (those drafted; all of them on no-drafting rounds); slower
    # than ema_alpha because one round of a small batch gives only a few Bernoulli samples per position.
    # None: 1 - ema_alpha / 4.
    rate_decay: float | None = None
    suffix: bool = False  # carry the suffix proposer's features (SUFFIX_FEATURES)
    rounds: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if int(self.max_steps) < 1:
            raise ValueError(f"StateTracker.max_steps must be >= 1, got {self.max_steps}")
        if not 0.0 < self.ema_alpha <= 1.0:
            raise ValueError(f"StateTracker.ema_alpha must be in (0, 1], got {self.ema_alpha}")
        self.max_steps = int(self.max_steps)
        if self.rate_decay is None:
            self.rate_decay = 1.0 - self.ema_alpha / 4.0
        if not 0.0 < self.rate_decay <= 1.0:
            raise ValueError(f"StateTracker.rate_decay must be in (0, 1], got {self.rate_decay}")
        self.names = feature_names(self.max_steps, self.suffix)
        self._accept = _Ema(self.ema_alpha)
        self._suffix_offer = _Ema(self.ema_alpha)
        self._suffix_expected = _Ema(self.ema_alpha)
        self._loss = _Ema(self.ema_alpha)
        self._update_share = _Ema(self.ema_alpha)
        self._num = np.zeros(self.max_steps)  # decayed count of requests that accepted draft k
        self._den = np.zeros(self.max_steps)  # decayed count of requests that reached draft k
        self._batch_size = 1
        self._position = 0.0

    @property
    def dim(self) -> int:
        return len(self.names)

    def observe(self, obs: Observation) -> None:
        """Fold one verify round into the state. Rounds without requests are ignored."""
        if not obs.accept_lengths or obs.batch_size <= 0:
            return
        self.rounds += 1
        self._batch_size = max(int(obs.batch_size), 1)
        self._position = max(float(obs.output_position), 0.0)
        if obs.round_seconds > 0 and math.isfinite(obs.round_seconds):
            share = min(max(obs.update_seconds, 0.0) / obs.round_seconds, 1.0)
            self._update_share.update(share if math.isfinite(share) else 0.0)
        if obs.tts_loss is not None and math.isfinite(obs.tts_loss):
            self._loss.update(math.log1p(max(obs.tts_loss, 0.0)))
        for ema, value in ((self._suffix_offer, obs.suffix_offered), (self._suffix_expected, obs.suffix_expected)):
            if value is not None and math.isfinite(value):
                ema.update(min(max(float(value), 0.0), 1.0))
        n = min(int(obs.num_steps), self.max_steps)
        if n <= 0:
            # No drafting, no evidence, but the old evidence ages: the rates drift back to the prior, so
            # a policy that stopped drafting when acceptance was low sees a state that invites a probe
            # again (with frozen counts a greedy policy could never leave "no drafting").
            self._num *= self.rate_decay
            self._den *= self.rate_decay
            return
        self._accept.update(float(np.mean(obs.accept_lengths)))
        # Accepted drafts per request, clipped: a request that finished mid-chain reports fewer.
        drafts = np.clip(np.asarray(obs.accept_lengths, dtype=np.int64) - 1, 0, n)
        at_least = np.cumsum(np.bincount(drafts, minlength=n + 1)[::-1])[::-1]  # at_least[j] = #(d >= j)
        self._num[:n] = self.rate_decay * self._num[:n] + at_least[1 : n + 1]
        self._den[:n] = self.rate_decay * self._den[:n] + at_least[:n]

    def rates(self) -> np.ndarray:
        """Per-position conditional acceptance estimates rate_1..rate_M."""
        out = np.empty(self.max_steps)
        prev = RATE_PRIOR
        for k in range(self.max_steps):
            prev = (self._num[k] + RATE_PSEUDO_COUNT * prev) / (self._den[k] + RATE_PSEUDO_COUNT)
            out[k] = prev
        return out

    def features(self) -> np.ndarray:
        m = self.max_steps
        rates = self.rates()
        log_tokens = np.log(expected_tokens(rates)[1:]) / math.log(m + 1)
        head = [1.0, self._accept.get(1.0) / (m + 1)]
        middle = [
            math.log2(self._batch_size) / 8.0,
            1.0 / self._batch_size,
            math.log2(1.0 + self._position) / 16.0,
            self._loss.get(0.0),
            self._update_share.get(0.0),
        ]
        tail = [self._suffix_offer.get(0.0), self._suffix_expected.get(0.0)] if self.suffix else []
        return np.concatenate((head, rates, middle, log_tokens, tail)).astype(np.float64)

    # Position of a feature by name (policies or tools that read single features).
    def index(self, name: str) -> int:
        return self.names.index(name)
