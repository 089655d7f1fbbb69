"""The demo: one long greedy answer served without speculation, and by the same drafter frozen, with
TTS, and with TTS and hybrid drafting, side by side.

Four SGLang servers, one after the other, each answering the same chat request through the OpenAI
client: the target alone (no speculation), then ``--speculative-algorithm TTS`` with ``--tts-freeze``
(the same code path, no updates), as it is, and with ``--tts-hybrid on`` (a suffix chain where it
beats the drafter's, docs/hybrid.md). What comes back is compared: acceptance (tokens per verify
round, bonus included) by quarter of the output, TTS's updates, which proposer the hybrid verified,
tokens per second, whether the answers are identical (they must be: speculation changes what is
proposed, never what is emitted), and the answer's repetition score (a looping answer is easy to draft, so its late
acceptance measures the loop, not the drafter). `run_demo` returns the result; `render` prints it;
`write_outputs` writes ``demo.json`` and ``demo.png``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sglang_tts.bench.metrics import round_starts
from sglang_tts.bench.repetition import REPETITIVE_BELOW, distinct_by_quarter
from sglang_tts.bench.report import fmt, machine_info, pyplot, write_json
from sglang_tts.bench.server import ServerProcess, start_server, stop_server
from sglang_tts.data.prompts import format_chat

# MATH-500 #160 with the step-by-step instruction the drafter was trained with (data/prompts.py), held
# out of the shipped drafter's training: the default model answers it in 512 tokens without looping.
QUESTION = format_chat(
    "The product of two consecutive positive even integers is 288. What is the greater of the two integers?"
)[0]["content"]
VARIANTS = ("no-spec", "frozen", "TTS", "hybrid")
SPECULATIVE = ("frozen", "TTS", "hybrid")
LABELS = {"no-spec": "no speculation", "frozen": "frozen", "TTS": "TTS", "hybrid": "TTS+hybrid"}


@dataclass
class Answer:
    """One variant's answer to the demo request, as the server reported it."""

    variant: str  # "no-spec" | "frozen" | "TTS" | "hybrid"
    text: str
    completion_tokens: int
    seconds: float  # client-side wall time of the request
    accept_lengths: list[int]  # tokens committed by each verify round, bonus included
    updates: int = 0
    skipped_updates: int = 0
    trained_rounds: int = 0  # verify rounds the updates trained on (> updates with --tts-update-window)
    update_ms: float = 0.0
    failures: int = 0
    finish_reason: str | None = None
    update_stride: int = 0  # the stride in force at the answer's last round (the update budget's pick)
    update_share: float = 0.0  # the share of serving time updates took (server-wide, as measured)
    guard_resets: int = 0
    # --tts-hybrid: rounds each proposer drafted, and its accepted drafted tokens (bonus excluded)
    suffix_rounds: int = 0
    suffix_accepted: int = 0
    drafter_rounds: int = 0
    drafter_accepted: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def accept_mean(self) -> float | None:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else None

    def accept_by_quarter(self) -> list[float | None]:
        """Mean tokens per round of the rounds starting in each quarter of the output."""
        quarters: list[list[int]] = [[], [], [], []]
        total = max(1, self.completion_tokens)
        for n, start in zip(self.accept_lengths, round_starts(self.accept_lengths)):
            quarters[min(3, 4 * start // total)].append(n)
        return [sum(q) / len(q) if q else None for q in quarters]


@dataclass
class DemoResult:
    model: str
    drafter: str
    drafter_trained: bool
    question: str
    max_tokens: int
    launch_args: list[str]
    answers: dict[str, Answer]
    server_start_s: dict[str, float]  # variant -> seconds from launch to healthy
    repetition: list[float | None] = field(default_factory=list)  # distinct word 4-grams per quarter (TTS answer)

    @property
    def identical(self) -> bool:
        """Every server gave the same answer (speculation changes what is proposed, never what is emitted)."""
        answers = list(self.answers.values())
        return all(a.text == answers[0].text and a.completion_tokens == answers[0].completion_tokens for a in answers)

    @property
    def loops(self) -> bool:
        return any(share is not None and share < REPETITIVE_BELOW for share in self.repetition)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for name, answer in self.answers.items():
            out["answers"][name].update(
                tokens_per_s=answer.tokens_per_s,
                accept_mean=answer.accept_mean,
                accept_by_quarter=answer.accept_by_quarter(),
            )
        out.update(identical=self.identical, loops=self.loops, machine=machine_info())
        return out


def _ask(server: ServerProcess, model: str, variant: str, question: str, max_tokens: int) -> Answer:
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=1800)
    began = time.perf_counter()
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_meta_info": True, "custom_params": {"tts_return_accept_lengths": True}},
    )
    seconds = time.perf_counter() - began
    choice = reply.choices[0]
    meta = (choice.model_extra or {}).get("meta_info") or {}
    return Answer(
        variant=variant,
        text=choice.message.content or "",
        completion_tokens=reply.usage.completion_tokens,
        seconds=seconds,
        accept_lengths=[int(n) for n in meta.get("tts_accept_lengths") or []],
        updates=int(meta.get("tts_num_updates") or 0),
        skipped_updates=int(meta.get("tts_num_skipped_updates") or 0),
        update_ms=float(meta.get("tts_update_ms") or 0.0),
        failures=int(meta.get("tts_failures") or 0),
        finish_reason=choice.finish_reason,
        update_stride=int(meta.get("tts_update_stride") or 0),
        update_share=float(meta.get("tts_update_share") or 0.0),
        guard_resets=int(meta.get("tts_guard_resets") or 0),
        trained_rounds=int(meta.get("tts_trained_rounds") or 0),
        suffix_rounds=int(meta.get("tts_suffix_rounds") or 0),
        suffix_accepted=int(meta.get("tts_suffix_accepted") or 0),
        drafter_rounds=int(meta.get("tts_drafter_rounds") or 0),
        drafter_accepted=int(meta.get("tts_drafter_accepted") or 0),
    )


def run_demo(
    model: Path,
    drafter: Path,
    *,
    drafter_trained: bool,
    question: str = QUESTION,
    max_tokens: int = 512,
    launch_args: Sequence[str] = (),
    timeout_s: float = 600.0,
    say=print,
) -> DemoResult:
    """Start a server per variant on `model` (the speculative ones with `drafter` and `launch_args`), ask
    each `question`, compare."""
    common = ["--speculative-algorithm", "TTS", "--speculative-draft-model-path", str(drafter), *launch_args]
    variant_args = {
        "no-spec": [],
        "frozen": [*common, "--tts-freeze"],
        "TTS": common,
        "hybrid": [*common, "--tts-hybrid", "on"],
    }
    answers: dict[str, Answer] = {}
    server_start_s: dict[str, float] = {}
    for variant in VARIANTS:
        # One server at a time: SGLang sizes its KV pool from the memory free after its weights load,
        # which a second server loading at the same moment would eat into.
        say(f"[demo] {variant}: starting an SGLang server on {model.name} (about half a minute on CPU)")
        began = time.perf_counter()
        server = start_server(str(model), variant_args[variant], timeout_s=timeout_s)
        try:
            server_start_s[variant] = time.perf_counter() - began
            # A few tokens first, so the timed answer does not pay the server's one-time costs.
            _ask(server, str(model), variant, "Hello!", 4)
            say(f"[demo] {variant}: answering ({max_tokens} tokens at most)")
            answers[variant] = _ask(server, str(model), variant, question, max_tokens)
        finally:
            stop_server(server)
    return DemoResult(
        model=model.name,
        drafter=str(drafter),
        drafter_trained=drafter_trained,
        question=question,
        max_tokens=max_tokens,
        launch_args=common,
        answers=answers,
        server_start_s=server_start_s,
        repetition=distinct_by_quarter(answers["TTS"].text),
    )


def render(result: DemoResult) -> str:
    """The demo's table and verdict lines, as printed."""
    frozen, tts = result.answers["frozen"], result.answers["TTS"]
    hybrid = result.answers.get("hybrid")
    lines = [
        f"TTS demo: {result.model}, {'trained' if result.drafter_trained else 'UNTRAINED'} EAGLE-3 drafter, "
        f"one greedy answer ({tts.completion_tokens} tokens)",
        "",
        "tokens per verify round (bonus included), by quarter of the output:",
        f"{'':11}{'Q1':>7}{'Q2':>7}{'Q3':>7}{'Q4':>7}{'all':>8}",
    ]
    for answer in (a for a in (frozen, tts, hybrid) if a is not None):
        cells = "".join(f"{fmt(v):>7}" for v in answer.accept_by_quarter())
        label = LABELS[answer.variant]
        lines.append(f"{label:11}{cells}{fmt(answer.accept_mean):>8}")
        if answer is not frozen and answer.accept_mean is not None and frozen.accept_mean:
            lines[-1] += f" ({100 * (answer.accept_mean / frozen.accept_mean - 1):+.0f}%)"
    per_update = tts.update_ms / tts.updates if tts.updates else 0.0
    rounds_per_update = tts.trained_rounds / tts.updates if tts.updates else 0.0
    args = result.launch_args
    if "--tts-sync" in args:
        where = "on the serving thread: --tts-sync"
    elif "--tts-cpu-thread" in args:
        where = "on a worker thread beside serving: --tts-cpu-thread"
    else:
        where = "inline between rounds, the CPU default"
    pinned = "--tts-update-stride" in " ".join(args)
    stride = "pinned" if pinned else "picked by the update budget"
    lines += [
        "",
        f"TTS updates: {tts.updates} made, {tts.skipped_updates} skipped, {per_update:.1f} ms each "
        f"({where}), each on {rounds_per_update:.1f} rounds (--tts-update-window); the frozen server made "
        f"{frozen.updates}",
        f"stride at the end: {tts.update_stride} ({stride}); updates took {100 * tts.update_share:.1f}% of "
        f"serving time; do-no-harm resets: {tts.guard_resets}",
        *_hybrid_lines(hybrid),
        _speed_line(result),
        f"outputs identical: {'yes' if result.identical else 'NO'} "
        f"({' and '.join(str(a.completion_tokens) for a in result.answers.values())} tokens)",
        "repetition (distinct word 4-grams per quarter of the answer): "
        + " ".join(fmt(v) for v in result.repetition)
        + (
            f"  WARNING: the answer loops (a quarter below {REPETITIVE_BELOW}); acceptance there measures the loop"
            if result.loops
            else "  (no loop)"
        ),
    ]
    if tts.failures or frozen.failures:
        lines.append(f"TTS failures (skipped, output unaffected): frozen {frozen.failures}, TTS {tts.failures}")
    if not result.drafter_trained:
        lines.append("NOTE: an untrained drafter proposes almost nothing acceptable; this run shows the path only.")
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "nan"


def _speed_line(result: DemoResult) -> str:
    """tokens/s of each server, the speculative ones as a ratio to frozen (and to no speculation)."""
    answers = result.answers
    frozen, plain = answers["frozen"], answers.get("no-spec")
    parts = []
    for variant, answer in answers.items():
        text = f"{LABELS[variant]} {answer.tokens_per_s:.1f}"
        ratios = []
        if variant in ("TTS", "hybrid"):
            ratios.append(f"{_ratio(answer.tokens_per_s, frozen.tokens_per_s)} frozen")
        if plain is not None and variant != "no-spec":
            ratios.append(f"{_ratio(answer.tokens_per_s, plain.tokens_per_s)} no speculation")
        parts.append(text + (f" ({', '.join(ratios)})" if ratios else ""))
    return "tokens/s: " + "; ".join(parts)


def _hybrid_lines(hybrid: Answer | None) -> list[str]:
    if hybrid is None:
        return []
    rounds = hybrid.suffix_rounds + hybrid.drafter_rounds

    def per_round(accepted: int, n: int) -> str:
        return f"{accepted / n:.2f}" if n else "-"

    return [
        f"TTS+hybrid: suffix chains verified in {hybrid.suffix_rounds} of {rounds} rounds "
        f"({per_round(hybrid.suffix_accepted, hybrid.suffix_rounds)} drafted tokens accepted per round), "
        f"the drafter's in {hybrid.drafter_rounds} ({per_round(hybrid.drafter_accepted, hybrid.drafter_rounds)}); "
        f"{hybrid.updates} updates"
    ]


def plot(result: DemoResult, path: Path, bucket: int = 32) -> Path:
    """Tokens per round along the output, in `bucket`-token windows, frozen vs TTS."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {"frozen": "black", "TTS": "tab:blue", "hybrid": "tab:green"}
    for answer in result.answers.values():
        if not answer.accept_lengths:
            continue  # no speculation: no rounds
        sums: dict[int, list[int]] = {}
        for n, start in zip(answer.accept_lengths, round_starts(answer.accept_lengths)):
            sums.setdefault(start // bucket, []).append(n)
        xs = sorted(sums)
        style = {"color": colors.get(answer.variant, "tab:red")}
        if answer.variant == "frozen":
            style["linestyle"] = "--"
        ax.plot(
            [(x + 0.5) * bucket for x in xs],
            [sum(sums[x]) / len(sums[x]) for x in xs],
            marker="o",
            markersize=3,
            label=f"{LABELS.get(answer.variant, answer.variant)} (mean {fmt(answer.accept_mean)})",
            **style,
        )
    ax.set_title(f"{result.model}: acceptance along one answer")
    ax.set_xlabel(f"output position (tokens, {bucket}-token windows)")
    ax.set_ylabel("tokens per verify round")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(result: DemoResult, command: str) -> str:
    return "\n".join(
        [
            "# TTS demo: no speculation, frozen, TTS and TTS+hybrid on one answer",
            "",
            f"`{command}`" if command else "",
            "",
            "```",
            render(result),
            "```",
            "",
            "![acceptance along the answer](demo.png)",
            "",
            "Question:",
            "",
            *[f"> {line}" for line in result.question.splitlines()],
            "",
            "Answer (identical for every server):" if result.identical else "TTS answer (another one differs):",
            "",
            "```",
            result.answers["TTS"].text,
            "```",
            "",
        ]
    )


def write_outputs(result: DemoResult, out_dir: Path, command: str = "") -> list[Path]:
    """demo.json (everything), demo.md (the table, the plot, question and answer), demo.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {**result.to_json(), "table": render(result), "command": command}
    report = out_dir / "demo.md"
    report.write_text(markdown(result, command))
    return [write_json(out_dir / "demo.json", payload), report, plot(result, out_dir / "demo.png")]
