#!/usr/bin/env python
"""Would rejection sampling accept more drafts than SGLang's default sampling verify? Offline, on sampled answers.

SGLang verifies an EAGLE chain of a sampling request in one of two exact ways:

- **target only** (the default): the drafter proposes its most likely token x, and x is kept when the target's
  own sample is x, so with probability p(x), p the target's distribution at the request's temperature;
- **rejection sampling** (`--speculative-use-rejection-sampling`, chains only): the drafter samples x from its
  own distribution q (at the request's temperature) and x is kept with probability min(1, p(x) / q(x)), so a
  draft is kept with probability sum_v min(p(v), q(v)) = 1 - TV(p, q).

Which one keeps more drafts depends on how well q's shape, not only its top token, matches p's. This script
measures both on the first draft step, where most of a chain's accepted tokens come from: for each prompt it
samples an answer from the target (HF transformers, fp32, `--max-new-tokens` at each temperature), runs one
target forward over prompt + answer and the drafter's step (teacher forced, the serving drafter's math) at
every answer position, and averages p(argmax q) and sum min(p, q) over the answer. SGLang 0.5.23 refuses
rejection sampling with a drafter whose vocabulary is reduced (the shipped Qwen drafter drafts from 8,192 of
151,936 tokens), so for such a drafter the second column is what the rule would give, not a served number.

    .venv/bin/python scripts/verify_rule_offline.py --model Qwen2.5-Coder-0.5B-Instruct --datasets reasoning \\
        --num-prompts 4 --temperatures 1.0 0.7 --out docs/results/verify-rule-offline-qwen

Writes verify_rule.json, .md and .png under --out after every prompt; a rerun skips the prompts written.
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

ROOT = Path(__file__).resolve().parents[1]


@torch.no_grad()
def first_step_acceptance(
    model: Any, drafter: Eagle3Drafter, ids: torch.Tensor, start: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position t >= start of `ids` [L]: the probability that a first-step draft of token t is kept,
    (target only [L - start], rejection sampling [L - start]), both at `temperature`.

    The drafter's row r (input token r + 1, the target's features at r) predicts token r + 2, whose target
    distribution is the target's logits at r + 1; so token t is predicted by row t - 2 (start >= 2)."""
    if start < 2:
        raise ValueError("start must be >= 2 (the first drafted token needs two tokens before it)")
    layer_ids = sorted(set(drafter.cfg.aux_layer_ids))
    out = model(input_ids=ids[None], output_hidden_states=True)
    order = [layer_ids.index(i) for i in drafter.cfg.aux_layer_ids]
    feats = torch.stack([out.hidden_states[i + 1][0] for i in layer_ids], dim=1)[:, order].flatten(1)  # [L, K*H]
    length = len(ids)
    hidden = drafter.ttt_hidden(ids[None, 1:], feats[None, :-1], torch.arange(1, length)[None], steps=1)[0][0]
    rows = torch.arange(start - 2, length - 2)  # [n] drafter rows predicting tokens start .. L - 1
    d2t = drafter.draft_to_target_ids()  # [Vd] target id of each draft id
    q_draft = torch.softmax((hidden[rows] @ drafter.lm_head_weight().T).float() / temperature, -1)  # [n, Vd]
    p = torch.softmax(out.logits[0, rows + 1].float() / temperature, -1)  # [n, V]
    q = torch.zeros_like(p).index_copy_(1, d2t, q_draft)  # [n, V]: no mass outside the draft vocabulary
    target_only = p.gather(1, d2t[q_draft.argmax(-1)][:, None]).squeeze(1)
    rejection = torch.minimum(p, q).sum(-1)
    return target_only, rejection


def write_report(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify_rule.json").write_text(json.dumps(result, indent=1) + "\n")
    temps = result["temperatures"]
    lines = [f"# First-step draft acceptance by verify rule: {result['model']}", "", f"Command: `{result['command']}`"]
    lines += [
        "",
        f"Drafter: `{result['drafter']}`; answers sampled from the target, {result['max_new_tokens']} tokens.",
    ]
    lines += ["", "| prompt | " + " | ".join(f"T={t}: target only | T={t}: rejection" for t in temps) + " |"]
    lines += ["|---" * (1 + 2 * len(temps)) + "|"]
    pooled = {t: [0.0, 0.0, 0] for t in temps}
    for p in result["prompts"]:
        cells = []
        for t in temps:
            r = p["by_temperature"][str(t)]
            cells += [f"{r['target_only']:.3f}", f"{r['rejection']:.3f}"]
            pooled[t][0] += r["target_only"] * r["positions"]
            pooled[t][1] += r["rejection"] * r["positions"]
            pooled[t][2] += r["positions"]
        lines.append(f"| {p['id']} | " + " | ".join(cells) + " |")
    means = {t: (a / n, b / n) if n else (0.0, 0.0) for t, (a, b, n) in pooled.items()}
    lines.append("| **pooled** | " + " | ".join(f"**{a:.3f}** | **{b:.3f}**" for a, b in means.values()) + " |")
    note = "Each cell: the mean probability that the drafter's first draft is kept, over the answer's positions."
    lines += ["", note]
    (out / "verify_rule.md").write_text("\n".join(lines) + "\n")

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(temps))
    ax.bar([x - 0.2 for x in xs], [means[t][0] for t in temps], width=0.4, label="target only (SGLang's default)")
    ax.bar([x + 0.2 for x in xs], [means[t][1] for t in temps], width=0.4, label="rejection sampling")
    ax.set_xticks(list(xs), [f"T={t}" for t in temps])
    ax.set_ylabel("first draft kept (probability)")
    ax.set_title(f"Verify rules, pooled over {len(result['prompts'])} sampled answers")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "verify_rule.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="Qwen2.5-Coder-0.5B-Instruct")
    ap.add_argument("--drafter", default=None, help="EAGLE-3 drafter folder (default: the shipped one)")
    ap.add_argument("--datasets", nargs="+", default=["reasoning"])
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompt sample and of the sampled answers")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    ap.add_argument("--max-new-tokens", type=int, default=256, help="tokens of each sampled answer")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/results/verify-rule-offline")
    args = ap.parse_args(argv)
    if any(t <= 0 for t in args.temperatures):
        ap.error("--temperatures must be > 0 (a greedy request's drafts are kept by the argmax either way)")
    torch.set_num_threads(args.threads)

    from sglang_tts.training.target import load_target_and_drafter

    try:
        loaded = load_target_and_drafter(args.model, args.drafter, kind=Eagle3Drafter)
    except ValueError as e:
        ap.error(str(e))
    model, model_path, drafter, drafter_path = loaded.model, loaded.target_path, loaded.drafter, loaded.drafter_path
    out = Path(args.out)
    previous = out / "verify_rule.json"
    command = "scripts/verify_rule_offline.py " + " ".join(argv if argv is not None else sys.argv[1:])
    shown = Path(drafter_path).resolve()
    shown = shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown  # no machine paths in a report
    result: dict[str, Any] = {"model": model_path.name, "drafter": str(shown), "command": command}
    result.update({"temperatures": args.temperatures, "max_new_tokens": args.max_new_tokens, "prompts": []})
    if previous.exists():
        result["prompts"] = json.loads(previous.read_text())["prompts"]
    done = {p["id"] for p in result["prompts"]}
    prompts = list(chat_prompts(sample_prompts(args.datasets, args.num_prompts, args.seed), model_path))
    for i, p in enumerate(tqdm(prompts, desc="prompts", unit="prompt")):
        if p.id in done:
            continue
        started = time.perf_counter()
        entry: dict[str, Any] = {"id": p.id, "by_temperature": {}}
        prompt = torch.tensor(p.input_ids)
        for t in args.temperatures:
            torch.manual_seed(args.seed * 1000 + i)
            with torch.no_grad():
                ids = model.generate(
                    prompt[None], do_sample=True, temperature=t, top_p=1.0, top_k=0, max_new_tokens=args.max_new_tokens
                )[0]
            target_only, rejection = first_step_acceptance(model, drafter, ids, len(prompt), t)
            n = len(target_only)  # 0 when the answer ended at once
            entry["by_temperature"][str(t)] = {
                "positions": n,
                "target_only": round(float(target_only.sum()) / max(n, 1), 4),
                "rejection": round(float(rejection.sum()) / max(n, 1), 4),
            }
        entry["seconds"] = round(time.perf_counter() - started, 1)
        result["prompts"].append(entry)
        write_report(result, out)
        tqdm.write(f"{p.id}: {entry['by_temperature']} in {entry['seconds']} s")
    write_report(result, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
