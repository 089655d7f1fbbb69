"""Train EAGLE-3 and/or DFlash drafters for a target (default: SmolLM2-135M-Instruct) on CPU.

The target answers offline prompts greedily (short answers, cached), its hidden states are cached,
and each drafter is trained with its published recipe (EAGLE-3: 7-step training-time test, soft
CE on a frequency draft vocabulary; DFlash: random anchors, [anchor, MASK...] blocks, decayed CE),
then written as config.json + model.safetensors that stock SGLang loads with
``--speculative-algorithm EAGLE3`` / ``DFLASH``. See sglang_tts/training/ for the details.

Examples::

    python scripts/train_drafter.py --tiny                      # smoke run, a couple of minutes
    python scripts/train_drafter.py --kind eagle3 --time-budget 900
    python scripts/train_drafter.py --kind eagle3 --resume      # continue an interrupted run
    python scripts/train_drafter.py --kind eagle3 --init-from shipped  # a fresh machine: go on from the shipped one

The last lines on stdout are the checkpoint folders, one per kind; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path

# Runnable from a checkout without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from sglang_tts.training.pipeline import KINDS, TrainRequest, tiny_request, train_drafters  # noqa: E402

WORKLOADS_TRAINING_SOURCE = "workloads:held-in"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add(
        "--target",
        "--model",
        default=None,
        help="target model: a folder or a prepare_model.py name, e.g. Qwen2.5-Coder-0.5B-Instruct "
        "(default: SmolLM2-135M-Instruct)",
    )
    add("--kind", choices=(*KINDS, "both"), default="both", help="which drafter(s) to train (default: both)")
    add("--out", type=Path, default=None, help="checkpoint folder (one kind) or parent folder (both)")
    add("--tag", default=None, help="suffix of the default folder name <target>-<kind>-<tag> (default: len<max-len>)")
    add("--tiny", action="store_true", help="tiny configuration for tests and smoke runs (flags below still apply)")
    data = parser.add_argument_group("data")
    data.add_argument("--source", default=None, help="prompt source: math500 (default), aime2024, ..., or a .jsonl")
    data.add_argument(
        "--workloads",
        action="store_true",
        help="prompts: the held-in parts of the reasoning, long-gen and long-context workloads, evenly mixed "
        "(= --source workloads:held-in; docs/workloads.md); long-context prompts need --max-prompt-len 6600",
    )
    data.add_argument("--num-prompts", type=int, default=None, help="prompts to answer (default 256)")
    data.add_argument(
        "--extra-source",
        default=None,
        help="a second prompt source added to the first one's prompts, e.g. code-edit (training-only code-editing "
        "prompts over stdlib functions and classes that no workload uses; docs/training.md)",
    )
    data.add_argument(
        "--extra-prompts", type=int, default=None, help="how many --extra-source prompts (a seeded sample)"
    )
    data.add_argument("--max-len", type=int, default=None, help="max new tokens per answer (default 256)")
    data.add_argument("--max-prompt-len", type=int, default=None, help="skip longer prompts (default 256 tokens)")
    data.add_argument("--gen-batch-size", type=int, default=None, help="generation batch (default 16)")
    data.add_argument(
        "--gen-batch-tokens",
        type=int,
        default=None,
        help="most prompt tokens per generation batch, padding included: long prompts batch small (default 16384)",
    )
    data.add_argument(
        "--train-context",
        type=int,
        default=None,
        help="prompt tokens before each answer that training sees; the target reads the whole prompt "
        "(default 1024; 0: none)",
    )
    data.add_argument("--eval-sequences", type=int, default=None, help="held-out sequences (default 16)")
    data.add_argument("--cache-dir", type=Path, default=None, help="data cache (default <cache>/drafters/data)")
    train = parser.add_argument_group("training")
    train.add_argument("--epochs", type=float, default=None, help="epochs over the training set (default 3)")
    train.add_argument("--steps", type=int, default=None, help="optimizer steps per kind (overrides --epochs)")
    train.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-4)")
    train.add_argument("--schedule", choices=("cosine", "constant"), default=None, help="after warmup (default cosine)")
    train.add_argument("--batch-size", type=int, default=None, help="sequences per step, both kinds (default 4)")
    train.add_argument("--seed", type=int, default=None, help="seed of prompts, split, init and batches (default 0)")
    train.add_argument("--resume", action="store_true", help="continue from <out>/train/state.pt if present")
    train.add_argument(
        "--init-from",
        default=None,
        help="start from this trained drafter folder instead of random weights (its draft vocabulary, MASK id and "
        "layers too; a fresh optimizer and schedule); 'shipped': the drafter that ships for the target",
    )
    train.add_argument("--save-every", type=int, default=None, help="steps between checkpoints (default 200)")
    train.add_argument("--time-budget", type=float, default=None, help="seconds of training per kind, then save+stop")
    train.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    eagle = parser.add_argument_group("EAGLE-3")
    eagle.add_argument("--draft-vocab-size", type=int, default=None, help="draft vocabulary (default 8192)")
    eagle.add_argument("--ttt-steps", type=int, default=None, help="training-time-test unroll (default 7)")
    eagle.add_argument("--eagle3-layers", type=int, default=None, help="decoder layers (default 1)")
    dflash = parser.add_argument_group("DFlash")
    dflash.add_argument("--block-size", type=int, default=None, help="block size (default 8)")
    dflash.add_argument("--dflash-layers", type=int, default=None, help="decoder layers (default 2)")
    dflash.add_argument("--anchors", type=int, default=None, help="blocks per sequence per step (default 32)")
    dflash.add_argument(
        "--dflash-target-layers",
        type=int,
        nargs="+",
        default=None,
        help="output-of-layer ids the drafter reads (default: 3 spaced as SGLang does; e.g. the EAGLE-3 capture "
        "to share its cached features)",
    )
    dflash.add_argument("--mask-token-id", type=int, default=None, help="MASK id (default: an unused special token)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars or log lines")
    return parser


def _set(obj, **values):
    """dataclasses.replace with only the values that were given on the command line."""
    return replace(obj, **{k: v for k, v in values.items() if v is not None})


def request_from_args(args: argparse.Namespace) -> TrainRequest:
    if args.workloads and args.source is not None:
        raise SystemExit("train_drafter.py: --workloads and --source both choose the prompts; give one")
    if (args.extra_source is None) != (args.extra_prompts is None):
        raise SystemExit("train_drafter.py: --extra-source and --extra-prompts go together")
    request = tiny_request() if args.tiny else TrainRequest()
    kinds = KINDS if args.kind == "both" else (args.kind,)
    request = _set(
        request,
        target=args.target,
        kinds=kinds,
        out=args.out,
        tag=args.tag,
        eval_sequences=args.eval_sequences,
        train_context=args.train_context,
        epochs=args.epochs,
        steps=args.steps,
        seed=args.seed,
        save_every=args.save_every,
        time_budget_s=args.time_budget,
        cache_dir=args.cache_dir,
    )
    request = replace(request, resume=args.resume, init_from=args.init_from, progress=not args.quiet)
    request.data = _set(
        request.data,
        source=WORKLOADS_TRAINING_SOURCE if args.workloads else args.source,
        num_prompts=args.num_prompts,
        extra_source=args.extra_source,
        extra_prompts=args.extra_prompts,
        max_new_tokens=args.max_len,
        max_prompt_tokens=args.max_prompt_len,
        batch_size=args.gen_batch_size,
        batch_prompt_tokens=args.gen_batch_tokens,
        seed=args.seed,
    )
    request.optim = _set(request.optim, lr=args.lr, schedule=args.schedule)
    request.eagle3 = _set(
        request.eagle3,
        draft_vocab_size=args.draft_vocab_size,
        ttt_steps=args.ttt_steps,
        num_layers=args.eagle3_layers,
        batch_size=args.batch_size,
    )
    request.dflash = _set(
        request.dflash,
        block_size=args.block_size,
        num_layers=args.dflash_layers,
        num_anchors=args.anchors,
        target_layer_ids=args.dflash_target_layers,
        mask_token_id=args.mask_token_id,
        batch_size=args.batch_size,
    )
    return request


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="[train_drafter] %(message)s",
        stream=sys.stderr,
    )
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    results = train_drafters(request_from_args(args))
    for result in results.values():
        after = result.eval_after or {}
        print(
            f"{result.kind}: step {result.step}, held-out accept_len {after.get('accept_len', float('nan')):.3f}, "
            f"acc {after.get('acc')}",
            file=sys.stderr,
        )
    for result in results.values():
        print(result.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
