"""Fitting controller policies offline: from logged traces, and in the synthetic environment.

Offline from traces (`fit_traces`): every trace record is one closed window (state at the decision,
action, reward). The bandits keep one reward regression per action, so replaying the records through
`policy.update` is the direct method of off-policy learning: it needs logs in which every action
was tried in every kind of state (collect them with the round_robin policy, or with exploration on),
and it does not correct for a logging policy that chose actions by state. The softmax policy learns
only from its own decisions and is not fitted offline.

Reward: "tokens_per_second" uses the logged reward (tokens / measured seconds of the window);
"cost_model" fits a CostModel to all records and re-scores each window as tokens / predicted
seconds (timing noise then does not reach the policy; the cost model goes into the policy file).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_tts.control.actions import Action
from sglang_tts.control.controller import Controller, ControllerConfig, read_trace
from sglang_tts.control.cost import CostModel
from sglang_tts.control.policy import ControllerPolicy
from sglang_tts.control.synthetic import RunSummary, SyntheticConfig, SyntheticEnv, run_controller

OFFLINE_KINDS = ("linucb", "thompson")


@dataclass
class TraceSet:
    max_steps: int
    feature_names: list[str]
    actions: list[Action]  # every action seen in the headers, in first-seen order
    records: list[dict[str, Any]] = field(default_factory=list)


def load_traces(paths: Sequence[str | Path]) -> TraceSet:
    """Read JSONL traces (Controller.write_trace / the server's --tts-controller-trace); all must
    share one feature set."""
    if not paths:
        raise ValueError("no trace files given")
    merged: TraceSet | None = None
    for path in paths:
        header, records = read_trace(path)
        if merged is None:
            merged = TraceSet(int(header["max_steps"]), list(header["feature_names"]), [])
        elif header["feature_names"] != merged.feature_names:
            raise ValueError(f"{path}: its features {header['feature_names']} differ from {merged.feature_names}")
        for a in header["actions"]:
            action = Action.from_dict(a)
            if action not in merged.actions:
                merged.actions.append(action)
        merged.records.extend(records)
    assert merged is not None
    return merged


def window_reward(record: dict[str, Any], cost_model: CostModel | None) -> float:
    if cost_model is None:
        return float(record["reward"])
    w = record["window"]
    seconds = w["rounds"] * cost_model.predict(w["num_steps"], w["mean_batch_size"], w["update_stride"])
    return w["tokens"] / max(seconds, 1e-9)


@dataclass
class FitReport:
    used: int = 0
    skipped_unknown_action: int = 0
    skipped_bad: int = 0
    per_action: dict[str, int] = field(default_factory=dict)


def fit_traces(
    policy: ControllerPolicy, traces: TraceSet, cost_model: CostModel | None = None, passes: int = 1
) -> FitReport:
    """Replay the trace records through policy.update (see the module docstring). Records whose
    action is not in the policy's action set are skipped and counted."""
    kind = getattr(policy, "kind", "")
    if kind not in OFFLINE_KINDS:
        raise ValueError(f"policy kind {kind!r} cannot be fitted offline from traces; use one of {OFFLINE_KINDS}")
    if getattr(policy, "dim", None) != len(traces.feature_names):
        raise ValueError(
            f"the policy has {getattr(policy, 'dim', None)} features, the traces {len(traces.feature_names)}"
        )
    index = {a: i for i, a in enumerate(policy.actions)}
    report = FitReport()
    for _ in range(max(int(passes), 1)):
        for record in traces.records:
            try:
                action = Action.from_dict(record["action"])
                reward = window_reward(record, cost_model)
                features = record["features"]
            except (KeyError, TypeError, ValueError):
                report.skipped_bad += 1
                continue
            if action not in index:
                report.skipped_unknown_action += 1
                continue
            if not reward > 0:
                report.skipped_bad += 1
                continue
            policy.update(features, index[action], reward)
            report.used += 1
            report.per_action[str(action)] = report.per_action.get(str(action), 0) + 1
    return report


# Batch-size buckets of static_grid: (label, smallest, largest mean batch size of a window).
BATCH_BUCKETS = (("1", 1, 1), ("2-4", 2, 4), ("5-8", 5, 8), ("9-16", 9, 16), ("17-64", 17, 64), ("65+", 65, 10**9))


def _bucket(mean_batch_size: float) -> str:
    size = max(1, round(mean_batch_size))
    return next(label for label, low, high in BATCH_BUCKETS if low <= size <= high)


_BUCKET_ORDER = {label: i for i, (label, _, _) in enumerate(BATCH_BUCKETS)}


def _pooled_windows(traces: TraceSet, context: Callable[[dict[str, Any]], Any]) -> dict[Any, dict[Action, list[float]]]:
    """Per context (``context(record)``) and action: [sum of tokens, sum of seconds, windows] of the
    logged windows. Records without the needed fields or with no measured time are left out."""
    totals: dict[Any, dict[Action, list[float]]] = {}
    for record in traces.records:
        try:
            action = Action.from_dict(record["action"])
            w = record["window"]
            tokens, seconds, key = float(w["tokens"]), float(w["seconds"]), context(record)
        except (KeyError, TypeError, ValueError, IndexError):
            continue
        if not seconds > 0:
            continue
        cell = totals.setdefault(key, {}).setdefault(action, [0.0, 0.0, 0])
        cell[0] += tokens
        cell[1] += seconds
        cell[2] += 1
    return totals


def static_grid(traces: TraceSet) -> dict[str, Any]:
    """The grid search for the best static configuration, from logged windows: per batch-size bucket and
    action, the pooled tokens/s of the windows that ran it (sum of tokens / sum of seconds), and the best
    action per bucket; ``"overall"``: per action the geometric mean over the buckets where every action
    ran, and the best. With a uniform logging policy every action is tried in the same mix of states,
    so this compares actions on equal terms; it measures each action's immediate throughput (a stride's
    later effect on acceptance is shared by the windows that follow it)."""
    totals = _pooled_windows(traces, lambda record: _bucket(float(record["window"]["mean_batch_size"])))
    grid: dict[str, Any] = {}
    for label in sorted(totals, key=_BUCKET_ORDER.__getitem__):
        cells = {a: {"windows": int(n), "tokens_per_s": t / s} for a, (t, s, n) in sorted(totals[label].items())}
        best = max(cells, key=lambda a: cells[a]["tokens_per_s"])
        grid[label] = {"actions": {str(a): c for a, c in cells.items()}, "best": str(best)}
    complete = [
        label for label in sorted(totals, key=_BUCKET_ORDER.__getitem__) if set(totals[label]) == set(traces.actions)
    ]
    if complete:
        geo = {
            str(a): math.exp(
                sum(math.log(totals[label][a][0] / totals[label][a][1]) for label in complete) / len(complete)
            )
            for a in sorted(traces.actions)
        }
        grid["overall"] = {"buckets": complete, "geomean_tokens_per_s": geo, "best": max(geo, key=geo.__getitem__)}
    return grid


def _thirds(value: float) -> str:
    return "<1/3" if value < 1 / 3 else ("<2/3" if value < 2 / 3 else ">=2/3")


def context_headroom(traces: TraceSet, static: str | None = None, position_bucket: int = 256, min_windows: int = 3):
    """How much a policy that chooses by context could gain over the best static action, from logged
    windows: contexts are batch-size bucket x output-position bucket (``position_bucket`` tokens), x
    the suffix proposer's record at the decision (the state feature ``suffix_expected``, in thirds;
    hybrid traces only); in
    each, the pooled tokens/s of every action with at least ``min_windows`` windows, the best of
    them, and its ratio to the static action (``static``, by default static_grid's overall best).
    ``"overall"`` and each batch bucket's ``"ratio"``: the geometric mean of the per-context ratios,
    weighted by the contexts' windows. An upper bound with an upward bias: each context's best is the
    maximum of noisy estimates (few windows per action and context), and it assumes the context is
    known before the window runs."""
    if static is None:
        overall = static_grid(traces).get("overall")
        if overall is None:
            return {}
        static = overall["best"]
    names = traces.feature_names
    suffix_at = names.index("suffix_expected") if "suffix_expected" in names else None

    def context(record):
        w = record["window"]
        position = int(float(w["mean_output_position"]) // position_bucket) * position_bucket
        suffix = None if suffix_at is None else "suffix" + _thirds(float(record["features"][suffix_at]))
        return _bucket(float(w["mean_batch_size"])), position, suffix

    totals = _pooled_windows(traces, context)
    contexts = []
    for label, position, suffix in sorted(totals, key=lambda key: (_BUCKET_ORDER[key[0]], key[1], key[2] or "")):
        cells = totals[(label, position, suffix)]
        rates = {str(a): t / s for a, (t, s, n) in cells.items() if n >= min_windows}
        if static not in rates:
            continue
        best = max(rates, key=rates.__getitem__)
        contexts.append({
            "batch": label, "position": position, **({"suffix": suffix} if suffix is not None else {}),
            "windows": int(sum(n for _, _, n in cells.values())),
            "best": best, "best_tokens_per_s": rates[best], "static_tokens_per_s": rates[static],
            "ratio": rates[best] / rates[static],
        })  # fmt: skip

    def weighted_ratio(rows):
        total = sum(r["windows"] for r in rows)
        return math.exp(sum(r["windows"] * math.log(r["ratio"]) for r in rows) / total) if total else None

    rows_by_batch: dict[str, list[dict[str, Any]]] = {}
    for row in contexts:
        rows_by_batch.setdefault(row["batch"], []).append(row)
    by_batch = {label: {"contexts": len(rows), "ratio": weighted_ratio(rows)} for label, rows in rows_by_batch.items()}
    return {
        "static": static, "position_bucket": position_bucket, "min_windows": min_windows,
        "contexts": contexts, "by_batch": by_batch, "overall": weighted_ratio(contexts),
    }  # fmt: skip


def train_synthetic(
    policy: ControllerPolicy,
    windows: int,
    config: SyntheticConfig | None = None,
    persistence: int = 8,
    episode_rounds: int = 320,
    seed: int = 0,
    progress: bool = False,
) -> RunSummary:
    """Online learning (explore and learn) in the synthetic environment; the policy's action set
    must be (a subset of) the environment's grid and its state size the environment's max_steps."""
    config = config or SyntheticConfig()
    controller = Controller(
        policy, ControllerConfig(persistence=persistence, explore=True, learn=True), config.max_steps
    )
    env = SyntheticEnv(config, episode_rounds=episode_rounds, seed=seed)
    return run_controller(controller, env, windows, progress=progress)


def evaluate_synthetic(
    policy: ControllerPolicy,
    windows: int,
    config: SyntheticConfig | None = None,
    persistence: int = 8,
    episode_rounds: int = 320,
    seed: int = 1,
) -> RunSummary:
    """Greedy (no exploration, no learning) run in the synthetic environment: accuracy against the
    known best action per context, and expected throughput relative to the oracle."""
    config = config or SyntheticConfig()
    controller = Controller(
        policy, ControllerConfig(persistence=persistence, explore=False, learn=False), config.max_steps
    )
    env = SyntheticEnv(config, episode_rounds=episode_rounds, seed=seed)
    return run_controller(controller, env, windows)


def greedy_choice_per_context(
    policy: ControllerPolicy,
    config: SyntheticConfig,
    windows: int = 20,
    warmup_windows: int = 3,
    persistence: int = 8,
    seed: int = 1,
) -> dict[Any, list[int]]:
    """For each context of `config`: the policy's greedy (no exploration, no learning) action indices
    over `windows` windows run in that context alone, after `warmup_windows` windows that let the
    state settle (the state carries acceptance statistics over from the previous context)."""
    choices: dict[Any, list[int]] = {}
    for i, context in enumerate(config.contexts()):
        controller = Controller(
            policy, ControllerConfig(persistence=persistence, explore=False, learn=False), config.max_steps
        )
        env = SyntheticEnv(config, episode_rounds=10**9, seed=seed + i)
        env.new_episode(context)
        picked: list[int] = []
        while len(picked) < warmup_windows + windows:
            index = controller._index
            if controller.observe(env.step(controller.current)) is not None:
                picked.append(index)
        choices[context] = picked[warmup_windows:]
    return choices
