#!/usr/bin/env python
"""Policy drift offline: does learning the last step's rollouts under the new weights restore the drafter?

An RL trainer changes the policy between rollout steps, and an EAGLE-3 drafter reads the policy's hidden
states: a large change leaves it stale (docs/results.md, "Policy drift"). Between two steps the rollout
engine sits idle while the trainer trains, and it already holds the last step's rollouts. This script
measures, offline, what a *rehearsal* in that idle time would buy: the new policy reads the previous
step's texts (prompt + answer) once, and the drafter takes prompt updates on them (the serving code path
of `--tts-prompt-adapt`: `Distiller.submit_prompt` on `PromptWindow`s, labels the texts' own next tokens).

Per held-out prompt, the expected accepted drafts per chain (tokens per round = 1 + this) at every answer
position, teacher forced, under SGLang's default rule for a sampled chain ("target only": draft j is kept
with the target's probability of it at ``--temperature``, so a chain keeps sum_k prod_{j<=k} p(d_j)); at
temperature 0, the leading drafts equal to the target's greedy tokens. The answers are sampled at
``--temperature`` (1.0, as RL rollouts are; seeded per prompt; 0: greedy, where the drifted policy's answers
on this testbed loop or stop after a line). The ceiling: the same for an oracle drafter that proposes the
target's most likely token at every step, which no drafter beats in this score (each factor is the most a
draft can keep at its position): how much of a policy's fall any drafter must take. Scores:
- before: the base policy and the shipped drafter, on the base policy's answer;
- stale: the drifted policy (``--drift``) and the shipped drafter, on the drifted policy's answer;
- new text: the base policy and the shipped drafter on that same answer (the base policy's features and
  distribution): what the drifted policy's text alone costs, with the features the drafter was trained on;
- rehearsed: the drifted policy and the drafter after the rehearsal, on the same answer.
The rehearsal texts are the base policy's answers to other prompts of the same workload (the
previous step's rollouts; ``--rehearse-same``: to the held-out prompts themselves, as an RL step that
samples the same prompts again). ``--rehearse-from drift``: the drifted policy's own answers to the other
prompts instead: text of the new policy, as the current step's other rollouts are, which a server only has
once they are written (what learning from them can reach, however it is scheduled).
Writes ``drift_rehearsal.json``, ``.md`` and ``.png`` under ``--out``::

    .venv/bin/python scripts/drift_rehearsal_offline.py --model Qwen2.5-Coder-0.5B-Instruct \\
        --drift ~/.cache/sglang_tts/drift/Qwen2.5-Coder-0.5B-Instruct-gsm8k/ckpt-1 \\
        --out docs/results/drift-rehearsal-offline
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from sglang_tts.assets import cache_root, resolve_model
from sglang_tts.bench.report import machine_info, table, write_rows_report
from sglang_tts.bench.workload import chat_prompts, sample_prompts
from sglang_tts.config import TTSConfig
from sglang_tts.core.distiller import Distiller
from sglang_tts.core.prompt import PromptWindow, collate_windows, cut_window
from sglang_tts.drafters.loading import load_drafter
from sglang_tts.drafters.shipped import shipped_drafter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompt_adapt_offline import chain_drafts  # noqa: E402 - the sibling script's drafter chains

# name: (positions per text, optimizer steps, lr, trainable prefixes)
SETTINGS = {
    "fc-3e-4x4": (1024, 4, 3e-4, ("fc",)),
    "fc-1e-3x8": (1024, 8, 1e-3, ("fc",)),
    "fc-3e-3x8": (1024, 8, 3e-3, ("fc",)),
    "all-1e-4x8": (1024, 8, 1e-4, ("",)),
    "all-3e-4x8": (1024, 8, 3e-4, ("",)),
}


@dataclass
class Row:
    prompt: str
    setting: str
    before: float  # base policy, shipped drafter
    stale: float  # drifted policy, shipped drafter
    new_text: float  # base policy, shipped drafter, on the drifted policy's answer
    rehearsed: float  # drifted policy, rehearsed drafter
    kept_stale: float  # stale / before
    kept_rehearsed: float  # rehearsed / before
    oracle_before: float  # the ceiling on the base policy's answer
    oracle_stale: float  # ... on the drifted policy's
    rehearse_texts: int
    rehearse_positions: int
    update_s: float
    loss_first: float
    loss_last: float


@dataclass
class Read:
    """A policy's reading of one text: what the drafter takes and what verification keeps."""

    ids: torch.Tensor  # [T] prompt + answer
    prompt_len: int
    feats: torch.Tensor  # [T, F] the drafter's target features (its auxiliary layers)
    probs: torch.Tensor  # [T, V] the target's next-token distribution at the temperature (one-hot at 0)


@torch.no_grad()
def read(model, ids: torch.Tensor, prompt_len: int, layers, temperature: float) -> Read:
    out = model(ids[None], output_hidden_states=True)
    logits = out.logits[0].float()
    if temperature > 0:
        probs = torch.softmax(logits / temperature, -1)
    else:
        probs = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return Read(ids, prompt_len, torch.cat([out.hidden_states[i + 1][0] for i in layers], -1), probs)


def expected_accepted(r: Read, drafts: torch.Tensor, eval_tokens: int) -> float:
    """Mean over the first `eval_tokens` answer rows of sum_k prod_{j<=k} p(d_j) (module docstring);
    drafts [R, chain] as `chain_drafts` gives them."""
    length, first, chain = r.ids.shape[0], r.prompt_len - 1, drafts.shape[1]
    rows = torch.arange(first, length - 1)
    kept = torch.stack(
        [r.probs[(rows + j + 1).clamp(max=length - 1)].gather(-1, drafts[:, j : j + 1])[:, 0] for j in range(chain)],
        -1,
    )
    end = min(first + eval_tokens, length - 1 - chain)
    return float(kept[: end - first].cumprod(-1).sum(-1).mean())


def drafter_score(drafter, r: Read, chain: int, eval_tokens: int) -> float:
    return expected_accepted(r, chain_drafts(drafter, r.prompt_len, r.ids, r.feats, chain), eval_tokens)


def oracle_score(r: Read, chain: int, eval_tokens: int) -> float:
    """The ceiling: draft j is the target's most likely token at its position."""
    length, first = r.ids.shape[0], r.prompt_len - 1
    rows = torch.arange(first, length - 1)
    best = r.probs.argmax(-1)
    drafts = torch.stack([best[(rows + j + 1).clamp(max=length - 1)] for j in range(chain)], -1)
    return expected_accepted(r, drafts, eval_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen2.5-Coder-0.5B-Instruct")
    ap.add_argument("--drift", required=True, help="the drifted policy's folder (make_policy_drift.py's ckpt-K)")
    ap.add_argument("--drafter", default=None, help="EAGLE-3 drafter folder (default: the shipped one)")
    ap.add_argument("--datasets", nargs="+", default=["reasoning"])
    ap.add_argument("--num-prompts", type=int, default=4, help="held-out prompts scored")
    ap.add_argument("--rehearse-prompts", type=int, default=4, help="previous-step prompts rehearsed")
    ap.add_argument("--rehearse-same", action="store_true", help="rehearse the held-out prompts' base answers")
    ap.add_argument(
        "--rehearse-from", choices=("base", "drift"), default="base", help="whose answers the rehearsal trains on"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--answer-tokens", type=int, default=384)
    ap.add_argument("--temperature", type=float, default=1.0, help="answers sampled at this (0: greedy), seeded")
    ap.add_argument("--eval-tokens", type=int, default=256)
    ap.add_argument("--chain", type=int, default=3)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/results/drift-rehearsal-offline")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from sglang_tts.training.target import cached_answers, load_target, sequence_features

    model_path, drift_path = Path(resolve_model(args.model)), Path(args.drift).expanduser()
    base_model, _, target = load_target(model_path)
    drift_model, _, _ = load_target(drift_path)
    drafter_path = args.drafter or shipped_drafter(args.model)
    base = load_drafter(drafter_path, target_embedding=target.embedding.float(), target_config=target.config)
    layers = base.cfg.aux_layer_ids
    sampled = chat_prompts(
        sample_prompts(args.datasets, args.num_prompts + args.rehearse_prompts, args.seed), model_path
    )
    held_out = sampled[: args.num_prompts]
    previous = held_out if args.rehearse_same else sampled[args.num_prompts :]
    cache = cache_root() / "drift-offline"
    cache.mkdir(parents=True, exist_ok=True)
    tag = f"{'_'.join(args.datasets)}-{len(sampled)}-{args.seed}-{args.answer_tokens}-t{args.temperature:g}"
    answers = {"temperature": args.temperature, "seed": args.seed}
    base_file = cache / f"base-{args.model}-{tag}.pt"
    drift_file = cache / f"drift-{drift_path.parent.name}-{drift_path.name}-{tag}.pt"
    base_answers = cached_answers(base_model, sampled, args.answer_tokens, base_file, **answers)
    drift_for = sampled if args.rehearse_from == "drift" else held_out  # the same seeds: held_out leads sampled
    drift_answers = cached_answers(drift_model, drift_for, args.answer_tokens, drift_file, **answers)
    rehearsed_answers = drift_answers if args.rehearse_from == "drift" else base_answers

    # the previous step's rollouts, read by the new policy: what the rehearsal trains on
    texts = []
    for p in previous:
        ids = torch.tensor(sum(rehearsed_answers[p.id], []))
        with torch.no_grad():
            feats = sequence_features(drift_model, ids, layers)["hidden"].flatten(1)  # [T, F], read() order
        texts.append(PromptWindow(p.id, ids, feats[:-1].clone(), 0))
    chain, n_eval, temp = args.chain, args.eval_tokens, args.temperature
    scored = []
    for p in held_out:
        prompt_ids, answer_ids = base_answers[p.id]
        r_base = read(base_model, torch.tensor(prompt_ids + answer_ids), len(prompt_ids), layers, temp)
        before, oracle_before = drafter_score(base, r_base, chain, n_eval), oracle_score(r_base, chain, n_eval)
        del r_base
        prompt_ids, answer_ids = drift_answers[p.id]
        ids = torch.tensor(prompt_ids + answer_ids)
        r_new_text = read(base_model, ids, len(prompt_ids), layers, temp)
        new_text = drafter_score(base, r_new_text, chain, n_eval)
        del r_new_text
        r_drift = read(drift_model, ids, len(prompt_ids), layers, temp)
        stale, oracle_stale = drafter_score(base, r_drift, chain, n_eval), oracle_score(r_drift, chain, n_eval)
        scored.append((p.id, r_drift, before, stale, new_text, oracle_before, oracle_stale))

    rows: list[Row] = []
    for name in tqdm(args.settings, desc="rehearsals", unit="setting"):
        positions, steps, lr, trainable = SETTINGS[name]
        config = TTSConfig(
            prompt_adapt="only", prompt_positions=positions, prompt_steps=steps, prompt_lr=lr,
            prompt_depth=3, prompt_trainable=trainable, log_interval=0,
        )  # fmt: skip
        drafter = copy.deepcopy(base)
        distiller = Distiller(drafter, config)
        windows = [cut_window(w, positions) for w in texts]
        start = time.perf_counter()
        distiller.submit_prompt(collate_windows(windows, "cpu"))
        distiller.barrier(force=True)
        seconds = time.perf_counter() - start
        stats = distiller.stats
        for pid, r_drift, before, stale, new_text, oracle_before, oracle_stale in scored:
            after = drafter_score(drafter, r_drift, chain, n_eval)
            rows.append(
                Row(pid, name, before, stale, new_text, after, stale / max(before, 1e-9), after / max(before, 1e-9),
                    oracle_before, oracle_stale, len(windows), sum(w.num_positions for w in windows), seconds,
                    stats.last_prompt_loss, stats.last_prompt_loss_after)
            )  # fmt: skip

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    by_setting = {s: [r for r in rows if r.setting == s] for s in args.settings}
    mean = statistics.mean
    summary = [
        [
            s,
            f"{mean(r.before for r in rs):.3f}",
            f"{mean(r.stale for r in rs):.3f} ({mean(r.stale for r in rs) / mean(r.before for r in rs):.2f}x)",
            f"{mean(r.new_text for r in rs):.3f} ({mean(r.new_text for r in rs) / mean(r.before for r in rs):.2f}x)",
            f"{mean(r.rehearsed for r in rs):.3f} ({mean(r.rehearsed for r in rs) / mean(r.before for r in rs):.2f}x)",
            f"{(1 + mean(r.rehearsed for r in rs)) / (1 + mean(r.before for r in rs)):.2f}x",
            f"{sum(r.rehearsed > r.stale for r in rs)}/{len(rs)}",
            f"{rs[0].loss_first:.2f} -> {rs[0].loss_last:.2f}",
            f"{rs[0].update_s:.1f}",
        ]
        for s, rs in by_setting.items()
    ]
    per_prompt = [
        [r.prompt, r.setting, f"{r.before:.3f}", f"{r.stale:.3f}", f"{r.new_text:.3f}", f"{r.rehearsed:.3f}",
         f"{r.oracle_before:.3f}", f"{r.oracle_stale:.3f}"]
        for r in rows
    ]  # fmt: skip
    once = by_setting[args.settings[0]]
    ceiling_before, ceiling_after = mean(r.oracle_before for r in once), mean(r.oracle_stale for r in once)
    ceiling = [
        ["the shipped drafter", f"{mean(r.before for r in once):.3f}", f"{mean(r.stale for r in once):.3f}",
         f"{(1 + mean(r.stale for r in once)) / (1 + mean(r.before for r in once)):.2f}x"],
        ["the oracle (the target's most likely token)", f"{ceiling_before:.3f}", f"{ceiling_after:.3f}",
         f"{(1 + ceiling_after) / (1 + ceiling_before):.2f}x"],
    ]  # fmt: skip
    command = "python scripts/drift_rehearsal_offline.py " + " ".join(
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {' '.join(map(str, v)) if isinstance(v, list) else v}")
        for k, v in vars(args).items()
        if v is not None and v is not False
    )
    first = rows[0] if rows else None
    markdown = "\n".join(
        [
            "# Policy drift offline: rehearsing the last step's rollouts under the new weights",
            "",
            f"`{command}`",
            "",
            f"Drafter `{Path(drafter_path).name}`; drifted policy `{drift_path}`. Expected accepted drafts per "
            f"chain of {args.chain} at temperature {args.temperature:g} (target-only rule) over the first "
            f"{args.eval_tokens} tokens of answers sampled at that temperature (up to {args.answer_tokens} tokens) "
            f"on {len(scored)} held-out prompts; the rehearsal: one prompt update on "
            f"{first.rehearse_texts if first else 0} texts ({first.rehearse_positions if first else 0} positions) "
            f"of the {args.rehearse_from} policy's answers to "
            f"{'the same' if args.rehearse_same else 'other'} prompts, read by the drifted policy "
            "(scripts/drift_rehearsal_offline.py "
            "docstring). Ratios are to `before` (the base policy with the shipped drafter).",
            "",
            table(
                [
                    "setting",
                    "before",
                    "stale",
                    "new text",
                    "rehearsed",
                    "tokens per round kept",
                    "prompts up",
                    "loss",
                    "update s",
                ],
                summary,
            ),
            "",
            "The ceiling: what an oracle drafter keeps across the change (each policy on its own answers; tokens "
            "per round = 1 + accepted drafts):",
            "",
            table(["drafter", "base policy", "drifted policy", "tokens per round kept"], ceiling),
            "",
            table(
                ["prompt", "setting", "before", "stale", "new text", "rehearsed", "oracle before", "oracle after"],
                per_prompt,
            ),
            "",
        ]
    )
    meta = {
        "command": command,
        "drafter": str(drafter_path),
        "drift": str(drift_path),
        "machine": machine_info(),
        "settings": {k: [*v[:3], list(v[3])] for k, v in SETTINGS.items() if k in args.settings},
    }

    def plot(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        names = list(by_setting)
        before = mean(r.before for r in rows)
        ax.axhline(before, color="black", linewidth=1, label="before the change")
        ax.axhline(mean(r.stale for r in rows), color="tab:red", linewidth=1, label="stale drafter")
        ax.axhline(0.9 * (1 + before) - 1, color="gray", linestyle=":", label="90% of before's tokens per round")
        ax.bar(names, [mean(r.rehearsed for r in by_setting[s]) for s in names], color="tab:blue", label="rehearsed")
        ax.set_ylabel("accepted drafts per chain")
        ax.set_title("Drafter after a policy change, with and without a rehearsal")
        ax.tick_params(axis="x", rotation=20)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    write_rows_report(out, "drift_rehearsal", meta, rows, markdown, plot)


if __name__ == "__main__":
    main()
