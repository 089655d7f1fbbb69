#!/usr/bin/env python
"""Prompt-time adaptation offline: does learning the prompt help the drafter draft the answer?

For held-out prompts of a workload, the target (HF transformers, fp32) writes a greedy answer once
(cached), then one forward over prompt + answer gives the target features the drafter reads and the
target's greedy token at every position. Per setting (positions, steps, learning rate, depth, which
parameters), a copy of the EAGLE-3 drafter takes one prompt update through the serving code path
(`Distiller.submit_prompt` on a `PromptWindow` of the last N prompt positions, exactly what the
server captures at prefill) and is scored on the answer:

- accepted drafts per chain: over the first `--eval-tokens` answer positions, chains of
  `--chain` greedy drafts (SGLang's chain shape) anchored at every position, the leading drafts
  equal to the target's greedy tokens (tokens per verify round = 1 + this); the frozen drafter's
  value is the baseline.

Two scores per setting: with every drafter K/V recomputed by the scored weights, and "as served",
where the answer rows read the prompt's K/V computed by the frozen drafter (what SGLang's draft KV
cache holds: the prompt update runs after the prefill wrote it).
Writes ``prompt_adapt_offline.json``, ``.md`` and ``.png`` under ``--out``::

    .venv/bin/python scripts/prompt_adapt_offline.py --model Qwen2.5-Coder-0.5B-Instruct \\
        --datasets long-context --num-prompts 4 --out docs/results/prompt-adapt-offline
"""

from __future__ import annotations

import argparse
import copy
import statistics
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

# (name, positions, steps, lr, depth, trainable prefixes or None for all)
SETTINGS = {
    "all-3e-4": (512, 4, 3e-4, 3, ("",)),
    "all-3e-5": (512, 4, 3e-5, 3, ("",)),
    "lm_head-3e-4": (512, 4, 3e-4, 3, ("lm_head",)),
    "fc-3e-4 (default)": (512, 4, 3e-4, 3, ("fc",)),
    "fc-3e-4-8steps": (512, 8, 3e-4, 3, ("fc",)),
    "fc-1e-3": (512, 4, 1e-3, 3, ("fc",)),
    "fc-3e-4-1024pos": (1024, 4, 3e-4, 3, ("fc",)),
    "fc-3e-4-depth1": (512, 4, 3e-4, 1, ("fc",)),
}


@dataclass
class Row:
    prompt: str
    setting: str
    prompt_tokens: int
    answer_tokens: int
    accepted: float  # accepted drafts per chain over the evaluated answer positions
    accepted_served: float  # ... with the prompt's K/V from the frozen drafter, as a server holds them
    frozen: float
    gain_pct: float
    gain_served_pct: float
    loss_first: float
    loss_last: float
    update_s: float


@torch.no_grad()
def chain_drafts(drafter, prompt_len: int, ids, feats, chain: int, prompt_kv_from=None) -> torch.Tensor:
    """The drafter's greedy chain (target token ids) [R, chain] at every answer row, teacher forced: row r
    (0 = the first answer token) embeds token prompt_len + r, and its draft j predicts token
    prompt_len + r + j + 1, which the target's logits at position prompt_len - 1 + r + j + 1 score.
    prompt_kv_from: a drafter whose K/V of the prompt rows the answer rows read (as served: SGLang's
    draft KV cache holds the prompt's K/V of the drafter that ran the prefill); None: `drafter`'s own."""
    length = ids.shape[0]
    first = prompt_len - 1  # row t embeds token t + 1: this row is anchored at the first answer token
    positions = torch.arange(1, length)[None]
    if prompt_kv_from is None:
        hidden = drafter.ttt_hidden(ids[None, 1:], feats[None, :-1], positions, steps=chain, first_row=first)
    else:
        past = prompt_kv_from.kv_for_context(ids[None, 1 : first + 1], feats[None, :first], positions[:, :first])
        hidden = drafter.ttt_hidden(
            ids[None, first + 1 :], feats[None, first:-1], positions[:, first:], steps=chain, past_kv=past
        )
    head, d2t = drafter.lm_head_weight(), drafter.draft_to_target_ids()
    return torch.stack([d2t[(hidden[j][0] @ head.T).argmax(-1)] for j in range(chain)], -1)


@torch.no_grad()
def accepted_per_chain(
    drafter, prompt_len: int, ids, feats, top1, chain: int, eval_tokens: int, prompt_kv_from=None
) -> float:
    """Mean leading drafts equal to the target's greedy tokens, chains anchored at answer positions
    (`chain_drafts`; `top1` [T]: the target's greedy next token at every position)."""
    length = ids.shape[0]
    first = prompt_len - 1
    drafts = chain_drafts(drafter, prompt_len, ids, feats, chain, prompt_kv_from)
    rows = torch.arange(first, length - 1)
    hits = torch.stack([drafts[:, j] == top1[(rows + j + 1).clamp(max=length - 1)] for j in range(chain)], -1)
    end = min(first + eval_tokens, length - 1 - chain)
    return float(hits[: end - first].int().cumprod(-1).sum(-1).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen2.5-Coder-0.5B-Instruct")
    ap.add_argument("--drafter", default=None, help="EAGLE-3 drafter folder (default: the shipped one)")
    ap.add_argument("--datasets", nargs="+", default=["long-context"])
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--answer-tokens", type=int, default=384)
    ap.add_argument("--eval-tokens", type=int, default=256)
    ap.add_argument("--chain", type=int, default=3)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/results/prompt-adapt-offline")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from sglang_tts.training.target import cached_greedy_answers, load_target

    model_path = Path(resolve_model(args.model))
    model, _, target = load_target(model_path)
    drafter_path = args.drafter or shipped_drafter(args.model)
    base = load_drafter(drafter_path, target_embedding=target.embedding.float(), target_config=target.config)
    prompts = chat_prompts(sample_prompts(args.datasets, args.num_prompts, args.seed), model_path)
    cache = cache_root() / "prompt-offline"
    cache.mkdir(parents=True, exist_ok=True)
    tag = f"{args.model}-{'_'.join(args.datasets)}-{args.num_prompts}-{args.seed}-{args.answer_tokens}"
    texts = cached_greedy_answers(model, prompts, args.answer_tokens, cache / f"answers-{tag}.pt")

    rows: list[Row] = []
    bar = tqdm(total=len(prompts) * len(args.settings), desc="prompt updates", unit="update")
    for p in prompts:
        prompt_ids, answer_ids = texts[p.id]
        ids = torch.tensor(prompt_ids + answer_ids)
        with torch.no_grad():
            out = model(ids[None], output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i + 1][0] for i in base.cfg.aux_layer_ids], -1)
        top1 = out.logits[0].argmax(-1)
        n = len(prompt_ids)
        frozen = accepted_per_chain(base, n, ids, feats, top1, args.chain, args.eval_tokens)
        for name in args.settings:
            positions, steps, lr, depth, trainable = SETTINGS[name]
            config = TTSConfig(
                prompt_adapt="only", prompt_positions=positions, prompt_steps=steps, prompt_lr=lr,
                prompt_depth=depth, prompt_trainable=trainable, log_interval=0,
            )  # fmt: skip
            drafter = copy.deepcopy(base)
            distiller = Distiller(drafter, config)
            window = cut_window(PromptWindow(p.id, ids[: n + 1].clone(), feats[:n].clone(), 0), positions)
            start = time.perf_counter()
            distiller.submit_prompt(collate_windows([window], "cpu"))
            distiller.barrier(force=True)
            seconds = time.perf_counter() - start
            score = accepted_per_chain(drafter, n, ids, feats, top1, args.chain, args.eval_tokens)
            served = accepted_per_chain(drafter, n, ids, feats, top1, args.chain, args.eval_tokens, base)
            stats = distiller.stats
            rows.append(
                Row(p.id, name, n, len(answer_ids), score, served, frozen, 100 * (score - frozen) / max(frozen, 1e-9),
                    100 * (served - frozen) / max(frozen, 1e-9), stats.last_prompt_loss, stats.last_prompt_loss_after,
                    seconds)
            )  # fmt: skip
            bar.update(1)
    bar.close()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    by_setting = {s: [r for r in rows if r.setting == s] for s in args.settings}
    summary = [
        [
            s,
            f"{statistics.mean(r.frozen for r in rs):.3f}",
            f"{statistics.mean(r.accepted for r in rs):.3f}",
            f"{statistics.mean(r.gain_pct for r in rs):+.1f}%",
            f"{sum(r.accepted > r.frozen for r in rs)}/{len(rs)}",
            f"{statistics.mean(r.accepted_served for r in rs):.3f}",
            f"{statistics.mean(r.gain_served_pct for r in rs):+.1f}%",
            f"{statistics.mean(r.update_s for r in rs):.1f}",
        ]
        for s, rs in by_setting.items()
    ]
    per_prompt = [
        [r.prompt, str(r.prompt_tokens), r.setting, f"{r.frozen:.3f}", f"{r.accepted:.3f}", f"{r.gain_pct:+.1f}%",
         f"{r.accepted_served:.3f} ({r.gain_served_pct:+.1f}%)", f"{r.loss_first:.2f} -> {r.loss_last:.2f}"]
        for r in rows
    ]  # fmt: skip
    command = "python scripts/prompt_adapt_offline.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items()
        if v is not None
    )
    markdown = "\n".join(
        [
            "# Prompt-time adaptation offline",
            "",
            f"`{command}`",
            "",
            f"Drafter: `{Path(drafter_path).name}`; accepted drafts per chain of {args.chain} "
            f"(tokens per round = 1 + this) over the first {args.eval_tokens} tokens of greedy answers of "
            f"{args.answer_tokens} tokens, "
            "after one prompt update on the last N prompt positions (scripts/prompt_adapt_offline.py docstring).",
            "",
            table(
                [
                    "setting",
                    "frozen",
                    "after the prompt update",
                    "mean gain",
                    "prompts up",
                    "as served",
                    "gain as served",
                    "update s",
                ],
                summary,
            ),
            "",
            table(
                ["prompt", "prompt tokens", "setting", "frozen", "adapted", "gain", "as served", "prompt loss"],
                per_prompt,
            ),
            "",
        ]
    )
    meta = {
        "command": command,
        "drafter": str(drafter_path),
        "machine": machine_info(),
        "settings": {
            k: list(v[:4]) + [list(v[4]) if v[4] else None] for k, v in SETTINGS.items() if k in args.settings
        },
    }

    def plot(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4))
        names = list(by_setting)
        prompts_seen = list(dict.fromkeys(r.prompt for r in rows))
        width = 0.8 / max(len(prompts_seen), 1)
        for i, pid in enumerate(prompts_seen):
            gains = [next(r.gain_pct for r in by_setting[s] if r.prompt == pid) for s in names]
            ax.bar([x + i * width for x in range(len(names))], gains, width, label=pid)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names, rotation=20, ha="right")
        ax.set_ylabel("accepted drafts per chain vs frozen (%)")
        ax.set_title("One prompt update, scored on the answer")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    write_rows_report(out, "prompt_adapt_offline", meta, rows, markdown, plot)


if __name__ == "__main__":
    main()
