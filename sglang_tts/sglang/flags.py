"""The `--tts-*` launch flags, added to SGLang's own argument parser.

SGLang's ServerArgs is a closed dataclass, so TTS flags cannot be fields of it. Instead an AFTER
hook on `ServerArgs.add_cli_args` adds an argument group whose argparse actions validate each
value at parse time (a bad value is an argparse error at launch, naming the flag) and record it
in the environment variable SGLANG_TTS_CONFIG (JSON). The environment is inherited by SGLang's
scheduler processes, which read it back with `tts_config_from_env()`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
from typing import Any

from sglang_tts.config import FULL_RANK, SCOPES, TTSConfig, TTSConfigError

ENV_VAR = "SGLANG_TTS_CONFIG"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _adapter_rank(text: str) -> int | str:
    return FULL_RANK if text.strip().lower() == FULL_RANK else _positive_int(text)


def _float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _str_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _prefixes_or_all(text: str) -> tuple[str, ...]:
    """Comma-separated name prefixes; 'all' is the empty prefix (every name)."""
    return ("",) if text.strip().lower() == "all" else _str_list(text)


def _policy_path(text: str) -> str | None:
    return None if text.strip().lower() == "none" else text


def _budget(text: str) -> float | None:
    if text.strip().lower() == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a share of time in (0, 1), got {text!r}") from None


def _on_off(text: str) -> bool:
    value = text.strip().lower()
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected 'on' or 'off', got {text!r}")
    return value == "on"


# flag -> (TTSConfig field, argparse kwargs)
FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "--tts-update-stride": (
        "update_stride",
        {"type": _positive_int, "help": "Update the drafter every S rounds (pins S; default: the budget moves it)."},
    ),
    "--tts-update-budget": (
        "update_budget",
        {
            "type": _budget,
            "help": "Share of serving time updates may take, e.g. 0.1; 'auto' (default): the measured acceptance gain.",
        },
    ),
    "--tts-update-budget-scale": (
        "update_budget_scale",
        {
            "type": float,
            "help": "Multiplies the auto budget, warm-up included (0 < K <= 1; 1: updates may spend the whole "
            "measured gain; 0.5, the default: half of it, the rest is speed).",
        },
    ),
    "--tts-update-window": (
        "update_window",
        {
            "type": _positive_int,
            "help": "An update trains on the last N rounds of its stride, in one step (1: the latest round, the "
            "paper; default: every round of the stride, up to 32 rows, with an EAGLE-3 drafter; 1 with DFlash).",
        },
    ),
    "--tts-min-stride": ("min_stride", {"type": _positive_int, "help": "Shortest stride the update budget may pick."}),
    "--tts-max-stride": ("max_stride", {"type": _positive_int, "help": "Longest stride the update budget may pick."}),
    "--tts-guard": (
        "guard",
        {"type": _on_off, "metavar": "on|off", "help": "Do-no-harm guard: reset a drafter worse than base."},
    ),
    "--tts-guard-window": ("guard_window", {"type": _positive_int, "help": "Updates the guard compares over."}),
    "--tts-guard-interval": ("guard_interval", {"type": _positive_int, "help": "Score every Nth update only."}),
    "--tts-guard-margin": ("guard_margin", {"type": float, "help": "Relative shortfall that resets (e.g. 0.02)."}),
    "--tts-guard-backoff": (
        "guard_backoff",
        {"type": float, "help": "After a guard reset the unit's learning rate is multiplied by this (1: unchanged)."},
    ),
    "--tts-lr": ("lr", {"type": float, "help": "Learning rate of the online update."}),
    "--tts-reg-lambda": ("reg_lambda", {"type": float, "help": "Weight of KL(q_t || q) (matters when K > 1)."}),
    "--tts-steps-per-update": ("steps_per_update", {"type": _positive_int, "help": "Optimizer steps per update."}),
    "--tts-scope": (
        "scope",
        {
            "choices": list(SCOPES),
            "help": "Shared drafter reset per batch, per-request adapters, adapters shared by requests of one "
            "prompt (group), or never reset (global).",
        },
    ),
    "--tts-adapter-rank": (
        "adapter_rank",
        {"type": _adapter_rank, "help": "Rank of per-request adapters, or 'full' (a dense per-request delta)."},
    ),
    "--tts-adapter-alpha": (
        "adapter_alpha",
        {"type": float, "help": "Per-request adapter scale alpha (delta = alpha/r BA)."},
    ),
    "--tts-adapter-lr": ("adapter_lr", {"type": float, "help": "Learning rate of per-request adapters."}),
    "--tts-adapter-kv": (
        "adapter_kv",
        {
            "type": _on_off,
            "metavar": "on|off",
            "help": "EAGLE-3 adapters also adapt fc, k_proj, v_proj (the context K/V writers; off: exact guard).",
        },
    ),
    "--tts-max-adapted-requests": (
        "max_adapted_requests",
        {"type": _positive_int, "help": "Requests that may hold an adapter at once (others: frozen drafter)."},
    ),
    "--tts-sync": ("sync", {"nargs": 0, "help": "Run updates on the serving thread/stream (comparison)."}),
    "--tts-freeze": ("freeze", {"nargs": 0, "help": "Same code path, never update: the frozen baseline."}),
    "--tts-cpu-thread": (
        "cpu_thread",
        {"nargs": 0, "help": "On CPU, update on a worker thread beside serving (default: inline between rounds)."},
    ),
    "--tts-optimizer": ("optimizer", {"choices": ["adam", "adamw", "sgd"], "help": "torch.optim optimizer."}),
    "--tts-max-grad-norm": ("max_grad_norm", {"type": float, "help": "Gradient clipping norm."}),
    "--tts-position-weights": ("position_weights", {"type": _float_list, "help": "w_1,...,w_C (default: recipe)."}),
    "--tts-trainable": ("trainable", {"type": _str_list, "help": "Comma-separated parameter name prefixes."}),
    "--tts-loss-backend": ("loss_backend", {"choices": ["auto", "naive", "chunked", "triton"], "help": "Loss kernel."}),
    "--tts-canvas": ("canvas", {"choices": ["accepted", "full"], "help": "Canvas positions the loss uses."}),
    "--tts-canvas-vocab": (
        "canvas_vocab",
        {"choices": ["draft", "full"], "help": "Target logits a canvas keeps: the drafter's ids, or all."},
    ),
    "--tts-prompt-adapt": (
        "prompt_adapt",
        {
            "nargs": "?",
            "const": "on",
            "choices": ["off", "on", "only"],
            "help": "Learn each request's prompt before drafting its answer ('on' when given alone; "
            "'only': no verify-round updates).",
        },
    ),
    "--tts-prompt-positions": (
        "prompt_positions",
        {"type": _positive_int, "help": "Prompt positions (the last N) a prompt update trains on."},
    ),
    "--tts-prompt-min-positions": (
        "prompt_min_positions",
        {"type": _positive_int, "help": "Prompts with fewer computed positions are not learned."},
    ),
    "--tts-prompt-steps": ("prompt_steps", {"type": _positive_int, "help": "Optimizer steps per prompt update."}),
    "--tts-prompt-lr": ("prompt_lr", {"type": float, "help": "Learning rate of the prompt update's steps."}),
    "--tts-prompt-depth": (
        "prompt_depth",
        {"type": _positive_int, "help": "Tokens ahead each prompt position predicts (EAGLE-3 unroll, DFlash slots)."},
    ),
    "--tts-prompt-trainable": (
        "prompt_trainable",
        {
            "type": _prefixes_or_all,
            "help": "Parameter name prefixes prompt steps train ('all': every one; default fc).",
        },
    ),
    "--tts-log-interval": ("log_interval", {"type": int, "help": "Log a TTS summary every N rounds (0: off)."}),
    "--tts-allow-weight-digest": (
        "allow_weight_digest",
        {"nargs": 0, "help": "Honour requests' tts_return_weight_digest (hashes the drafter per update; debug)."},
    ),
    "--tts-on-target-update": (
        "on_target_update",
        {
            "choices": ["keep", "reset"],
            "help": "When a weight update changes the target: reset the adapted drafter to base, or keep adapting.",
        },
    ),
    "--tts-controller": (
        "controller",
        {"type": _policy_path, "help": "Policy file of the RL draft/stride controller ('none': fixed flags)."},
    ),
    "--tts-hybrid": (
        "hybrid",
        {"type": _on_off, "metavar": "on|off", "help": "Hybrid drafting: a suffix chain when it beats the drafter."},
    ),
    "--tts-hybrid-min-match": (
        "hybrid_min_match",
        {"type": int, "help": "Shortest suffix chain the hybrid takes (0: the whole chain)."},
    ),
    "--tts-hybrid-margin": (
        "hybrid_margin",
        {"type": float, "help": "Suffix taken while its expected tokens >= the drafter's minus this."},
    ),
    "--tts-hybrid-score": (
        "hybrid_score",
        {
            "choices": ["average", "chain"],
            "help": "The suffix side of the rule: a moving average, or the chain at hand's score in its context.",
        },
    ),
    "--tts-hybrid-cost": (
        "hybrid_cost",
        {
            "type": _on_off,
            "metavar": "on|off",
            "help": "Weigh measured round costs: an all-suffix round skips the drafter's steps.",
        },
    ),
    "--tts-hybrid-train": (
        "hybrid_train",
        {"choices": ["all", "drafter"], "help": "Train on every round, or only on the drafter's rounds."},
    ),
    "--tts-hybrid-idle-updates": (
        "hybrid_idle_updates",
        {"choices": ["skip", "run"], "help": "Skip the update of a stride the drafter drafted no round of."},
    ),
    "--tts-hybrid-retire-below": (
        "hybrid_retire_below",
        {"type": float, "help": "Retire a request's drafter below this many accepted tokens per round (0: never)."},
    ),
    "--tts-hybrid-retire-after": (
        "hybrid_retire_after",
        {"type": int, "help": "... judged once the drafter has drafted this many of the request's rounds."},
    ),
    "--tts-controller-learn": ("controller_learn", {"nargs": 0, "help": "Keep training the controller online."}),
    "--tts-controller-trace": ("controller_trace", {"type": str, "help": "Write controller records (JSONL)."}),
}


def _read_env() -> dict[str, Any]:
    raw = os.environ.get(ENV_VAR)
    return json.loads(raw) if raw else {}


def _write_env(values: dict[str, Any]) -> None:
    os.environ[ENV_VAR] = json.dumps(values)


class _RecordTTSFlag(argparse.Action):
    """Stores the flag in the namespace and in SGLANG_TTS_CONFIG, validating the whole config."""

    def __call__(self, parser, namespace, values, option_string=None):
        field = FLAGS[option_string or self.option_strings[0]][0]
        value = True if self.nargs == 0 else values
        setattr(namespace, self.dest, value)
        recorded = _read_env()
        recorded[field] = list(value) if isinstance(value, tuple) else value
        try:
            config_from_values(recorded)
        except TTSConfigError as e:
            parser.error(str(e))
        _write_env(recorded)


def add_tts_cli_args(parser: argparse.ArgumentParser) -> None:
    if any(opt in parser._option_string_actions for opt in FLAGS):
        return
    if multiprocessing.parent_process() is None:
        # A new parse in the launching process starts from defaults, not from an earlier parse.
        reset_env()
    group = parser.add_argument_group("Test-Time Speculation (sglang-tts; with --speculative-algorithm TTS)")
    for flag, (field, kwargs) in FLAGS.items():
        kwargs = dict(kwargs)
        metavar = kwargs.pop("metavar", None if kwargs.get("nargs") == 0 or "choices" in kwargs else field.upper())
        group.add_argument(flag, dest=f"tts_{field}", metavar=metavar, action=_RecordTTSFlag, default=None, **kwargs)


def add_cli_args_hook(result, parser, *args, **kwargs):
    """AFTER hook on ServerArgs.add_cli_args."""
    add_tts_cli_args(parser)
    return result


def config_from_values(values: dict[str, Any]) -> TTSConfig:
    known = {f.name for f in dataclasses.fields(TTSConfig)}
    unknown = set(values) - known
    if unknown:
        raise TTSConfigError(f"unknown TTS settings: {sorted(unknown)}")
    converted = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    if "update_stride" in converted:  # given at launch: the budget does not move it
        converted["stride_pinned"] = True
    return TTSConfig(**converted).validate()


def tts_config_from_env() -> TTSConfig:
    """The TTS config this server was launched with (defaults where no flag was given)."""
    return config_from_values(_read_env())


def reset_env() -> None:
    os.environ.pop(ENV_VAR, None)
