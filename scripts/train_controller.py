#!/usr/bin/env python
"""Write a policy file for `--tts-controller`: fitted from logged traces, learnt in the synthetic
environment, or scripted.

    # 1. a logging policy that tries a random action per window (persistence 8), to collect traces
    python scripts/train_controller.py --kind uniform --steps 0,1,3,5,7 --strides 2,5 --out log.json
    python -m sglang.launch_server ... --speculative-algorithm TTS --tts-controller log.json \
        --tts-controller-trace trace.jsonl          # then serve a representative workload

    # 2. fit a contextual bandit to the traces (several --trace files are merged)
    python scripts/train_controller.py --kind linucb --trace trace.jsonl --out policy.json

    # or learn online in the synthetic environment (steps/strides must be its grid), and score it
    python scripts/train_controller.py --kind thompson --synthetic-windows 3000 --evaluate 500 --out syn.json

The action set is steps x strides x proposers (`--steps`, `--strides`, `--proposers`; `--suffix-steps`
adds longer chains for the suffix proposer alone; with --trace, default: every action in the traces).
Prints a JSON summary; with --trace it includes "static_grid": every action's tokens/s in the
logged windows per batch-size bucket and the best static action (the grid-search baseline), and
"context_headroom": the best action per batch-size x output-position context and its ratio to that
static action (an optimistic bound on what choosing by context can gain).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_tts.control.actions import action_grid, uses_suffix  # noqa: E402
from sglang_tts.control.controller import REWARDS, ControllerConfig  # noqa: E402
from sglang_tts.control.cost import CostModel  # noqa: E402
from sglang_tts.control.observation import feature_names  # noqa: E402
from sglang_tts.control.policy import POLICY_KINDS, SEEDED_KINDS, make_policy  # noqa: E402
from sglang_tts.control.policy_file import PolicyFileError, load_policy, save_policy  # noqa: E402
from sglang_tts.control.synthetic import RunSummary, SyntheticConfig  # noqa: E402
from sglang_tts.control.training import (  # noqa: E402
    context_headroom,
    evaluate_synthetic,
    fit_traces,
    load_traces,
    static_grid,
    train_synthetic,
)


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="policy file to write")
    p.add_argument("--kind", choices=list(POLICY_KINDS), default="linucb")
    p.add_argument("--steps", type=_ints, help="chain lengths of the action set (0 = no drafting)")
    p.add_argument("--strides", type=_ints, help="TTS update strides of the action set")
    p.add_argument(
        "--proposers",
        type=lambda text: [x.strip() for x in text.split(",") if x.strip()],
        help="proposers of the action set, comma-separated from drafter,hybrid,suffix (default drafter; "
        "others need --tts-hybrid on at serving)",
    )
    p.add_argument(
        "--suffix-steps",
        type=_ints,
        default=[],
        help="more chain lengths for the suffix proposer alone (e.g. 8: copied spans verified longer than "
        "the drafter's chains are worth running)",
    )
    p.add_argument("--trace", action="append", default=[], help="controller trace (JSONL); repeatable")
    p.add_argument("--init", help="continue from this policy file (same actions and features)")
    p.add_argument("--synthetic-windows", type=int, default=0, help="online learning windows in the synthetic env")
    p.add_argument("--evaluate", type=int, default=0, help="greedy windows in the synthetic env to score the result")
    p.add_argument("--persistence", type=int, default=8, help="verify rounds per decision")
    p.add_argument("--reward", choices=REWARDS, default="tokens_per_second")
    p.add_argument("--explore", action="store_true", help="serve with exploration (else the greedy choice)")
    p.add_argument("--initial-steps", type=int, help="the action to start with: its chain length")
    p.add_argument("--initial-stride", type=int, help="... and its stride")
    p.add_argument("--initial-proposer", help="... and its proposer")
    p.add_argument("--alpha", type=float, help="bandit exploration scale")
    p.add_argument("--index", type=int, default=0, help="static: the action index")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    traces = load_traces(args.trace) if args.trace else None
    synthetic = SyntheticConfig()
    init = None
    if args.init:
        try:
            init = load_policy(args.init)
        except PolicyFileError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if init is not None:
        actions, max_steps = init.actions, init.max_steps
    elif args.steps or args.strides or args.proposers or args.suffix_steps:
        try:
            actions = action_grid(
                args.steps or [3], args.strides or [5], args.proposers or ["drafter"], args.suffix_steps
            )
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        max_steps = max(1, max(a.num_steps for a in actions))
    elif traces is not None:
        actions = sorted(traces.actions)
        max_steps = traces.max_steps
    else:
        actions, max_steps = synthetic.actions(), synthetic.max_steps
    if traces is not None and traces.max_steps != max_steps:
        print(
            f"error: the traces' state has max_steps={traces.max_steps}, the action set needs {max_steps}",
            file=sys.stderr,
        )
        return 2
    if (args.synthetic_windows or args.evaluate) and max_steps != synthetic.max_steps:
        print(f"error: the synthetic environment's state has max_steps={synthetic.max_steps}", file=sys.stderr)
        return 2

    dim = len(feature_names(max_steps, uses_suffix(actions)))
    if init is not None:
        policy = init.policy
    else:
        kwargs = {"seed": args.seed} if args.kind in SEEDED_KINDS else {}
        if args.alpha is not None and args.kind in ("linucb", "thompson"):
            kwargs["alpha"] = args.alpha
        if args.kind == "static":
            kwargs["index"] = args.index
        policy = make_policy(args.kind, actions, dim, **kwargs)

    summary: dict = {"kind": getattr(policy, "kind", None), "actions": [str(a) for a in actions]}
    cost_model = None
    if traces is not None:
        if args.reward == "cost_model":
            cost_model = CostModel.fit_records(traces.records)
            summary["cost_model"] = cost_model.to_dict()
        try:
            report = fit_traces(policy, traces, cost_model)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        summary["trace_records_used"] = report.used
        summary["trace_records_skipped"] = report.skipped_unknown_action + report.skipped_bad
        summary["records_per_action"] = report.per_action
        summary["static_grid"] = static_grid(traces)
        summary["context_headroom"] = context_headroom(traces)
    if args.synthetic_windows:
        run = train_synthetic(policy, args.synthetic_windows, synthetic, args.persistence, seed=args.seed)
        summary["synthetic_train_tail_accuracy"] = RunSummary.accuracy(run.tail(0.2))
    if args.evaluate:
        run = evaluate_synthetic(policy, args.evaluate, synthetic, args.persistence, seed=args.seed + 1)
        summary["synthetic_eval_accuracy"] = RunSummary.accuracy(run.decisions)
        summary["synthetic_eval_oracle_ratio"] = RunSummary.oracle_ratio(run.decisions)

    if args.reward == "cost_model" and cost_model is None:
        print("error: --reward cost_model needs --trace (the cost model is fitted to them)", file=sys.stderr)
        return 2
    initial = None
    if args.initial_steps is not None:
        matches = [a for a in actions if a.num_steps == args.initial_steps]
        if args.initial_stride is not None:
            matches = [a for a in matches if a.update_stride == args.initial_stride]
        if args.initial_proposer is not None:
            matches = [a for a in matches if a.proposer == args.initial_proposer]
        if not matches:
            message = "--initial-steps/--initial-stride/--initial-proposer is not an action of the set"
            print(f"error: {message}", file=sys.stderr)
            return 2
        initial = matches[0]
    config = ControllerConfig(
        persistence=args.persistence,
        explore=args.explore,
        learn=False,
        reward=args.reward,
        cost_model=cost_model if args.reward == "cost_model" else None,
        initial_action=initial,
    )
    meta = {
        "traces": [str(t) for t in args.trace],
        "synthetic_windows": args.synthetic_windows,
        "init": args.init,
        "seed": args.seed,
    }
    save_policy(args.out, policy, config, max_steps, meta)
    summary["out"] = str(args.out)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
