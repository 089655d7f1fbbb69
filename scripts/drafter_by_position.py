#!/usr/bin/env python
"""Does an EAGLE-3 drafter lose accuracy as its context grows? Offline, on long prompts.

For each prompt of the chosen workloads, one target forward (HF transformers, fp32) over the prompt's first
`--max-tokens` tokens gives the target's features and greedy picks at every position; the drafter's
training-time unroll (`Eagle3Drafter.ttt_hidden`, the serving drafter's math) then predicts, at every
position, the chain of `--steps` tokens (default 1) that follows, given the true tokens before (teacher
forcing). Reported
per bucket of `--bucket` positions: the accuracy of each draft step against the target's pick (step j given
steps < j right) and the mean accepted length of the chain (greedy verification). The text is the prompt as
the target reads it, not an answer it writes: it measures the drafter against the context it sees, with no
greedy answer to generate (minutes per thousand tokens on a CPU).

With `--short-context N`, the last N tokens are evaluated again as a sequence of their own (a fresh target
forward, N tokens of context at most), and the same positions' accuracy is compared (the first
`--skip` of them left out, where the short sequence has almost no context): a drafter diluted by long contexts
scores better there with the short context.

    .venv/bin/python scripts/drafter_by_position.py --model Qwen2.5-Coder-0.5B-Instruct \\
        --datasets long-rewrite-8k --num-prompts 1 --max-tokens 8192 --short-context 2048 \\
        --out docs/results/drafter-by-position-qwen

Writes drafter_by_position.json, .md and .png under --out after every prompt; a rerun skips the prompts written.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from sglang_tts.bench.report import pyplot
from sglang_tts.bench.workload import chat_prompts, sample_prompts
from sglang_tts.drafters.eagle3 import Eagle3Drafter
from sglang_tts.training.eagle3 import chain_hits


def summarize(hits: torch.Tensor, bucket: int, offset: int = 0) -> list[dict[str, Any]]:
    """Per bucket of predicted positions (row t predicts t + 2 + offset): rows, accuracy per step, chain
    accepted length (leading hits)."""
    out = []
    accepted = hits.int().cumprod(-1).sum(-1).float()
    for start in range(0, hits.shape[0], bucket):
        part = hits[start : start + bucket]
        out.append(
            {
                "from": start + 2 + offset,
                "rows": part.shape[0],
                "acc": [round(float(a), 4) for a in part.float().mean(0)],
                "accept_len": round(float(accepted[start : start + bucket].mean()), 4),
            }
        )
    return out


def compare_short(hits: torch.Tensor, short: torch.Tensor, skip: int, steps: int) -> dict[str, Any]:
    """The same predicted positions scored with the whole context (`hits`, rows of the full sequence) and
    with only the last N tokens as context (`short`, rows of those N tokens on their own), the first `skip`
    short rows and the last `steps` rows (whose chains run past the end) left out."""
    n = short.shape[0] + 1  # the short sequence's length (rows are length - 1)
    first = hits.shape[0] + 1 - n + skip  # the full sequence's row predicting what short row `skip` predicts
    keep = short.shape[0] - skip - steps
    short, long = short[skip : skip + keep], hits[first : first + keep]

    def accepted(h: torch.Tensor) -> float:
        return round(float(h.int().cumprod(-1).sum(-1).float().mean()), 4)

    return {
        "tokens": n,
        "skip": skip,
        "from": first + 2,
        "short_acc0": round(float(short[:, 0].float().mean()), 4),
        "long_acc0": round(float(long[:, 0].float().mean()), 4),
        "short_accept_len": accepted(short),
        "long_accept_len": accepted(long),
    }


def write_report(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "drafter_by_position.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# Drafter accuracy by context position: {result['model']}", "", f"Command: `{result['command']}`", ""]
    for p in result["prompts"]:
        lines += [f"## {p['id']} ({p['tokens']} tokens)", ""]
        lines += ["| positions | rows | " + " | ".join(f"step {j}" for j in range(result["steps"])) + " | chain |"]
        lines += ["|---" * (result["steps"] + 3) + "|"]
        for b in p["buckets"]:
            accs = " | ".join(f"{a:.3f}" for a in b["acc"])
            lines.append(f"| {b['from']}-{b['from'] + b['rows'] - 1} | {b['rows']} | {accs} | {b['accept_len']:.3f} |")
        if "short_context" in p:
            s = p["short_context"]
            lines += [
                "",
                f"The last {s['tokens']} tokens, positions {s['from']}+ (the first {s['skip']} of them left out): "
                f"step-0 accuracy {s['short_acc0']:.3f} with {s['tokens']} tokens of context at most, "
                f"{s['long_acc0']:.3f} with the whole prompt before them; chain {s['short_accept_len']:.3f} vs "
                f"{s['long_accept_len']:.3f}.",
            ]
        lines.append("")
    (out / "drafter_by_position.md").write_text("\n".join(lines))

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for p in result["prompts"]:
        xs = [b["from"] + b["rows"] / 2 for b in p["buckets"]]
        ax.plot(xs, [b["acc"][0] for b in p["buckets"]], marker="o", label=f"{p['id']}: step 0")
        if result["steps"] > 1:
            ax.plot(xs, [b["accept_len"] for b in p["buckets"]], marker=".", linestyle="--", label=f"{p['id']}: chain")
    ax.set_xlabel("position in the context (tokens)")
    ax.set_ylabel("step-0 accuracy / accepted drafted tokens")
    ax.set_title("Drafter vs the target's picks, teacher forced")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "drafter_by_position.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="Qwen2.5-Coder-0.5B-Instruct")
    ap.add_argument("--drafter", default=None, help="EAGLE-3 drafter folder (default: the shipped one)")
    ap.add_argument("--datasets", nargs="+", default=["long-rewrite-8k"])
    ap.add_argument("--num-prompts", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=8192, help="the prompt's first N tokens")
    # Memory grows with the steps: each holds the [heads, L, L] attention of the whole sequence (8K tokens x 3
    # steps overflowed 24 GB on Qwen's drafter).
    ap.add_argument("--steps", type=int, default=1, help="draft steps per chain")
    ap.add_argument("--bucket", type=int, default=1024)
    ap.add_argument("--short-context", type=int, default=0, help="also the last N tokens on their own (0: off)")
    ap.add_argument("--skip", type=int, default=256, help="short-context positions left out of the comparison")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/results/drafter-by-position")
    args = ap.parse_args(argv)
    if args.short_context and args.short_context <= args.skip + 2:
        ap.error("--short-context must exceed --skip + 2")
    torch.set_num_threads(args.threads)

    from sglang_tts.training.target import load_target_and_drafter

    try:
        loaded = load_target_and_drafter(args.model, args.drafter, kind=Eagle3Drafter)
    except ValueError as e:
        ap.error(str(e))
    model, model_path, drafter, drafter_path = loaded.model, loaded.target_path, loaded.drafter, loaded.drafter_path
    out = Path(args.out)
    previous = out / "drafter_by_position.json"
    command = "scripts/drafter_by_position.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result: dict[str, Any] = {"model": model_path.name, "drafter": str(drafter_path), "steps": args.steps}
    result.update({"bucket": args.bucket, "command": command, "prompts": []})
    if previous.exists():
        result["prompts"] = json.loads(previous.read_text())["prompts"]
    done = {p["id"] for p in result["prompts"]}
    prompts = list(chat_prompts(sample_prompts(args.datasets, args.num_prompts, args.seed), model_path))
    for p in tqdm(prompts, desc="prompts", unit="prompt"):
        if p.id in done:
            continue
        start = time.perf_counter()
        ids = torch.tensor(p.input_ids[: args.max_tokens])
        hits = chain_hits(model, drafter, ids, args.steps)
        entry: dict[str, Any] = {"id": p.id, "tokens": len(ids), "buckets": summarize(hits, args.bucket)}
        if args.short_context and len(ids) > args.short_context:
            short = chain_hits(model, drafter, ids[-args.short_context :], args.steps)
            entry["short_context"] = compare_short(hits, short, args.skip, args.steps)
        entry["seconds"] = round(time.perf_counter() - start, 1)
        result["prompts"].append(entry)
        write_report(result, out)
        tqdm.write(f"{p.id}: {len(ids)} tokens in {entry['seconds']} s")
    write_report(result, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
