#!/usr/bin/env python
"""How well does the hybrid's rule pick who drafts each round? Replayed offline against an oracle.

The target (HF transformers, fp32) writes a greedy answer per prompt once (cached). One forward over prompt +
answer and the drafter's training-time unroll (`chain_hits`, the serving drafter's math, teacher forced) give
the frozen EAGLE-3 drafter's accepted length at every position: what it would have had accepted in a round
that starts there. Each rule then walks the answer round by round, as a server serving that request one at a
time would, with the serving code: SGLang's NGRAM corpus through `SuffixProposer` (the prompt entered at the
start, every round's tail after it; one trie for the whole run, as one server's) and `HybridChooser`. A round
verifies the chosen chain: it commits that proposer's accepted tokens and the bonus token. Greedy verification
does not depend on the proposal, so every rule writes the same answer, in its own rounds.

Rules: `drafter` (every round), `suffix` (every round, SGLang's NGRAM at the drafter's chain length),
`average` (the suffix proposer's moving average of accepted tokens against the drafter's: the rule before
2026-12-08), `margin` (the same with `--tts-hybrid-margin 0.2`), `chain` (the chain at hand's score,
`core/hybrid.chain_score`: the default), and `oracle` (whichever of the two chains commits more per
second, knowing both outcomes).

Reported per prompt, per workload and pooled: tokens per round, rounds and accepted tokens per proposer, and a
modelled speed at each `--cost-ratio` (a drafter round's cost over a suffix round's: 1.11 one at a time on the
2-core CPU testbed, where the drafter's three steps take 16 of about 150 ms), relative to the drafter alone.
Answers that loop (distinct word 4-grams below 0.5 in a quarter) are marked and pooled apart.

    .venv/bin/python scripts/hybrid_rule_offline.py --model Qwen2.5-Coder-0.5B-Instruct \\
        --datasets reasoning long-gen long-context --num-prompts 2 --out docs/results/hybrid-rule-offline

Writes hybrid_rule.json, .md and .png under --out after every prompt. The answers and the drafter's accepted
lengths (the minutes) are cached; a rerun reuses them and walks again (seconds).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from sglang_tts.assets import cache_root
from sglang_tts.bench.repetition import REPETITIVE_BELOW, distinct_by_quarter
from sglang_tts.bench.report import machine_info, pyplot, table, write_json
from sglang_tts.bench.workload import chat_prompts, sample_prompts
from sglang_tts.core.hybrid import DRAFTER, SUFFIX, HybridChooser, HybridRule, common_prefix
from sglang_tts.sglang.suffix import SuffixProposer
from sglang_tts.training.eagle3 import chain_hits
from sglang_tts.training.target import cached_greedy_answers, load_target_and_drafter

RULES = ("drafter", "suffix", "average", "margin", "chain", "oracle")
MARGIN = 0.2


@dataclass
class Walk:
    """One rule along one answer."""

    prompt: str
    dataset: str
    rule: str
    tokens: int = 0
    rounds: dict[str, int] = field(default_factory=lambda: {SUFFIX: 0, DRAFTER: 0})
    accepted: dict[str, int] = field(default_factory=lambda: {SUFFIX: 0, DRAFTER: 0})

    @property
    def total_rounds(self) -> int:
        return self.rounds[SUFFIX] + self.rounds[DRAFTER]

    def speed(self, ratio: float) -> float:
        """Tokens per suffix-round time: rounds cost 1, drafter rounds `ratio`."""
        return self.tokens / max(self.rounds[SUFFIX] + ratio * self.rounds[DRAFTER], 1e-9)


def drafter_accepts(hits: torch.Tensor, prompt_len: int, answer_len: int) -> list[int]:
    """[answer_len]: the drafter's accepted length (leading hits) in a round whose context is prompt +
    answer[:i]. `hits` is `chain_hits` of prompt + answer: row t drafts the tokens at t + 2 on, so a context
    of c tokens reads row c - 2."""
    accepted = hits.int().cumprod(-1).sum(-1)
    return [int(accepted[prompt_len + i - 2]) for i in range(answer_len)]


def walk(
    rule: str,
    prompt_id: str,
    dataset: str,
    prompt: list[int],
    answer: list[int],
    drafter: Sequence[int],
    proposer: SuffixProposer,
    chooser: HybridChooser,
    ratio: float,
) -> Walk:
    """`rule` along one answer (module docstring). `drafter[i]`: the drafter's accepted length from answer
    position i; `proposer` and `chooser` carry over from the run's earlier prompts, as one server's do."""
    chain_len = proposer.steps
    out = Walk(prompt_id, dataset, rule)
    rid = f"{rule}/{prompt_id}"
    proposer.add_prompts([prompt])
    ids, i = prompt + answer, 0
    while i < len(answer):
        context = ids[: len(prompt) + i]
        chain = proposer.propose([rid], [context[-proposer.depth :]], [len(context)])[0]
        suffix_accepts = common_prefix(chain, answer[i : i + chain_len])
        output = answer[:i]
        if rule == "chain" and len(chain) >= chain_len:
            take = chooser.choose(rid, chain, output, score=chooser.score(rid, prompt, output, chain))
        else:
            take = chooser.choose(rid, chain, output)
        if rule in ("drafter", "suffix"):
            take = rule == "suffix"
        elif rule == "oracle":
            take = (1 + suffix_accepts) * ratio >= 1 + drafter[i]
        chooser.requests[rid].choice = SUFFIX if take else DRAFTER  # what the round verified
        proposer_name = SUFFIX if take else DRAFTER
        got = min(suffix_accepts if take else drafter[i], len(answer) - i - 1)  # none past the answer's end
        chooser.accepted(rid, got)
        out.rounds[proposer_name] += 1
        out.accepted[proposer_name] += got
        step = got + 1
        i += step
        out.tokens += step
        proposer.observe([ids[: len(prompt) + i][-proposer.depth :]])
    proposer.forget([rid])
    chooser.forget(rid)
    return out


def rule_for(name: str, chain_len: int) -> HybridRule:
    return HybridRule(
        chain_len, margin=MARGIN if name == "margin" else 0.0, score="chain" if name == "chain" else "average"
    )


def pooled(walks: Sequence[Walk], prompt: str, dataset: str, rule: str) -> Walk:
    total = Walk(prompt, dataset, rule)
    for w in walks:
        total.tokens += w.tokens
        for p in (SUFFIX, DRAFTER):
            total.rounds[p] += w.rounds[p]
            total.accepted[p] += w.accepted[p]
    return total


def summary_rows(walks: Sequence[Walk], answers: dict[str, dict]) -> list[tuple[str, str, list[Walk]]]:
    """(label, what it pools, one Walk per rule) per prompt, per workload, and pooled with and without loops."""
    rules = list(dict.fromkeys(w.rule for w in walks))
    groups: list[tuple[str, str, list[str]]] = []
    prompts = list(dict.fromkeys(w.prompt for w in walks))
    for pid in prompts:
        loop = " (loops)" if answers[pid]["loops"] else ""
        groups.append((f"{pid}{loop}", answers[pid]["dataset"], [pid]))
    for ds in dict.fromkeys(answers[p]["dataset"] for p in prompts):
        groups.append((f"**{ds}**", ds, [p for p in prompts if answers[p]["dataset"] == ds]))
    fresh = [p for p in prompts if not answers[p]["loops"]]
    groups.append(("**pooled, answers that do not loop**", "all", fresh))
    groups.append(("**pooled, all answers**", "all", prompts))
    out = []
    for label, ds, members in groups:
        per_rule = [pooled([w for w in walks if w.prompt in members and w.rule == r], label, ds, r) for r in rules]
        if members and all(w.total_rounds for w in per_rule):
            out.append((label, ds, per_rule))
    return out


def write_report(out: Path, meta: dict, walks: list[Walk], answers: dict[str, dict]) -> None:
    ratios = meta["cost_ratios"]
    rows = summary_rows(walks, answers)
    write_json(out / "hybrid_rule.json", {"meta": meta, "answers": answers, "walks": [asdict(w) for w in walks]})
    r0 = ratios[0]
    body = [
        "# Who drafts each round: the hybrid's rules replayed offline",
        "",
        f"Target `{meta['model']}`, drafter `{meta['drafter']}` (frozen), chain of {meta['chain']}, greedy answers "
        f"of up to {meta['answer_tokens']} tokens to {len(answers)} prompts ({', '.join(meta['datasets'])}), "
        "one trie and one rule state for the whole run (one server's). Speed is modelled: a suffix round costs 1, "
        "a drafter round the cost ratio; relative to the drafter alone. Command:",
        "",
        f"    {meta['command']}",
        "",
        f"## Modelled speed (cost ratio {r0:g}) and tokens per round",
        "",
    ]
    rules = list(dict.fromkeys(w.rule for w in walks))
    lines = []
    for label, _, per_rule in rows:
        base = per_rule[0].speed(r0) if per_rule[0].rule == "drafter" else None
        cells = []
        for w in per_rule:
            rel = f"{w.speed(r0) / base:.3f}" if base else f"{w.speed(r0):.3f}"
            cells.append(f"{rel} ({w.tokens / w.total_rounds:.2f})")
        lines.append([label, *cells])
    body += [table(["prompt", *rules], lines), ""]
    body += ["## Rounds per proposer (accepted drafted tokens per round)", ""]
    lines = []
    for label, _, per_rule in rows:
        cells = []
        for w in per_rule:
            s, d = w.rounds[SUFFIX], w.rounds[DRAFTER]
            cells.append(
                f"{s} ({w.accepted[SUFFIX] / s if s else 0:.2f}) / {d} ({w.accepted[DRAFTER] / d if d else 0:.2f})"
            )
        lines.append([label, *cells])
    body += [table(["prompt: suffix / drafter", *rules], lines), ""]
    if len(ratios) > 1:
        body += ["## Modelled speed at each cost ratio, pooled", ""]
        lines = []
        for label, _, per_rule in rows:
            if not label.startswith("**pooled"):
                continue
            for r in ratios:
                base = per_rule[0].speed(r)
                lines.append([f"{label} at {r:g}", *[f"{w.speed(r) / base:.3f}" for w in per_rule]])
        body += [table(["pooled", *rules], lines), ""]
    body += ["## Answers", ""]
    body += [
        table(
            ["prompt", "workload", "prompt tokens", "answer tokens", "distinct 4-grams per quarter"],
            [
                [
                    pid,
                    a["dataset"],
                    str(a["prompt_tokens"]),
                    str(a["answer_tokens"]),
                    " ".join("-" if q is None else f"{q:.2f}" for q in a["distinct"]),
                ]
                for pid, a in answers.items()
            ],
        ),
        "",
    ]
    (out / "hybrid_rule.md").write_text("\n".join(body))

    plt = pyplot()
    labels = [label.strip("*") for label, _, _ in rows]
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(labels)), 4.5))
    width = 0.8 / len(rules)
    for j, rule in enumerate(rules):
        values = [per_rule[j].speed(r0) / per_rule[0].speed(r0) for _, _, per_rule in rows]
        ax.bar([x + j * width for x in range(len(rows))], values, width, label=rule)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))])
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(f"modelled speed vs drafter alone (cost ratio {r0:g})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "hybrid_rule.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[Walk]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen2.5-Coder-0.5B-Instruct")
    ap.add_argument("--drafter", default=None, help="EAGLE-3 drafter folder (default: the shipped one)")
    ap.add_argument("--datasets", nargs="+", default=["reasoning", "long-gen", "long-context"])
    ap.add_argument("--num-prompts", type=int, default=2, help="per workload (the benchmarks' held-out prompts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--answer-tokens", type=int, default=1024)
    ap.add_argument("--chain", type=int, default=3)
    ap.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    ap.add_argument(
        "--cost-ratio",
        type=float,
        nargs="+",
        default=[1.11, 1.3],
        help="a drafter round's cost over a suffix round's (the first is the report's and the oracle's)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/results/hybrid-rule-offline")
    ap.add_argument("--cache-dir", default=None, help="where answers and drafter hits are cached")
    args = ap.parse_args(argv)
    if args.chain < 1 or args.num_prompts < 1 or args.answer_tokens < 1 or min(args.cost_ratio) < 1.0:
        ap.error("--chain, --num-prompts and --answer-tokens must be >= 1, --cost-ratio >= 1.0")
    torch.set_num_threads(args.threads)
    rules = ["drafter", *[r for r in args.rules if r != "drafter"]]  # the first is the speed baseline

    loaded = load_target_and_drafter(args.model, args.drafter)
    cache = Path(args.cache_dir) if args.cache_dir else cache_root() / "hybrid-rule-offline"
    cache.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": loaded.target_path.name,
        "drafter": str(loaded.drafter_path),
        "datasets": args.datasets,
        "num_prompts": args.num_prompts,
        "seed": args.seed,
        "answer_tokens": args.answer_tokens,
        "chain": args.chain,
        "cost_ratios": args.cost_ratio,
        "rules": rules,
        "margin": MARGIN,
        "command": "python scripts/hybrid_rule_offline.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine_info(),
    }
    answers: dict[str, dict] = {}
    hits_file = cache / f"hits-{loaded.drafter_path.name}-{args.chain}.pt"
    accepts: dict[str, list[int]] = torch.load(hits_file) if hits_file.exists() else {}

    # One proposer and one chooser per rule for the whole run (one server per configuration).
    proposers = {r: SuffixProposer(args.chain) for r in rules}
    choosers = {r: HybridChooser(rule_for(r, args.chain)) for r in rules}
    walks: list[Walk] = []
    todo = [
        (ds, p)
        for ds in args.datasets
        for p in chat_prompts(sample_prompts([ds], args.num_prompts, args.seed), loaded.target_path)
    ]
    from transformers import AutoTokenizer  # the answers' words, for the repetition score

    tokenizer = AutoTokenizer.from_pretrained(loaded.target_path)
    started = time.perf_counter()
    for ds, p in tqdm(todo, desc="prompts", unit="prompt"):
        name = f"answers-{loaded.target_path.name}-{ds}-{args.num_prompts}-{args.seed}-{args.answer_tokens}.pt"
        prompt, answer = cached_greedy_answers(loaded.model, [p], args.answer_tokens, cache / name)[p.id]
        if p.id not in accepts:
            hits = chain_hits(loaded.model, loaded.drafter, torch.tensor(prompt + answer), args.chain)
            accepts[p.id] = drafter_accepts(hits, len(prompt), len(answer))
            torch.save(accepts, hits_file)
        distinct = distinct_by_quarter(tokenizer.decode(answer))
        answers[p.id] = {
            "dataset": ds,
            "prompt_tokens": len(prompt),
            "answer_tokens": len(answer),
            "distinct": distinct,
            "loops": any(q is not None and q < REPETITIVE_BELOW for q in distinct),
        }
        for r in rules:  # every prompt walks every rule, so the run's tries and states grow as a server's
            walks.append(
                walk(r, p.id, ds, prompt, answer, accepts[p.id], proposers[r], choosers[r], args.cost_ratio[0])
            )
        meta["seconds"] = round(time.perf_counter() - started, 1)
        write_report(out, meta, walks, answers)
    for label, _, per_rule in summary_rows(walks, answers):
        base = per_rule[0].speed(args.cost_ratio[0])
        print(label, " ".join(f"{w.rule} {w.speed(args.cost_ratio[0]) / base:.3f}" for w in per_rule))
    return walks


if __name__ == "__main__":
    main()
