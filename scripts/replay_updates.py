#!/usr/bin/env python
"""Replay TTS along long answers offline: which update schedule buys the most acceptance per update?

The target (HF transformers, fp32) writes a greedy answer per held-out prompt once (cached), and one
forward over prompt + answer gives the target features the EAGLE-3 drafter reads and the target's
logits at every answer position. The replay then walks along the answer round by round, as a server
serving that one request would, through the serving code path of the update (`Distiller`, inline):

- each round drafts a chain of `--chain` greedy tokens from the anchor (the canvas forward of the
  drafter as published), attending to a draft K/V cache that every round extends with the weights
  serving that round (SGLang's draft KV pool: entries are never rewritten); the target's greedy
  tokens decide the accepted length, and the round commits it plus the bonus token;
- every S rounds one update (one optimizer step) trains on
  - `latest:S`: the latest round's canvas (the paper's schedule, appendix C.1, TTS's default), or
  - `window:S`: every canvas of the last S rounds, stacked into one batch (each row reads the K/V
    cache as it was at its round: a prefix of today's, by its mask); `window:S:W`: the last W
    rounds of each stride of S (what a server with `--tts-update-window W` trains on at stride S);
  - `frozen`: never.

Reported per schedule: tokens per round overall and per quarter of the answer, updates and their
measured seconds, and a modelled tokens/s against frozen when an update costs serving its own
time (inline, as on a small CPU): rounds x `--round-ms` + update seconds. The replay also measures
the do-no-harm guard's comparison at every update: the base drafter's first-position matches with
the K/V cache as served (the adapted drafters' entries, what the server's guard reads) and with a
K/V cache of its own (what a frozen drafter would have read), beside the adapted drafter's.

    .venv/bin/python scripts/replay_updates.py --model Qwen2.5-Coder-0.5B-Instruct \\
        --datasets reasoning long-gen --num-prompts 1 --answer-tokens 1024 --out docs/results/replay-updates

Writes ``replay_updates.json``, ``.md`` and ``.png`` under ``--out`` after every prompt; a rerun
with the same arguments skips the (prompt, schedule) pairs already written.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from sglang_tts.assets import cache_root, resolve_model
from sglang_tts.bench.report import machine_info, table, write_rows_report
from sglang_tts.bench.workload import chat_prompts, sample_prompts
from sglang_tts.config import TTSConfig
from sglang_tts.core.canvas import Canvas
from sglang_tts.core.distiller import Distiller
from sglang_tts.drafters.common import KVCache, append_kv
from sglang_tts.drafters.loading import load_drafter
from sglang_tts.drafters.shipped import shipped_drafter

DEFAULT_SCHEDULES = ["frozen", "latest:1", "latest:2", "latest:4", "latest:8", "window:4", "window:8", "window:16"]


@dataclass
class Trace:
    """One answer, the target's side: ids [N] (prompt + answer), feats [N, F] (aux features of each
    position), final [N, H] (post-norm hidden: the target's logits are final @ lm_head.T)."""

    prompt_id: str
    ids: torch.Tensor
    feats: torch.Tensor
    final: torch.Tensor
    prompt_len: int


@dataclass
class Row:
    prompt: str
    schedule: str
    answer_tokens: int
    rounds: int
    tokens_per_round: float
    quarters: list[float]
    updates: int
    update_s: float
    ms_per_update: float
    modelled_speed: float  # tokens/s x frozen's, rounds at --round-ms plus the updates' own time
    guard_adapted: float  # first-position match rate at update rounds: the drafter that served
    guard_base_served: float  # ... base drafter with the served K/V cache (what the server's guard reads)
    guard_base_own: float  # ... base drafter with a K/V cache of its own
    guard_resets: int
    curve: list[float] = field(default_factory=list)  # tokens per round per --bucket answer tokens


@torch.no_grad()
def target_trace(model, prompt_id: str, prompt_ids: list[int], answer_ids: list[int], aux_layers) -> Trace:
    ids = torch.tensor(prompt_ids + answer_ids)
    out = model.model(ids[None], output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1][0] for i in aux_layers], -1)
    return Trace(prompt_id, ids, feats, out.hidden_states[-1][0].clone(), len(prompt_ids))


def kv_len(kv: KVCache) -> int:
    return int(kv[0][0].shape[2])


class Replay:
    """One schedule along one answer (module docstring)."""

    def __init__(self, trace: Trace, base, lm_head: torch.Tensor, schedule: str, config: TTSConfig, chain: int):
        self.trace, self.chain, self.lm_head = trace, chain, lm_head
        self.kind, _, rest = schedule.partition(":")
        stride, _, window = rest.partition(":")
        self.stride = int(stride or 0)
        self.window = int(window or stride or 0)
        self.drafter = copy.deepcopy(base)
        self.distiller = None if self.kind == "frozen" else Distiller(self.drafter, config)
        self.d2t = base.draft_to_target_ids()
        ids, feats, p = trace.ids, trace.feats, trace.prompt_len
        # The prefill's draft extend: rows 0 .. P-2 (row r embeds token r + 1 and reads feature r).
        self.pool = self.drafter.kv_for_context(ids[None, 1:p], feats[None, : p - 1], torch.arange(1, p)[None])
        self.base_pool = self.pool  # the base drafter's own cache (same weights so far)
        self.pending: list[tuple[int, int]] = []  # (anchor, accepted) of the rounds since the last update
        self.guard = [0, 0, 0]  # adapted, base served, base own: first-position matches at update rounds
        self.guard_rows = 0
        self.submitted = 0  # updates submitted (kept, skipped or empty)

    def canvas(self, anchor: int, valid_upto: int | None, past_len: int | None = None) -> Canvas:
        """The round anchored at committed token `anchor` (module docstring of core/canvas.py)."""
        tr, c = self.trace, self.chain + 1
        n = tr.ids.shape[0]
        at = torch.arange(anchor, anchor + c).clamp(max=n - 1)
        inside = torch.arange(anchor, anchor + c) < n
        valid = inside if valid_upto is None else inside & (torch.arange(c) <= valid_upto)
        past_len = anchor - 1 if past_len is None else past_len
        return Canvas(
            input_ids=tr.ids[at][None],
            positions=torch.arange(anchor, anchor + c)[None],
            target_logits=(tr.final[at] @ self.lm_head.T)[None],
            valid=valid[None],
            features=tr.feats[anchor - 1][None],
            past_kv=[(k[:, :, :past_len], v[:, :, :past_len]) for k, v in self.pool],
        )

    @torch.no_grad()
    def first_match(self, drafter, anchor: int, pool: KVCache) -> int:
        canvas = self.canvas(anchor, None)
        canvas.past_kv = [(k[:, :, : anchor - 1], v[:, :, : anchor - 1]) for k, v in pool]
        pred = self.d2t[drafter.canvas_logits(canvas.prefix(1))[0, 0].argmax()]
        return int(pred == self.trace.ids[anchor + 1])

    def stacked(self, rounds: list[tuple[int, int]]) -> Canvas:
        """The canvases of `rounds` as one batch; each row masks the cache to its own round's prefix."""
        rows = [self.canvas(a, m, past_len=kv_len(self.pool)) for a, m in rounds]
        length = kv_len(self.pool)
        past_mask = torch.zeros(len(rounds), length, dtype=torch.bool)
        for i, (a, _) in enumerate(rounds):
            past_mask[i, : a - 1] = True
        return Canvas(
            input_ids=torch.cat([r.input_ids for r in rows]),
            positions=torch.cat([r.positions for r in rows]),
            target_logits=torch.cat([r.target_logits for r in rows]),
            valid=torch.cat([r.valid for r in rows]),
            features=torch.cat([r.features for r in rows]),
            past_kv=list(self.pool),  # one copy read by every row, as core/canvas.py stack_rounds passes it
            past_mask=past_mask,
        )

    def run(self, end: int) -> tuple[list[tuple[int, int]], float]:
        tr = self.trace
        ids, feats = tr.ids, tr.feats
        n = min(ids.shape[0], tr.prompt_len + end)
        anchor, done = tr.prompt_len, []
        round_index = 0
        while anchor + 1 < n:
            if self.distiller is not None:
                self.distiller.barrier(force=True)
            with torch.no_grad():
                logits = self.drafter.canvas_logits(self.canvas(anchor, None))[0]
            pred = self.d2t[logits.argmax(-1)]
            m = 0
            while m < self.chain and anchor + 1 + m < n and int(pred[m]) == int(ids[anchor + 1 + m]):
                m += 1
            done.append((anchor - tr.prompt_len, m))
            update_now = self.distiller is not None and round_index % self.stride == self.stride - 1
            if update_now:  # the guard's three scores on the round(s) this update trains on
                self.guard[0] += int(int(pred[0]) == int(ids[anchor + 1]))
                base = self.distiller.base_drafter
                self.guard[1] += self.first_match(base, anchor, self.pool)
                self.guard[2] += self.first_match(base, anchor, self.base_pool)
                self.guard_rows += 1
            self.pending.append((anchor, m))
            new = min(anchor + m + 1, n - 1)
            # Draft extend after verify: rows anchor-1 .. new-2 with the weights serving this round.
            rows = (ids[None, anchor:new], feats[None, anchor - 1 : new - 1], torch.arange(anchor, new)[None])
            self.pool = append_kv(self.pool, self.drafter.kv_for_context(*rows, past_kv=self.pool))
            if self.distiller is not None:
                self.base_pool = append_kv(
                    self.base_pool, self.distiller.base_drafter.kv_for_context(*rows, past_kv=self.base_pool)
                )
            else:
                self.base_pool = self.pool
            if update_now:
                rounds = self.pending[-1:] if self.kind == "latest" else self.pending[-self.window :]
                self.distiller.observe(self.stacked(rounds), owned=True)
                self.submitted += 1
                self.pending = []
            elif self.kind == "latest":
                self.pending = []
            anchor, round_index = new, round_index + 1
        if self.distiller is None:
            return done, 0.0
        self.distiller.barrier(force=True)
        return done, self.distiller.stats.update_ms_total / 1e3


def summarize(done: list[tuple[int, int]], answer_tokens: int, bucket: int) -> tuple[float, list[float], list[float]]:
    """(tokens per round, per quarter of the answer, per bucket) from (answer position, accepted)."""

    def tpr(sel):
        return sum(m + 1 for _, m in sel) / max(len(sel), 1)

    quarters = [tpr([d for d in done if q * answer_tokens / 4 <= d[0] < (q + 1) * answer_tokens / 4]) for q in range(4)]
    curve = [tpr([d for d in done if b <= d[0] < b + bucket]) for b in range(0, answer_tokens, bucket)]
    return tpr(done), quarters, curve


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen2.5-Coder-0.5B-Instruct")
    ap.add_argument("--drafter", default=None, help="EAGLE-3 drafter folder (default: the shipped one)")
    ap.add_argument("--datasets", nargs="+", default=["reasoning", "long-gen"])
    ap.add_argument("--num-prompts", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--answer-tokens", type=int, default=1024)
    ap.add_argument("--chain", type=int, default=3)
    ap.add_argument("--schedules", nargs="+", default=DEFAULT_SCHEDULES)
    ap.add_argument("--lr", type=float, default=TTSConfig.lr)
    ap.add_argument(
        "--trainable", nargs="+", default=None, metavar="PREFIX", help="parameter-name prefixes to train (default all)"
    )
    ap.add_argument("--round-ms", type=float, default=60.0, help="a round's wall time for the modelled tokens/s")
    ap.add_argument("--bucket", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/results/replay-updates")
    ap.add_argument("--cache-dir", default=None, help="where answers are cached (default: the asset cache)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    for s in args.schedules:
        kind, *numbers = s.split(":")
        arity = {"latest": (1,), "window": (1, 2)}.get(kind, ())
        ok = len(numbers) in arity and all(n.isdigit() and int(n) >= 1 for n in numbers)
        if not (s == "frozen" or ok):
            ap.error(f"--schedules: {s!r} is not frozen, latest:S, window:S or window:S:W")

    from sglang_tts.training.target import cached_greedy_answers, load_target

    model_path = Path(resolve_model(args.model))
    model, _, target = load_target(model_path)
    drafter_path = args.drafter or shipped_drafter(args.model)
    base = load_drafter(drafter_path, target_embedding=target.embedding.float(), target_config=target.config)
    prompts = chat_prompts(sample_prompts(args.datasets, args.num_prompts, args.seed), model_path)
    cache = Path(args.cache_dir) if args.cache_dir else cache_root() / "replay-updates"
    cache.mkdir(parents=True, exist_ok=True)
    sets = "_".join(Path(d).stem for d in args.datasets)
    tag = f"{model_path.name}-{sets}-{args.num_prompts}-{args.seed}-{args.answer_tokens}"
    texts = cached_greedy_answers(model, prompts, args.answer_tokens, cache / f"answers-{tag}.pt")
    trainable = tuple(args.trainable) if args.trainable else None  # --tts-trainable
    config = TTSConfig(
        update_stride=1, sync=True, lr=args.lr, log_interval=0, record_accept_lengths=False, trainable=trainable
    )

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    previous = out / "replay_updates.json"
    rows: list[Row] = []
    if previous.exists():
        rows = [Row(**r) for r in json.loads(previous.read_text())["rows"]]
    have = {(r.prompt, r.schedule) for r in rows}
    bar = tqdm(total=len(prompts) * len(args.schedules), desc="replays", unit="replay")
    for p in prompts:
        todo = [s for s in args.schedules if (p.id, s) not in have]
        bar.update(len(args.schedules) - len(todo))
        if not todo:
            continue
        prompt_ids, answer_ids = texts[p.id]
        trace = target_trace(model, p.id, prompt_ids, answer_ids, base.cfg.aux_layer_ids)
        n_answer = len(answer_ids)
        frozen_tpr = next((r.tokens_per_round for r in rows if r.prompt == p.id and r.schedule == "frozen"), None)
        for schedule in sorted(todo, key=lambda s: s != "frozen"):
            bar.set_postfix_str(f"{p.id} {schedule}")
            replay = Replay(trace, base, target.lm_head.float(), schedule, config, args.chain)
            start = time.perf_counter()
            done, update_s = replay.run(n_answer)
            tpr, quarters, curve = summarize(done, n_answer, args.bucket)
            if schedule == "frozen":
                frozen_tpr = tpr
            updates = replay.submitted
            rounds = len(done)
            serve_s = rounds * args.round_ms / 1e3
            speed = (tpr / frozen_tpr) * serve_s / (serve_s + update_s) if frozen_tpr else float("nan")
            g = replay.guard_rows or 1
            rows.append(
                Row(p.id, schedule, n_answer, rounds, tpr, quarters, updates, update_s,
                    1e3 * update_s / max(updates, 1), speed, replay.guard[0] / g, replay.guard[1] / g,
                    replay.guard[2] / g, replay.distiller.stats.num_guard_resets if replay.distiller else 0, curve)
            )  # fmt: skip
            tqdm.write(
                f"{p.id} {schedule}: {tpr:.3f} tokens/round, {updates} updates, {update_s:.1f} s "
                f"({time.perf_counter() - start:.0f} s replay)"
            )
            bar.update(1)
            report(out, args, drafter_path, rows)
    bar.close()
    report(out, args, drafter_path, rows)
    return rows


def report(out: Path, args: argparse.Namespace, drafter_path, rows: list[Row]) -> None:
    schedules = list(dict.fromkeys(r.schedule for r in rows))
    prompts = list(dict.fromkeys(r.prompt for r in rows))
    frozen = {r.prompt: r for r in rows if r.schedule == "frozen"}

    def gain(r: Row, value: float, ref: float) -> str:
        return f"{100 * (value / ref - 1):+.1f}%" if ref else "n/a"

    # Means over the prompts every schedule has finished (a resumed run may be part way through one).
    complete = [p for p in prompts if {r.schedule for r in rows if r.prompt == p} >= set(schedules)]
    summary = []
    for s in schedules:
        rs = [r for r in rows if r.schedule == s and r.prompt in complete]
        if not rs:
            continue
        tpr = statistics.mean(r.tokens_per_round for r in rs)
        ftpr = statistics.mean(frozen[r.prompt].tokens_per_round for r in rs)
        q4 = statistics.mean(r.quarters[3] for r in rs)
        fq4 = statistics.mean(frozen[r.prompt].quarters[3] for r in rs)
        updates = sum(r.updates for r in rs)
        update_s = statistics.mean(r.update_s for r in rs)
        per_second = (tpr / ftpr - 1) * 100 / update_s if update_s > 0 else float("nan")
        guard = [statistics.mean(getattr(r, f"guard_{k}") for r in rs) for k in ("adapted", "base_served", "base_own")]
        summary.append(
            [s, f"{tpr:.3f}", gain(rs[0], tpr, ftpr), gain(rs[0], q4, fq4), f"{updates / len(rs):.0f}",
             f"{statistics.mean(r.ms_per_update for r in rs):.0f}",
             f"{statistics.mean(r.modelled_speed for r in rs):.3f}",
             "" if s == "frozen" else f"{per_second:.2f}",
             "" if s == "frozen" else " / ".join(f"{g:.2f}" for g in guard),
             str(sum(r.guard_resets for r in rs))]
        )  # fmt: skip
    per_prompt = [
        [r.prompt, r.schedule, str(r.answer_tokens), f"{r.tokens_per_round:.3f}",
         " / ".join(f"{q:.2f}" for q in r.quarters), str(r.updates), f"{r.modelled_speed:.3f}"]
        for r in rows
    ]  # fmt: skip
    command = "python scripts/replay_updates.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items()
        if v is not None
    )
    markdown = "\n".join(
        [
            "# Update schedules replayed offline along long answers",
            "",
            f"`{command}`",
            "",
            f"Drafter `{Path(drafter_path).name}`, chain of {args.chain}, greedy answers of up to {args.answer_tokens} "
            f"tokens, {len(complete)} prompt(s) with every schedule; the means below are over them "
            "(scripts/replay_updates.py docstring). "
            f"Modelled speed: tokens/s x frozen's with rounds of {args.round_ms:g} ms and each update's measured "
            "time added to the wall (inline updates, a small CPU). Guard columns: first-position match rate at "
            "the update rounds of the drafter that served / the base drafter reading the served K/V cache / the "
            "base drafter reading its own.",
            "",
            table(
                [
                    "schedule",
                    "tokens/round",
                    "vs frozen",
                    "last quarter vs frozen",
                    "updates",
                    "ms/update",
                    "modelled speed",
                    "gain (%) per second of updates",
                    "guard: adapted / base (served K/V) / base (own K/V)",
                    "guard resets",
                ],
                summary,
            ),  # fmt: skip
            "",
            table(
                ["prompt", "schedule", "answer tokens", "tokens/round", "quarters", "updates", "modelled speed"],
                per_prompt,
            ),
            "",
        ]
    )
    meta = {"command": command, "drafter": str(drafter_path), "machine": machine_info(), "args": vars(args)}

    def plot(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4.5))
        for s in schedules:
            rs = [r for r in rows if r.schedule == s]
            width = min(len(r.curve) for r in rs)
            mean = [statistics.mean(r.curve[i] for r in rs) for i in range(width)]
            ax.plot([(i + 0.5) * args.bucket for i in range(width)], mean, label=s, linewidth=2 if s == "frozen" else 1)
        ax.set_xlabel("answer position (tokens)")
        ax.set_ylabel("tokens per round")
        ax.set_title("Replayed update schedules (mean over prompts)")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    write_rows_report(out, "replay_updates", meta, rows, markdown, plot)


if __name__ == "__main__":
    main()
