"""SGLang's weight-update endpoints on a TTS server: the target's new weights reach the target only.

An RL trainer changes the served policy through `/update_weights_from_disk` (or `_from_tensor`,
`_from_distributed`, `_from_ipc`). SGLang 0.5.23's `SchedulerWeightUpdaterManager` fans each of
them out to `_select_runners(selector)`: the target's runner first, then every runner the
speculative worker lists in `weight_update_runners()`: the draft runner. `/update_weights_from_disk`
has no selector, so the target's checkpoint is loaded into the drafter too, where it does not fit:
an EAGLE-3 drafter's `load_weights` asserts on the first shape (the scheduler dies; stock EAGLE3
the same), and a DFlash drafter silently takes whatever target tensors share its names and shapes.

On a TTS server the drafter's weights are TTS's own (a trained copy, its base weights, the
optimizer state, per-request adapters), published into SGLang's draft model in place. So an AROUND
hook on `_select_runners` hands SGLang views of its runners whose `weight_updater` is TTS's:
- the target runner's view is the runner itself, except that a successful load of new target
  weights (selector "all" or "target") tells the worker's `TargetSync` (below);
- selector "all" (the default, and the only one `/update_weights_from_disk` and `_from_ipc` know):
  the payload is the target's. The draft runner's view loads nothing into the drafter and answers
  success (SGLang loads the target first and stops at the first failure);
- selector "draft" (a trainer shipping a retrained drafter through `_from_tensor` or
  `_from_distributed`): refused, with a message naming the reason (400); the drafter is unchanged.
Everything else of the draft runner (`check_weights`, begin/end of a weight-update session, ...)
is the runner's own, except that the drafter's weights are never restored or post-processed for a
load that will not come.

`TargetSync.target_updated` runs on the scheduler thread, between rounds: it collects an update
still in flight (trained against the old target) and publishes it, refreshes the drafter's borrowed
copies of the target's embedding and LM head (SGLang's draft model shares the target's tensors, so
serving already reads the new ones; the trained copy must too, or updates train on the old ones),
and then, with `--tts-on-target-update reset` (the default), resets the adapted drafter(s) to base
so that the next round drafts with the base drafter; with `keep` adaptation goes on from where it
is. Counted in `sglang_tts:target_updates_total{source}` and logged.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from sglang_tts.sglang.runtime import TTSRuntime

logger = logging.getLogger(__name__)

OnTargetUpdate = Literal["keep", "reset"]
ON_TARGET_UPDATE_MODES = ("keep", "reset")
TargetSource = Literal["disk", "tensor", "distributed", "ipc"]

SELECT_RUNNERS = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager._select_runners"
# Why a TTS server refuses drafter weights sent through selector="draft" (the HTTP answer is a 400).
DRAFT_UPDATE_REFUSED = (
    "sglang-tts: this server adapts its drafter at test time (--speculative-algorithm TTS), so the "
    "drafter's weights are TTS's (a trained copy, its base weights, optimizer state); loading new "
    "drafter weights with selector='draft' is not supported. Update the target with selector "
    "'all' or 'target' (the drafter follows per --tts-on-target-update), or relaunch with the "
    "retrained drafter as --speculative-draft-model-path."
)


@dataclass
class TargetUpdateReport:
    """What one target update did to the drafter (returned for logs and tests)."""

    source: TargetSource
    action: OnTargetUpdate
    refreshed: tuple[str, ...]  # the borrowed target tensors the trained drafter re-read
    index: int  # 1 for the server's first target update


class TargetSync:
    """One TTS worker's side of SGLang's weight updates."""

    def __init__(self, runtime: TTSRuntime, target_model: torch.nn.Module, mode: OnTargetUpdate) -> None:
        if mode not in ON_TARGET_UPDATE_MODES:
            raise ValueError(f"--tts-on-target-update must be one of {'|'.join(ON_TARGET_UPDATE_MODES)}, got {mode!r}")
        self.runtime = runtime
        self.target_model = target_model
        self.mode: OnTargetUpdate = mode
        self.num_target_updates = 0
        self.counter = _target_update_counter()

    def target_updated(self, source: TargetSource) -> TargetUpdateReport:
        """SGLang has written new target weights (scheduler thread, between rounds)."""
        runtime = self.runtime
        refreshed: tuple[str, ...] = ()
        with runtime.failures.absorb("target_update"):
            # An update in flight trained against the old target: collect and publish it first, so
            # that nothing reads the borrowed tensors while they change.
            runtime._absorbing(lambda: runtime.distiller.barrier(force=True))
            refreshed = refresh_borrowed_target_tensors(runtime.drafter, self.target_model)
        if self.mode == "reset":
            with runtime.failures.absorb("target_update"):  # resets even if the above failed
                runtime._absorbing(runtime.distiller.reset)
        self.num_target_updates += 1
        if self.counter is not None:
            self.counter.labels(source=source).inc()
        report = TargetUpdateReport(source, self.mode, refreshed, self.num_target_updates)
        logger.info(
            "sglang-tts: target weights updated (%s, update %d): drafter %s; re-read borrowed %s",
            source,
            report.index,
            "reset to base" if self.mode == "reset" else "kept, adapting on",
            ", ".join(refreshed) or "nothing",
        )
        return report


def refresh_borrowed_target_tensors(drafter: torch.nn.Module, target_model: torch.nn.Module) -> tuple[str, ...]:
    """Copy the target's current embedding / LM head into the buffers the differentiable drafter
    borrowed them in (`embed_weight`, `borrowed_lm_head`: copies taken at launch, shared with the
    Distiller's base and training copies), in place. An EAGLE-3 drafter that owns its embedding
    (its hidden size differs from the target's) or its LM head (a draft vocabulary) keeps them."""
    embedding = _target_embedding(target_model)
    head = getattr(getattr(target_model, "lm_head", None), "weight", None)
    refreshed: list[str] = []
    with torch.inference_mode(False), torch.no_grad():
        for module in drafter.modules():
            if not hasattr(module, "attach_target"):
                continue
            cfg = getattr(module, "cfg", None)
            pairs = (
                ("embed_weight", embedding, not getattr(cfg, "own_embedding", False)),
                ("borrowed_lm_head", head, getattr(cfg, "lm_head_from_target", True)),
            )
            for name, source, borrowed in pairs:
                buffer = getattr(module, name, None)
                if buffer is None or source is None or not borrowed:
                    continue
                if source.shape[0] < buffer.shape[0] or source.shape[1:] != buffer.shape[1:]:
                    raise RuntimeError(
                        f"the target's new {name} {tuple(source.shape)} does not fit the drafter's "
                        f"{tuple(buffer.shape)}"
                    )
                buffer.copy_(source[: buffer.shape[0]].to(device=buffer.device, dtype=buffer.dtype))
                refreshed.append(name)
    return tuple(refreshed)


def _target_embedding(target_model: torch.nn.Module) -> torch.Tensor | None:
    if hasattr(target_model, "get_input_embeddings"):
        module = target_model.get_input_embeddings()
    else:
        module = getattr(getattr(target_model, "model", None), "embed_tokens", None)
    return getattr(module, "weight", None)


# --- the views SGLang's weight updater sees in place of the draft runner -------------------------


class _TargetLoads:
    """The target runner's own weight updater, unchanged, except that a successful load of new
    target weights tells TargetSync (once per operation; selectors "all" and "target" alike)."""

    def __init__(self, updater: Any, sync: TargetSync) -> None:
        self._updater = updater
        self._sync = sync

    def __getattr__(self, name: str) -> Any:
        return getattr(self._updater, name)

    def _loaded(self, source: TargetSource, result: tuple[bool, str]) -> tuple[bool, str]:
        if result[0]:
            self._sync.target_updated(source)
        return result

    def update_weights_from_disk(self, *args: Any, **kwargs: Any) -> tuple[bool, str]:
        return self._loaded("disk", self._updater.update_weights_from_disk(*args, **kwargs))

    def update_weights_from_tensor(self, *args: Any, **kwargs: Any) -> tuple[bool, str]:
        return self._loaded("tensor", self._updater.update_weights_from_tensor(*args, **kwargs))

    def load_weights_from_distributed(self, *args: Any, **kwargs: Any) -> tuple[bool, str]:
        return self._loaded("distributed", self._updater.load_weights_from_distributed(*args, **kwargs))

    def update_weights_from_ipc(self, *args: Any, **kwargs: Any) -> tuple[bool, str]:
        return self._loaded("ipc", self._updater.update_weights_from_ipc(*args, **kwargs))


class _KeepDrafter:
    """The draft runner's weight updater while the target's weights are loaded (selector "all"):
    loads nothing; its answer is the operation's (SGLang returns the last runner's message)."""

    def __init__(self, sync: TargetSync) -> None:
        self._sync = sync

    def _kept(self, *args: Any, **kwargs: Any) -> tuple[bool, str]:
        verb = "reset to base" if self._sync.mode == "reset" else "kept"
        return True, f"Target weights updated; the TTS drafter keeps its own weights ({verb})."

    update_weights_from_disk = update_weights_from_tensor = _kept
    load_weights_from_distributed = update_weights_from_ipc = _kept

    def begin_weight_update(self) -> None:
        """Nothing is loaded into the drafter: its weights stay as they serve."""

    def end_weight_update(self, *, run_post_load: bool) -> None:
        """Nothing was loaded into the drafter."""


class _RefuseDrafterWeights:
    """The draft runner's weight updater for selector "draft": TTS owns the drafter's weights."""

    def update_weights_from_disk(self, *args: Any, **kwargs: Any) -> tuple[bool, str]:
        return False, DRAFT_UPDATE_REFUSED

    update_weights_from_tensor = load_weights_from_distributed = update_weights_from_ipc = update_weights_from_disk

    def begin_weight_update(self) -> None:
        """The load will be refused: the drafter's weights are left as they serve."""

    def end_weight_update(self, *, run_post_load: bool) -> None:
        """Nothing was loaded into the drafter."""


class RunnerView:
    """One of SGLang's ModelRunners with TTS's weight updater in place of its own."""

    def __init__(self, runner: Any, weight_updater: _TargetLoads | _KeepDrafter | _RefuseDrafterWeights) -> None:
        self._runner = runner
        self.weight_updater = weight_updater

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


# --- wiring -----------------------------------------------------------------------------------------

_syncs: weakref.WeakKeyDictionary[Any, TargetSync] = weakref.WeakKeyDictionary()


def target_sync(spec_worker: Any) -> TargetSync | None:
    """The TargetSync of a TTS speculative worker (made at its first weight update); None for any
    other worker (no speculation, stock EAGLE3 / DFLASH, NGRAM: SGLang's behaviour unchanged)."""
    from sglang_tts.sglang.runtime import TTSRuntime

    runtime = getattr(spec_worker, "tts", None)
    if not isinstance(runtime, TTSRuntime):
        return None
    sync = _syncs.get(spec_worker)
    if sync is None:
        target_model = spec_worker.target_worker.model_runner.model
        sync = TargetSync(runtime, target_model, runtime.config.on_target_update)
        _syncs[spec_worker] = sync
    return sync


def route_runners(runners: list[tuple[str, Any]], sync: TargetSync) -> list[tuple[str, Any]]:
    """SGLang's (role, runner) list for one weight operation, with TTS's views: the target's loads
    tell `sync`; the drafter keeps its weights (the target's are loaded too) or refuses (they are not)."""
    with_target = any(role == "target" for role, _ in runners)
    draft_updater = _KeepDrafter(sync) if with_target else _RefuseDrafterWeights()
    return [
        (role, RunnerView(runner, _TargetLoads(runner.weight_updater, sync) if role == "target" else draft_updater))
        for role, runner in runners
    ]


def select_runners_hook(original, manager, *args: Any, **kwargs: Any) -> list[tuple[str, Any]]:
    """AROUND hook on SchedulerWeightUpdaterManager._select_runners (see the module docstring)."""
    runners = original(manager, *args, **kwargs)
    sync = target_sync(manager.draft_worker)
    return runners if sync is None else route_runners(runners, sync)


def register_hooks(registry, hook_type) -> None:
    registry.register(SELECT_RUNNERS, select_runners_hook, hook_type.AROUND)


_counter: list[Any] = []


def _target_update_counter():
    """Prometheus `sglang_tts:target_updates_total{source}` where SGLang collects metrics (made once
    per process: prometheus_client refuses a second collector of the same name)."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    if not _counter:
        try:
            from prometheus_client import Counter

            _counter.append(
                Counter(
                    "sglang_tts:target_updates_total",
                    "Target weight updates a TTS server applied (the drafter kept its own weights)",
                    ["source"],
                )
            )
        except (ImportError, ValueError):
            logger.warning("sglang-tts: the target update counter is unavailable", exc_info=True)
            _counter.append(None)
    return _counter[0]
