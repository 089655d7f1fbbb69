"""Hybrid drafting: per request and per round, verify the suffix proposer's chain or the drafter's.

A suffix proposer (a trie over the prompt, the output so far and the other live requests; no
model) drafts for free where the answer repeats text it has seen; the learned drafter drafts new
text. Both fill the same chain of `steps` slots, so the verify shape does not depend on who
proposed (sglang/hybrid.py puts the chosen chain in place). This module is the rule alone.

The rule (per request): take the suffix chain when it is at least `min_match` tokens long and the
suffix proposer's expected accepted tokens are at least the drafter's minus `margin`. The drafter's
expectation is a moving average; the suffix proposer's is either the score of the chain at hand
(`score="chain"`, `chain_score`: how often the request's own context continued its deepest
matching suffix with the chain's tokens, Arctic's suffix-tree score by C string search) or a moving
average as the drafter's (`score="average"`). The moving averages are of accepted drafted tokens:
- the drafter's: from the rounds it drafted (exact: SGLang's accepted length);
- the suffix proposer's: from the rounds it drafted, and from every other round in which it had a
  chain of `min_match` tokens, counterfactually: how many of its tokens the committed tokens of that
  round start with. Under greedy decoding that is exactly what it would have had accepted (a lower
  bound when all committed tokens match); under sampling, an estimate.
A new request starts from the averages over all requests (priors), so the first rounds of a
request that copies its prompt already use the suffix proposer when it has been good elsewhere.

Round cost (`HybridRule.cost`, measured by the engine adapter into `RoundCosts`): a round in which
every request of the batch takes its suffix chain skips the drafter's steps and is cheaper. Per
batch (`choose_batch`), after the rule above: if the whole batch on suffix chains (a request with
no chain of `min_match` tokens verifies what chain it has, counted as 0 expected tokens) yields more
expected tokens per second than the round as chosen, every request takes its suffix chain. Tokens
per round are 1 + expected accepted (the bonus token); seconds per round are the medians of the
latest rounds of each kind at this batch size and chain length. A request kept off the drafter this
way gives the drafter a round after `explore` such rounds, so its expectation stays current.

Retirement (`HybridRule.retire_below` > 0): a request whose drafter, after `retire_after` of its
rounds, has accepted fewer than `retire_below` drafted tokens per round on average is retired: for
the rest of the request it verifies its suffix chain every round, however short (0-padded), in
every mode. A retired request never drafts again, so the engine adapter may stop keeping the
drafter's state for it (its draft-extend, its canvases): a round whose batch is all retired costs
the target's verify and the suffix lookup only, as SGLang's NGRAM does. Where the drafter accepts
about nothing (0.2 tokens a round on the testbed's long generations) its steps, its extend after
every verify and TTS's updates cost more than they bring.

Three modes, per round (the RL controller's proposer action picks one per window; without a
controller the mode is HYBRID):
- HYBRID: the rule above;
- DRAFTER: the drafter's chain for every request (the suffix offers are still scored, so the
  expectations stay current for when the mode changes back);
- SUFFIX: the suffix chain for every request, however short (0-padded; the drafter's steps do not
  run at all), as SGLang's NGRAM drafts.

Host ints only: the worker feeds committed tokens it already has on the host.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from statistics import median

SUFFIX = "suffix"
DRAFTER = "drafter"
PROPOSERS = (SUFFIX, DRAFTER)
HYBRID = "hybrid"
MODES = (DRAFTER, HYBRID, SUFFIX)  # who drafts a round: the drafter, the rule, the suffix proposer
SCORES = ("average", "chain")  # the suffix proposer's expectation: a moving average, or the chain at hand's score
SCORE_DEPTH = 16  # the deepest suffix of the context `chain_score` matches (tokens)


def common_prefix(proposal: Sequence[int], committed: Sequence[int]) -> int:
    """How many leading tokens of `proposal` equal the committed tokens (what verify would accept)."""
    n = 0
    for a, b in zip(proposal, committed):
        if a != b:
            break
        n += 1
    return n


@dataclass
class HybridRule:
    steps: int  # drafted tokens per chain (the verify holds steps + 1)
    min_match: int = 0  # shortest suffix chain the rule takes (0: steps, a full chain)
    margin: float = 0.0  # suffix taken while its expected tokens >= the drafter's - margin
    decay: float = 0.5  # weight of the newest round in the moving averages
    cost: bool = False  # weigh the round costs (RoundCosts): a whole-batch suffix round skips the drafter
    explore: int = 16  # cost rule: a request kept off the drafter this many rounds gives it one
    retire_below: float = 0.0  # retire a request's drafter below this many accepted tokens per round (0: never)
    retire_after: int = 32  # ... judged once it has drafted this many of the request's rounds
    score: str = "average"  # the suffix side of the rule: SCORES ("average"; "chain": the chain at hand's score)

    def __post_init__(self) -> None:
        if self.min_match <= 0 or self.min_match > self.steps:
            self.min_match = self.steps
        if self.score not in SCORES:
            raise ValueError(f"hybrid score must be one of {SCORES}, got {self.score!r}")


def as_text(tokens: Iterable[int]) -> str:
    """Token ids as a str of code points (one character per token; ids below 0x110000), so that Python's
    C string search finds and counts token n-grams."""
    return "".join(map(chr, tokens))


def chain_score(text: str, chain: Sequence[int], depth: int = SCORE_DEPTH) -> float:
    """Expected accepted tokens of `chain` drafted after the context `text` (`as_text` of prompt + output),
    from the context's own counts: take the deepest suffix of the context, at most `depth` tokens, that
    occurred before; of its earlier occurrences, the share followed by chain[:1], chain[:2], ... summed
    (Arctic's suffix-tree score). 0.0 when the context's last token never occurred before, or for an
    empty chain. Occurrences are counted without overlap (str.count): a repeat of period shorter than the
    pattern counts less often, which lowers numerator and denominator alike."""
    body = text[:-1]  # an earlier occurrence ends before the last token, so a token follows it
    lo, hi = 0, min(depth, len(body))
    while lo < hi:  # the deepest k with text[-k:] in body (a suffix that occurs has shorter ones that do)
        k = (lo + hi + 1) // 2
        if body.find(text[-k:]) >= 0:
            lo = k
        else:
            hi = k - 1
    if lo == 0 or not chain:
        return 0.0
    pattern = text[-lo:]
    seen = body.count(pattern)
    score, path = 0.0, pattern
    for token in chain:
        path += chr(token)
        share = min(body.count(path) / seen, 1.0)
        if share == 0.0:
            break
        score += share
    return score


class RoundCosts:
    """Seconds per decode round, by kind (SUFFIX: the drafter's steps skipped; DRAFTER: they ran),
    batch size and chain length: the `window` latest of each, medians (an update or a stall that
    lands in one round moves nothing). Bounded: at most `keys` (batch size, steps) pairs, the least
    recently used dropped."""

    def __init__(self, window: int = 32, keys: int = 64, min_rounds: int = 4) -> None:
        self.window, self.keys, self.min_rounds = window, keys, min_rounds
        self._seconds: OrderedDict[tuple[int, int], dict[str, deque[float]]] = OrderedDict()

    def record(self, kind: str, batch_size: int, steps: int, seconds: float) -> None:
        key = (batch_size, steps)
        rows = self._seconds.pop(key, None) or {p: deque(maxlen=self.window) for p in PROPOSERS}
        self._seconds[key] = rows
        rows[kind].append(seconds)
        while len(self._seconds) > self.keys:
            self._seconds.popitem(last=False)

    def seconds(self, kind: str, batch_size: int, steps: int) -> float | None:
        """The median round of `kind` at this shape; None before `min_rounds` of them."""
        rows = self._seconds.get((batch_size, steps))
        if rows is None or len(rows[kind]) < self.min_rounds:
            return None
        return median(rows[kind])

    def ratio(self, batch_size: int, steps: int) -> float:
        """Drafter round seconds / suffix round seconds at this shape (1.0 until both are measured)."""
        suffix, drafter = self.seconds(SUFFIX, batch_size, steps), self.seconds(DRAFTER, batch_size, steps)
        if suffix is None or drafter is None or suffix <= 0:
            return 1.0
        return drafter / suffix


@dataclass
class _Request:
    expected: dict[str, float]
    choice: str = DRAFTER
    proposal: tuple[int, ...] = ()  # the suffix chain offered this round (empty: shorter than min_match)
    committed_at: int = -1  # output length when the round was proposed; -1: no round pending
    rounds: dict[str, int] = field(default_factory=lambda: {p: 0 for p in PROPOSERS})
    accepted: dict[str, int] = field(default_factory=lambda: {p: 0 for p in PROPOSERS})
    scored: bool = True  # a SUFFIX round teaches the suffix expectation (False: a chain it was not offered)
    off_drafter: int = 0  # rounds the cost rule kept this request off the drafter in a row
    retired: bool = False  # the drafter is done with this request: suffix chains only (module docstring)
    estimate: float = 0.0  # the suffix side of this round's choice (its chain's score, or the average)
    text: str = ""  # score "chain": the request's context (prompt + output) as_text, extended every round


class HybridChooser:
    """Per-request proposer choice (HybridRule) and per-proposer counts. State per live request only:
    `forget` drops a finished request; the priors are two floats."""

    def __init__(self, rule: HybridRule, prior_suffix: float = 0.0, prior_drafter: float = 1.0) -> None:
        self.rule = rule
        self.prior = {SUFFIX: prior_suffix, DRAFTER: prior_drafter}
        self.requests: dict[str, _Request] = {}

    def _state(self, rid: str) -> _Request:
        state = self.requests.get(rid)
        if state is None:
            state = self.requests[rid] = _Request(expected=dict(self.prior))
        return state

    def _learn(self, state: _Request, proposer: str, tokens: float) -> None:
        d = self.rule.decay
        state.expected[proposer] = (1 - d) * state.expected[proposer] + d * tokens
        self.prior[proposer] = (1 - d / 4) * self.prior[proposer] + d / 4 * tokens

    def score(self, rid: str, prompt: Sequence[int], output: Sequence[int], chain: Sequence[int]) -> float:
        """`chain_score` of the suffix chain offered to `rid` after its context (`prompt` + `output`, host
        ints). The context's text is kept per live request and extended by the new output tokens (rebuilt
        when it no longer matches: a request that was retracted and runs again)."""
        state = self._state(rid)
        known, have = len(prompt), len(state.text)  # the text holds the prompt and output[: have - known]
        fits = known <= have <= known + len(output)
        if fits and (have == 0 or ord(state.text[-1]) == (output[have - known - 1] if have > known else prompt[-1])):
            state.text += as_text(output[have - known :])
        else:
            state.text = as_text(prompt) + as_text(output)
        return chain_score(state.text, chain)

    def choose(
        self,
        rid: str,
        suffix_chain: Sequence[int],
        committed: Sequence[int],
        mode: str = HYBRID,
        min_match: int | None = None,
        score: float | None = None,
    ) -> bool:
        """This round of request `rid`: True to verify `suffix_chain` (the suffix proposer's tokens),
        False for the drafter's. `committed`: the request's output tokens so far (host ints); the
        tokens after the length recorded last round are that round's commits, which score the
        suffix proposer's last offer when the drafter drafted. `mode`: MODES (module docstring);
        `min_match`: the rule's shortest chain for this round (a shorter chain length than the
        rule's `steps`: at most that length), default the rule's. `score`: the chain's `score` (rule
        score "chain"; None: the suffix proposer's moving average decides)."""
        if mode not in MODES:
            raise ValueError(f"hybrid mode must be one of {MODES}, got {mode!r}")
        need = self.rule.min_match if min_match is None else min(max(int(min_match), 1), self.rule.min_match)
        state = self._state(rid)
        if state.committed_at >= 0 and state.choice == DRAFTER and state.proposal:
            new = committed[state.committed_at :]
            if new:
                self._learn(state, SUFFIX, common_prefix(state.proposal, new))
        offered = len(suffix_chain) >= need
        state.proposal = tuple(suffix_chain) if offered else ()
        state.committed_at = len(committed)
        use_score = score is not None and self.rule.score == "chain"
        state.estimate = (score if use_score else state.expected[SUFFIX]) if offered else 0.0
        if state.retired:
            state.choice, state.scored = SUFFIX, offered  # a shorter chain than the rule's: counted, not learned
            return True
        if mode == HYBRID:
            take = offered and state.estimate >= state.expected[DRAFTER] - self.rule.margin
        else:
            take = mode == SUFFIX
        state.choice = SUFFIX if take else DRAFTER
        state.scored = True
        return take

    def choose_batch(
        self,
        rids: Sequence[str],
        chains: Sequence[Sequence[int]],
        committed: Sequence[Sequence[int]],
        mode: str = HYBRID,
        min_match: int | None = None,
        cost_ratio: float = 1.0,
        scores: Sequence[float | None] | None = None,
    ) -> list[bool]:
        """`choose` for each request of a batch (`scores`: each chain's `score`, or None), then the cost
        rule (module docstring) when the rule has it: `cost_ratio` is a drafter round's seconds over a
        suffix round's at this shape."""
        scores = [None] * len(rids) if scores is None else scores
        take = [
            self.choose(rid, chain, done, mode, min_match, score)
            for rid, chain, done, score in zip(rids, chains, committed, scores)
        ]
        if mode != HYBRID or not self.rule.cost or cost_ratio <= 1.0 or not rids or all(take):
            return take
        states = [self.requests[rid] for rid in rids]
        as_chosen = sum(1 + (s.estimate if t else s.expected[DRAFTER]) for s, t in zip(states, take))
        all_suffix = sum(1 + s.estimate for s in states)
        stale = any(s.off_drafter >= self.rule.explore for s, t in zip(states, take) if not t)
        if stale or all_suffix * cost_ratio <= as_chosen:
            for state, t in zip(states, take):
                state.off_drafter = 0 if not t else state.off_drafter
            return take
        for state, t in zip(states, take):
            if not t:
                state.choice, state.off_drafter = SUFFIX, state.off_drafter + 1
                state.scored = bool(state.proposal)  # a shorter chain than the rule's: counted, not learned
        return [True] * len(rids)

    def drafter_only(self, rid: str, committed: Sequence[int]) -> None:
        """This round of `rid` is the drafter's without a choice (no suffix lookup was possible)."""
        state = self._state(rid)
        state.proposal, state.committed_at, state.choice = (), len(committed), DRAFTER

    def set_drafter(self, rid: str) -> None:
        """The drafter drafted this round after all (the suffix chain could not be put in place)."""
        state = self.requests.get(rid)
        if state is not None:
            state.choice = DRAFTER

    def accepted(self, rid: str, num_accepted: int) -> str | None:
        """SGLang's accepted drafted tokens (bonus excluded) of `rid`'s last round: learned for the
        proposer that drafted it and counted. Returns that proposer (None: no round was chosen)."""
        state = self.requests.get(rid)
        if state is None or state.committed_at < 0:
            return None
        proposer = state.choice
        state.rounds[proposer] += 1
        state.accepted[proposer] += num_accepted
        if proposer == DRAFTER or state.scored:
            self._learn(state, proposer, num_accepted)
        if proposer == SUFFIX:
            state.proposal = ()  # learned from the exact count: not again from the commits
        elif self.rule.retire_below > 0 and state.rounds[DRAFTER] >= self.rule.retire_after:
            state.retired = state.retired or state.accepted[DRAFTER] < self.rule.retire_below * state.rounds[DRAFTER]
        return proposer

    def retired(self, rid: str) -> bool:
        """Is `rid`'s drafter retired (suffix chains only for the rest of the request)?"""
        state = self.requests.get(rid)
        return state is not None and state.retired

    def expected(self, rid: str) -> float:
        """The suffix proposer's expected accepted tokens on `rid` (the prior for a new request)."""
        state = self.requests.get(rid)
        return (state.expected if state is not None else self.prior)[SUFFIX]

    def counts(self, rid: str) -> tuple[dict[str, int], dict[str, int]] | None:
        state = self.requests.get(rid)
        return None if state is None else (dict(state.rounds), dict(state.accepted))

    def forget(self, rid: str) -> None:
        self.requests.pop(rid, None)
