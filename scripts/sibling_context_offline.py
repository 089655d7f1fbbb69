#!/usr/bin/env python
"""Sibling context offline: what do the n samples of one prompt give each other's suffix drafts?

Seer's grouped drafting context (../shared/papers) lets the n rollouts of a prompt draft from each other's
text; issue 41 asks group scope for +15% tokens per round over request scope. The served rollouts measure
the adapter's share of that (group against request scope: -1% to +4%, docs/results.md), but not the
suffix proposer's: its trie is server-wide in every scope (sglang/suffix.py), so every sample already drafts
from its siblings. This script measures, offline and exactly, what that sharing is worth, and what it would
be worth if the siblings ran one after another (an RL engine with fewer slots than samples).

Answers: ``--samples`` answers per prompt, sampled by the target at ``--temperature`` (Hugging Face, seeded
per prompt), cached under the sglang-tts cache (a stopped run continues where it was). Then each answer is
drafted round by round by the serving suffix proposer (``SuffixProposer``: SGLang's NGRAM corpus, chains of
``--chain`` tokens), and a round accepts the chain's leading tokens that equal the answer's next tokens, plus
the target's own token. With the answer fixed (a seeded sample does not depend on what was drafted, as the
CPU layer's seeded verify guarantees), that is exactly what the verify keeps. Every round drafts the suffix
chain (the suffix proposer alone, not the hybrid's rule), and rounds go in lockstep over the samples in
flight, as a batch's do. What the trie holds, per context:
- request: the sample's prompt and its own answer so far (each request alone);
- group: the prompt and every sibling's answer so far, all ``--samples`` in flight (the rollout benchmark's shape);
- group, ``--slots`` in flight: the same with that many samples running and the rest queued, each starting
  when one finishes, so late samples draft from earlier siblings' whole answers;
- server: one trie for the whole run (the serving default): the prompts run one after another, each
  prompt's group in flight, and the earlier prompts' answers stay.
Writes ``sibling_context.json``, ``.md`` and ``.png`` under ``--out``::

    .venv/bin/python scripts/sibling_context_offline.py --model Qwen2.5-Coder-0.5B-Instruct --samples 8 \\
        --out docs/results/sibling-context-offline
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from sglang_tts.assets import cache_root, resolve_model
from sglang_tts.bench.report import machine_info, table, write_rows_report
from sglang_tts.bench.workload import chat_prompts, sample_prompts
from sglang_tts.sglang.suffix import SuffixProposer
from sglang_tts.training.data import atomic_save

CONTEXTS = ("request", "group", "group-slots", "server")


@dataclass
class Row:
    prompt: str  # a prompt id, or "all"
    context: str  # CONTEXTS
    samples: int
    rounds: int
    tokens: int
    tokens_per_round: float
    full_chain_share: float  # rounds whose trie offered a whole chain
    per_sample: list[float]  # tokens per round of each sample, in start order


def sampled_answers(
    model, prompt_ids: list[int], n: int, max_new_tokens: int, temperature: float, seed: int, stop: set[int]
) -> list[list[int]]:
    """n answers to one prompt (one batch: the same prompt n times), each cut after its first stop token."""
    ids = torch.tensor([prompt_ids] * n)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=True,
            temperature=temperature,
            top_p=1.0,
            top_k=0,
            pad_token_id=min(stop),
        )
    answers = []
    for row in out[:, ids.shape[1] :].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
        answers.append(row[:cut])
    return answers


def simulate(
    groups: Sequence[tuple[str, list[int], list[list[int]]]], context: str, chain: int, slots: int | None = None
) -> list[Row]:
    """Draft every answer round by round (module docstring); one Row per prompt."""
    server = SuffixProposer(chain) if context == "server" else None
    rows = []
    for pid, prompt, answers in groups:
        group = SuffixProposer(chain) if context in ("group", "group-slots") else None
        tries = [server or group or SuffixProposer(chain) for _ in answers]
        pos, rounds, full = [0] * len(answers), [0] * len(answers), [0] * len(answers)
        queue = list(range(len(answers)))
        running: list[int] = []
        width = slots if context == "group-slots" and slots else len(answers)
        while queue or running:
            while queue and len(running) < width:  # a free slot: the next sample starts (its prompt enters)
                j = queue.pop(0)
                tries[j].add_prompts([prompt])
                running.append(j)
            for j in running:
                answer, ctx = answers[j], prompt + answers[j][: pos[j]]
                drafted = tries[j].propose([f"{pid}/{j}"], [ctx[-tries[j].depth :]], [len(ctx)])[0]
                truth = answer[pos[j] : pos[j] + chain]
                kept = 0
                while kept < min(len(drafted), len(truth)) and drafted[kept] == truth[kept]:
                    kept += 1
                rounds[j] += 1
                full[j] += len(drafted) == chain
                pos[j] += min(kept + 1, len(answer) - pos[j])
            for j in running:  # the round's commits enter the trie(s)
                ctx = prompt + answers[j][: pos[j]]
                tries[j].observe([ctx[-tries[j].depth :]])
            done = [j for j in running if pos[j] >= len(answers[j])]
            for j in done:
                tries[j].forget([f"{pid}/{j}"])
            running = [j for j in running if j not in done]
        tokens = sum(len(a) for a in answers)
        rows.append(
            Row(
                pid,
                context,
                len(answers),
                sum(rounds),
                tokens,
                tokens / sum(rounds),
                sum(full) / sum(rounds),
                [round(len(a) / r, 3) for a, r in zip(answers, rounds)],
            )
        )
    return rows


def pooled(rows: Sequence[Row], context: str) -> Row:
    mine = [r for r in rows if r.context == context]
    rounds, tokens = sum(r.rounds for r in mine), sum(r.tokens for r in mine)
    full = sum(r.full_chain_share * r.rounds for r in mine) / rounds
    return Row("all", context, sum(r.samples for r in mine), rounds, tokens, tokens / rounds, full, [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen2.5-Coder-0.5B-Instruct")
    ap.add_argument("--datasets", nargs="+", default=["reasoning"])
    ap.add_argument("--num-prompts", type=int, default=2, help="prompts (the rollout benchmark's, seed 0: its steps')")
    ap.add_argument("--samples", type=int, default=8, help="n: answers per prompt")
    ap.add_argument("--slots", type=int, default=4, help="samples in flight for the group-slots context")
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chain", type=int, default=3, help="drafted tokens per round (the EAGLE-3 chain's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/results/sibling-context-offline")
    args = ap.parse_args()
    if args.temperature <= 0 or args.samples < 2 or args.slots < 1 or args.max_new_tokens < 1 or args.chain < 1:
        ap.error(
            "--temperature must be > 0 (siblings of a greedy prompt are one answer); --samples >= 2; "
            "--slots, --max-new-tokens and --chain >= 1"
        )
    torch.set_num_threads(args.threads)

    from sglang_tts.training.target import load_target

    model_path = Path(resolve_model(args.model))
    prompts = chat_prompts(sample_prompts(args.datasets, args.num_prompts, args.seed), model_path)
    cache = cache_root() / "sibling-offline"
    cache.mkdir(parents=True, exist_ok=True)
    sampling = f"n{args.samples}-{args.max_new_tokens}-t{args.temperature:g}"
    tag = f"{args.model}-{'_'.join(args.datasets)}-{args.seed}-{sampling}"
    cache_file = cache / f"{tag}.pt"
    done = torch.load(cache_file) if cache_file.exists() else {}
    model = None
    started = time.perf_counter()
    for i, p in enumerate(tqdm(prompts, desc="answers", unit="prompt")):
        if p.id not in done:
            if model is None:
                model, tokenizer, _ = load_target(model_path)
                stop = {t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None}
                eos = getattr(model.generation_config, "eos_token_id", None)
                stop |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
            seed = args.seed * 1_000_003 + i
            done[p.id] = (
                list(p.input_ids),
                sampled_answers(
                    model, list(p.input_ids), args.samples, args.max_new_tokens, args.temperature, seed, stop
                ),
            )
            atomic_save(done, cache_file)
    groups = [(p.id, *done[p.id]) for p in prompts]

    rows: list[Row] = []
    for context in CONTEXTS:
        rows += simulate(groups, context, args.chain, args.slots)
    rows += [pooled(rows, c) for c in CONTEXTS]
    base = {r.prompt: r.tokens_per_round for r in rows if r.context == "request"}
    label = {"group-slots": f"group, {args.slots} in flight"}

    def line(r: Row) -> list[str]:
        gain = r.tokens_per_round / base[r.prompt] - 1
        return [
            r.prompt,
            label.get(r.context, r.context),
            str(r.samples),
            str(r.rounds),
            f"{r.tokens_per_round:.3f}",
            f"{gain:+.1%}",
            f"{r.full_chain_share:.2f}",
            " ".join(f"{x:.2f}" for x in r.per_sample),
        ]

    lengths = {pid: [len(a) for a in answers] for pid, _, answers in groups}
    markdown = "\n".join(
        [
            "# Sibling context offline: what the samples of one prompt give each other's suffix drafts",
            "",
            f"`{' '.join(['python scripts/sibling_context_offline.py', *sys.argv[1:]])}`",
            "",
            f"{args.model}, {len(prompts)} {'/'.join(args.datasets)} prompts x {args.samples} answers sampled at T = "
            f"{args.temperature:g} (up to {args.max_new_tokens} tokens; lengths {lengths}); the serving suffix "
            f"proposer drafts a chain of {args.chain} every round (not the hybrid's rule: no drafter rounds); "
            "a round keeps the chain's leading tokens that equal the answer's and the target's own token. "
            "Gains are over `request` (each sample alone). Per sample: tokens per round in start order.",
            "",
            table(
                [
                    "prompt",
                    "context",
                    "samples",
                    "rounds",
                    "tokens/round",
                    "vs request",
                    "full chain offered",
                    "per sample",
                ],
                [line(r) for r in rows],
            ),
            "",
        ]
    )
    meta = {
        "argv": sys.argv,
        "machine": machine_info(),
        "lengths": lengths,
        "seconds": round(time.perf_counter() - started, 1),
    }

    def plot(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for c in CONTEXTS:
            per = [r.per_sample for r in rows if r.context == c and r.prompt != "all"]
            means = [statistics.fmean(col) for col in zip(*per)]
            ax.plot(range(1, len(means) + 1), means, marker="o", label=label.get(c, c))
        ax.set_xlabel("sample, in start order")
        ax.set_ylabel("tokens per round (suffix proposer alone)")
        ax.set_title(f"Sibling context, {len(prompts)} prompts x {args.samples} at T={args.temperature:g}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_rows_report(out, "sibling_context", meta, rows, markdown, plot)


if __name__ == "__main__":
    main()
