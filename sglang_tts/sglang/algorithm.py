"""`--speculative-algorithm TTS`: registration with SGLang's speculative-algorithm registry.

TTS is not a new drafting scheme: it runs EAGLE-3 (tree drafting) or DFlash (block drafting)
exactly as SGLang does and adapts the drafter between rounds. So the registered algorithm
behaves, towards every `is_*()` / `supports_*()` branch in SGLang, like the builtin its drafter
needs (EAGLE3 or DFLASH), and only its worker class differs. The drafter kind is read from the
draft checkpoint's config.json at launch, validated against the target, and passed to SGLang's
scheduler processes through the environment (they are started after validation).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from sglang_tts.config import ADAPTER_SCOPES, FULL_RANK
from sglang_tts.drafters.common import UnsupportedDrafterConfigError, text_config
from sglang_tts.drafters.dflash import DFlashConfig
from sglang_tts.drafters.loading import IncompatibleDrafterError, check_checkpoint, check_compatible, drafter_kind

logger = logging.getLogger(__name__)

ALGORITHM_NAME = "TTS"
KIND_ENV = "SGLANG_TTS_DRAFTER_KIND"
_BUILTIN_FOR_KIND = {"eagle3": "EAGLE3", "dflash": "DFLASH"}
# SpeculativeAlgorithm methods that are worth running with TTS as `self` (their own is_* calls then
# dispatch to our delegating predicates) rather than on the builtin member.
_SHARED_METHODS = (
    "carries_draft_hidden_states",
    "create_future_map",
    "build_disagg_draft_input",
    "need_topk",
    "has_draft_kv",
    "resolve_max_speculative_num_draft_tokens",
    "get_num_tokens_per_req_for_target_verify",
)


class TTSLaunchError(ValueError):
    """A TTS launch problem (missing or incompatible drafter, bad flag); raised before serving."""


def current_kind() -> str:
    return os.environ.get(KIND_ENV, "eagle3")


def builtin_algorithm():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return SpeculativeAlgorithm[_BUILTIN_FOR_KIND[current_kind()]]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise TTSLaunchError(f"{path} not found") from None
    except json.JSONDecodeError as e:
        raise TTSLaunchError(f"{path} is not valid JSON: {e}") from None


def resolve_drafter(draft_path: str | None, target_path: str | None) -> str:
    """Validate the drafter for TTS and return its kind ("eagle3" | "dflash")."""
    if not draft_path:
        raise TTSLaunchError(
            "--speculative-algorithm TTS needs --speculative-draft-model-path (an EAGLE-3 or DFlash drafter)"
        )
    draft_dir = Path(draft_path)
    if not (draft_dir / "config.json").exists():
        raise TTSLaunchError(
            f"TTS drafter {draft_path!r}: no config.json (only local checkpoint folders are supported)"
        )
    try:
        kind = drafter_kind(draft_dir)
    except (IncompatibleDrafterError, ValueError) as e:
        raise TTSLaunchError(f"TTS drafter {draft_path!r}: {e}") from None
    target_config = None
    if target_path and (Path(target_path) / "config.json").exists():
        target_config = _read_json(Path(target_path) / "config.json")
        try:
            check_compatible(_read_json(draft_dir / "config.json"), target_config)
        except IncompatibleDrafterError as e:
            raise TTSLaunchError(f"TTS drafter {draft_path!r} does not fit target {target_path!r}: {e}") from None
    try:  # a truncated or corrupt checkpoint fails here, naming the file and tensor, not in the worker
        check_checkpoint(draft_dir, target_config)
    except (UnsupportedDrafterConfigError, ValueError) as e:
        raise TTSLaunchError(f"TTS drafter {draft_path!r}: {e}") from None
    if kind == "dflash":
        depth = text_config(target_config).get("num_hidden_layers") if target_config else None
        try:  # options the differentiable DFlash drafter does not implement (DFlash 2, Domino, ...)
            DFlashConfig.from_dict(_read_json(draft_dir / "config.json"), target_num_layers=depth)
        except (UnsupportedDrafterConfigError, ValueError) as e:
            raise TTSLaunchError(f"TTS drafter {draft_path!r}: {e}") from None
    return kind


# Parallelism TTS does not implement: flag -> why. Each scheduler process trains one unsharded
# drafter copy (with the target's whole embedding and LM head) and publishes it into SGLang's draft
# model as one unsharded copy; core/publish.py's ShardSpec is not wired into the worker binding.
_SINGLE_RANK = {
    "tp_size": (
        "--tp-size",
        "the drafter update is published to one unsharded copy; tensor-parallel publishing is not implemented",
    ),
    "pp_size": (
        "--pp-size",
        "the drafter update needs the target's embedding and LM head in one process; pipeline stages split them",
    ),
}


def check_parallelism(server_args) -> None:
    """Refuse tensor / pipeline parallelism (data-parallel replicas are independent single-rank servers)."""
    for name, (flag, why) in _SINGLE_RANK.items():
        size = int(getattr(server_args, name, 1) or 1)
        if size > 1:
            raise TTSLaunchError(f"--speculative-algorithm TTS supports {flag} 1 only, got {size} ({why})")


def check_hybrid(server_args, config, kind: str) -> None:
    """--tts-hybrid on: EAGLE-3 chains, verified by SGLang's target-only rule (a controller may move
    the chain length and choose the proposer: adaptive_steps.py)."""
    problems = []
    if kind != "eagle3":
        problems.append(f"an EAGLE-3 drafter (got a {kind} drafter)")
    topk = getattr(server_args, "speculative_eagle_topk", None)
    if topk not in (None, 1):
        problems.append(f"--speculative-eagle-topk 1 (a chain), got {topk}")
    if getattr(server_args, "speculative_use_rejection_sampling", False):
        problems.append("no --speculative-use-rejection-sampling (a suffix chain has no draft distribution)")
    if problems:
        raise TTSLaunchError("--tts-hybrid on needs " + "; ".join(problems))


def validate_server_args(server_args) -> None:
    """Run by SGLang at argument resolution, in the launching process, before any worker starts."""
    from sglang_tts.sglang import compat
    from sglang_tts.sglang.flags import tts_config_from_env

    compat.require(compat.LAUNCH_SCOPES)  # the worker classes TTS subclasses (SGLangMismatchError)
    config = tts_config_from_env()  # re-validates what the flags recorded
    check_parallelism(server_args)
    kind = resolve_drafter(
        getattr(server_args, "speculative_draft_model_path", None), getattr(server_args, "model_path", None)
    )
    if kind == "dflash" and getattr(server_args, "speculative_draft_window_size", None) is not None:
        raise TTSLaunchError("TTS with a DFlash drafter does not support --speculative-draft-window-size")
    if (
        config.scope in ADAPTER_SCOPES
        and config.adapter_rank == FULL_RANK
        and getattr(server_args, "device", "cpu") == "cuda"
        and not getattr(server_args, "disable_cuda_graph", False)
    ):
        # Dense per-request deltas pick one matmul per request present (a host-side loop over a
        # data-dependent set), which a captured CUDA graph cannot replay.
        raise TTSLaunchError("--tts-adapter-rank full needs --disable-cuda-graph on CUDA (or use a rank r)")
    if config.window > 1 and kind != "eagle3":
        # A DFlash canvas carries the context features of its round (not a prefix of the latest's).
        raise TTSLaunchError(f"--tts-update-window {config.update_window} needs an EAGLE-3 drafter (got {kind})")
    if config.hybrid:
        check_hybrid(server_args, config, kind)
    if config.controller is not None:
        from sglang_tts.sglang.adaptive_steps import prepare_launch

        prepare_launch(server_args, config, kind, TTSLaunchError)
    os.environ[KIND_ENV] = kind
    logger.info("sglang-tts: TTS with a %s drafter", kind)


def make_spec_class():
    """A CustomSpecAlgo subclass that answers every SGLang predicate like the builtin of the drafter's kind."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    namespace: dict[str, Any] = {"__doc__": "TTS: the builtin drafting algorithm plus online drafter adaptation."}

    def delegate_to_builtin(name: str):
        def method(self, *args, **kwargs):
            return getattr(builtin_algorithm(), name)(*args, **kwargs)

        method.__name__ = name
        return method

    for name in vars(SpeculativeAlgorithm):
        if name.startswith(("is_", "supports_")) and name not in ("is_some", "is_none", "is_speculative"):
            namespace[name] = delegate_to_builtin(name)
    for name in _SHARED_METHODS:
        if name in vars(SpeculativeAlgorithm):
            namespace[name] = vars(SpeculativeAlgorithm)[name]

    def handle_server_args(self, server_args) -> None:
        # The builtin's defaults and checks (steps/topk/draft tokens, CPU overlap rules, ...).
        builtin_algorithm().handle_server_args(server_args)
        from sglang_tts.sglang.flags import tts_config_from_env

        if tts_config_from_env().hybrid and not getattr(server_args, "disable_overlap_schedule", True):
            # The suffix lookup reads each round's committed tokens on the host (as SGLang's NGRAM does).
            server_args.disable_overlap_schedule = True
            logger.warning("sglang-tts: --tts-hybrid on turns the overlap scheduler off")

    namespace["handle_server_args"] = handle_server_args
    return type("TTSSpecAlgo", (CustomSpecAlgo,), namespace)


def worker_factory(server_args):
    if current_kind() == "dflash":
        from sglang_tts.sglang.dflash_worker import TTSDFlashWorker

        return TTSDFlashWorker
    from sglang_tts.sglang.eagle_worker import TTSEagleWorker

    return TTSEagleWorker


_registered = False


def register_tts_algorithm() -> None:
    """Register TTS (idempotent) and the --tts-* flags; called by the plugin in every process."""
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from sglang_tts.sglang import adaptive_steps, flags, metrics, requests, weight_sync

    if get_spec(ALGORITHM_NAME) is None:
        SpeculativeAlgorithm.register(
            ALGORITHM_NAME,
            supports_overlap=True,
            spec_class=make_spec_class(),
            validate_server_args=validate_server_args,
        )(worker_factory)
    HookRegistry.register("sglang.srt.server_args.ServerArgs.add_cli_args", flags.add_cli_args_hook, HookType.AFTER)
    metrics.register_hooks(HookRegistry, HookType)
    requests.register_hooks(HookRegistry, HookType)  # every server, with or without TTS
    weight_sync.register_hooks(HookRegistry, HookType)  # a TTS server: target weights to the target, a drafter's to TTS
    reason_hook = adaptive_steps.adaptive_reason_hook(ALGORITHM_NAME, lambda: builtin_algorithm().name)
    HookRegistry.register(adaptive_steps.ADAPTIVE_REASON_TARGET, reason_hook, HookType.AROUND)
    _registered = True
