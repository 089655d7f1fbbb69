"""SGLang's weight-update endpoints on a TTS server: the target's new weights reach the target, a
retrained drafter's reach the drafter and become TTS's base.

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
  `_from_distributed`, EAGLE-3 and DFlash alike): `TargetSync.drafter_loaded`, below.
Everything else of the draft runner (`check_weights`, begin/end of a weight-update session, ...)
is the runner's own, except that in a session opened with selector "all" the drafter's weights are
not restored or post-processed (no-ops for the unquantized draft models TTS binds).

`TargetSync.target_updated` runs on the scheduler thread, between rounds: it collects an update
still in flight (trained against the old target) and publishes it, refreshes the drafter's borrowed
copies of the target's embedding and LM head (SGLang's draft model shares the target's tensors, so
serving already reads the new ones; the trained copy must too, or updates train on the old ones),
and then, with `--tts-on-target-update reset` (the default), resets the adapted drafter(s) to base
so that the next round drafts with the base drafter; with `keep` adaptation goes on from where it
is. Counted in `sglang_tts:target_updates_total{source}` and logged.

`TargetSync.drafter_loaded` (selector "draft", scheduler thread, between rounds; per call, so a
drafter shipped in several calls of one session is re-read after each):
1. every tensor must fit the drafter, by the names and shapes its checkpoint loader takes
   (`checkpoint_plan`: `midlayer.` / `model.` prefixes, separate q/k/v and gate/up), land on a
   parameter that SGLang's draft model holds (not the target's borrowed embedding or LM head), be
   finite; `d2t` / `t2d` must equal the launched ones (SGLang keeps drafting with its draft
   vocabulary). Else the answer is a 400 naming the tensors (`DRAFT_UPDATE_REFUSED`), and nothing
   has changed. Only `load_format` null (named tensors) is taken.
2. SGLang's draft runner loads them with its own weight updater, as for stock EAGLE3 (fused
   qkv / gate_up, CPU repacking), after a snapshot of the draft model's bound parameters;
3. TTS re-reads them from SGLang's draft model through the publish binding read backwards
   (`WeightPublisher.read`) and checks that SGLang holds exactly the shipped values;
4. `Distiller.rebase`: the update in flight is collected and discarded, the trained copy and the
   base weights take the new values (tensors not shipped keep their base values), then a reset:
   fresh optimizer state, per-request adapters back to base, the guard's scores forgotten, the base
   published (SGLang's draft model then holds the new base everywhere).
A failure in 2-4 (an exception in SGLang's loader, a value SGLang did not take, ...) is absorbed at
the site `drafter_update`: SGLang's draft model is written back from the snapshot, TTS keeps the
drafter it had, and the answer is a 400 saying so; the server serves on. Counted in
`sglang_tts:drafter_updates_total{source,result}` (result applied / refused / failed) and logged.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from sglang_tts.core.publish import ParamBinding

if TYPE_CHECKING:
    from sglang_tts.core.publish import WeightPublisher
    from sglang_tts.sglang.runtime import TTSRuntime

logger = logging.getLogger(__name__)

OnTargetUpdate = Literal["keep", "reset"]
ON_TARGET_UPDATE_MODES = ("keep", "reset")
TargetSource = Literal["disk", "tensor", "distributed", "ipc"]
DrafterUpdateResult = Literal["applied", "refused", "failed"]
NamedTensors = Sequence[tuple[str, Any]]
DRAFTER_SITE = "drafter_update"  # sglang/failures.py

SELECT_RUNNERS = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager._select_runners"
# How a 400 for drafter weights that do not fit begins; the tensors at fault follow.
DRAFT_UPDATE_REFUSED = "sglang-tts: drafter weights refused, the drafter is unchanged"
# How a 400 for a drafter load that failed part-way begins; the error follows.
DRAFT_UPDATE_FAILED = "sglang-tts: loading the drafter weights failed and was rolled back, the drafter is unchanged"
# The draft vocabulary maps: a shipped copy must equal the launched one (SGLang drafts with that one).
VOCAB_MAPS = ("d2t", "t2d")
_NAMED_AT_MOST = 4  # tensors a refusal names (then "and N more")


class DrafterTensorError(ValueError):
    """Shipped drafter tensors that do not fit; `problems` names each one."""

    def __init__(self, problems: list[str]) -> None:
        shown = "; ".join(problems[:_NAMED_AT_MOST])
        more = f"; and {len(problems) - _NAMED_AT_MOST} more" if len(problems) > _NAMED_AT_MOST else ""
        super().__init__(shown + more)
        self.problems = problems


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
        self.num_drafter_updates = 0
        self.counter = _target_update_counter()
        self.drafter_counter = _drafter_update_counter()
        self._drafter_weights: DrafterWeights | None = None

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

    def drafter_loaded(
        self,
        source: TargetSource,
        named_tensors: NamedTensors,
        draft_model: torch.nn.Module,
        load: Callable[[list[tuple[str, torch.Tensor]]], tuple[bool, str]],
    ) -> tuple[bool, str]:
        """A retrained drafter's tensors through selector "draft" (scheduler thread, between rounds):
        refused if they do not fit; else `load` (SGLang's draft runner's own weight updater) writes them
        into `draft_model`, TTS re-reads them as its base and starts a fresh adaptation; a failure is
        rolled back (module docstring). Returns SGLang's (success, message)."""
        runtime = self.runtime
        try:
            weights = self._weights_of(draft_model)
            tensors = [(str(name), _local_tensor(tensor)) for name, tensor in named_tensors]
            plan = weights.plan(tensors)
        except DrafterTensorError as error:
            return self._drafter_done(source, "refused", f"{DRAFT_UPDATE_REFUSED}: {error}")
        except Exception as error:  # noqa: BLE001 - never take the scheduler down
            runtime.failures.record(DRAFTER_SITE, error, [])
            return self._drafter_done(source, "failed", f"{DRAFT_UPDATE_FAILED}: {type(error).__name__}: {error}")
        to_load = [(name, tensor) for name, tensor in tensors if name in plan and plan[name] not in VOCAB_MAPS]
        failures = runtime.failures
        failed_before = failures.counts.get(DRAFTER_SITE, 0)
        snapshot: list[tuple[ParamBinding, torch.Tensor]] | None = None
        answer: tuple[bool, str] = (False, "not loaded")
        values: dict[str, torch.Tensor] = {}
        with failures.absorb(DRAFTER_SITE):
            snapshot = weights.snapshot()
            answer = load(to_load)  # SGLang's own loader (it may assert, or answer a failure)
            if answer[0]:
                values = weights.read(plan, tensors)
        if failures.counts.get(DRAFTER_SITE, 0) != failed_before:
            why = failures.last_error[DRAFTER_SITE]
            return self._drafter_done(source, "failed", self._rolled_back(weights, snapshot, why))
        if not answer[0]:
            return self._drafter_done(source, "failed", self._rolled_back(weights, snapshot, answer[1]))
        discarded = runtime.distiller.executor.pending
        try:  # rebase restores TTS's copies itself if it fails part-way
            runtime._absorbing(lambda: runtime.distiller.rebase(values))
        except Exception as error:  # noqa: BLE001
            failures.record(DRAFTER_SITE, error, [])
            return self._drafter_done(
                source, "failed", self._rolled_back(weights, snapshot, f"{type(error).__name__}: {error}")
            )
        self.num_drafter_updates += 1
        names = sorted({plan[name] for name, _ in to_load})
        logger.info(
            "sglang-tts: drafter weights loaded (%s, drafter update %d): %d tensors re-read as the TTS "
            "drafter's base (%s); adaptation restarts from them%s",
            source,
            self.num_drafter_updates,
            len(to_load),
            ", ".join(names[:6]) + (", ..." if len(names) > 6 else ""),
            "; the update in flight was discarded" if discarded else "",
        )
        return self._drafter_done(
            source,
            "applied",
            f"sglang-tts: drafter weights loaded ({len(to_load)} tensors); the TTS drafter re-read them as its "
            "base and adapts from there.",
            ok=True,
        )

    def _weights_of(self, draft_model: torch.nn.Module) -> DrafterWeights:
        if self._drafter_weights is None or self._drafter_weights.draft_model is not draft_model:
            self._drafter_weights = DrafterWeights(self.runtime, draft_model)
        return self._drafter_weights

    def _rolled_back(
        self, weights: DrafterWeights, snapshot: list[tuple[ParamBinding, torch.Tensor]] | None, why: str
    ) -> str:
        """Write SGLang's draft model back from the snapshot; the 400's message."""
        if snapshot is None:
            return f"{DRAFT_UPDATE_FAILED}: {why}"
        try:
            weights.restore(snapshot)
        except Exception as error:  # noqa: BLE001
            self.runtime.failures.record(DRAFTER_SITE, error, [])
            # The trained copy is what served before: the next barrier publishes it over SGLang's.
            self.runtime.distiller.republish()
            return (
                f"sglang-tts: loading the drafter weights failed ({why}) and writing SGLang's draft model "
                f"back failed too ({type(error).__name__}: {error}); TTS republishes the drafter it had at "
                "the next round"
            )
        return f"{DRAFT_UPDATE_FAILED}: {why}"

    def _drafter_done(
        self, source: TargetSource, result: DrafterUpdateResult, message: str, ok: bool = False
    ) -> tuple[bool, str]:
        if self.drafter_counter is not None:
            self.drafter_counter.labels(source=source, result=result).inc()
        if not ok:
            logger.warning("%s (%s)", message, source)
        return ok, message


def _local_tensor(value: Any) -> Any:
    """A shipped tensor, unwrapped from SGLang's per-rank LocalSerializedTensor (rank 0: TTS serves
    one rank); anything else as it came (plan() refuses what is not a tensor)."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor

    return value.get(0) if isinstance(value, LocalSerializedTensor) else value


class DrafterWeights:
    """A TTS worker's differentiable drafter (the plain one under per-request adapters) bound to
    SGLang's draft model, read backwards: which shipped tensors fit, their values in SGLang's draft
    model after its load, and a snapshot of that model's bound parameters to roll back to."""

    def __init__(self, runtime: TTSRuntime, draft_model: torch.nn.Module) -> None:
        from sglang_tts.core.adapters import AdaptedDrafter
        from sglang_tts.sglang.binding import bind_draft_reader

        drafter = runtime.drafter
        adapted = isinstance(drafter, AdaptedDrafter)
        self.drafter: torch.nn.Module = drafter.base if adapted else drafter
        self.prefix = "base." if adapted else ""  # its parameters' names in the Distiller's trained drafter
        self.draft_model = draft_model
        self.params = {name: p.detach() for name, p in self.drafter.named_parameters()}
        self.reader: WeightPublisher
        self.reader, unbound = bind_draft_reader(self.drafter, draft_model)
        self.bound = set(self.params) - set(unbound)
        self.serving_dtype = {source: b.dst.dtype for b in self.reader.bindings for source in b.sources}

    def plan(self, tensors: list[tuple[str, Any]]) -> dict[str, str]:
        """{shipped name: the drafter's parameter (or d2t / t2d)}; raises DrafterTensorError naming every
        tensor that does not fit (checked before anything is written)."""
        from sglang_tts.drafters.common import CheckpointTensorError

        problems: list[str] = []
        plan: dict[str, str] = {}
        for name, tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                problems.append(f"{name}: not a tensor ({type(tensor).__name__})")
                continue
            try:
                mapped, ignored = self.drafter.checkpoint_plan({name: tuple(tensor.shape)}, partial=True)
            except CheckpointTensorError as error:
                problems.append(str(error))
                continue
            if ignored:
                stem = name.removeprefix("model.").split(".")[0]
                if stem in ("embed_tokens", "lm_head"):
                    problems.append(f"{name}: the drafter uses the target's {stem} (update it with selector 'target')")
                else:
                    problems.append(f"{name}: no tensor of the {self.drafter.kind} drafter has this name")
                continue
            own = mapped[name]
            if own in plan.values():
                problems.append(f"{name}: {own} is shipped twice")
            elif own in VOCAB_MAPS:
                launched = getattr(self.drafter, own)
                if not torch.equal(tensor.to(device=launched.device, dtype=launched.dtype), launched):
                    problems.append(
                        f"{name}: differs from the launched draft vocabulary map; SGLang drafts with the one it "
                        "launched with (relaunch with the retrained drafter to change it)"
                    )
            elif own not in self.bound:
                problems.append(
                    f"{name}: the drafter's {own} is not a parameter SGLang's draft model holds for it "
                    "(loaded at launch only)"
                )
            elif not tensor.is_floating_point():
                problems.append(f"{name}: dtype {tensor.dtype} (a floating-point tensor expected)")
            elif not bool(torch.isfinite(tensor).all()):
                problems.append(f"{name}: has non-finite values")
            plan[name] = own
        if problems:
            raise DrafterTensorError(problems)
        return plan

    def snapshot(self) -> list[tuple[ParamBinding, torch.Tensor]]:
        with torch.inference_mode(False), torch.no_grad():
            return [(binding, binding.dst.detach().clone()) for binding in self.reader.bindings]

    def restore(self, snapshot: list[tuple[ParamBinding, torch.Tensor]]) -> None:
        """Write the snapshot back through ParamBinding.write, so a packed copy follows (CPU layer)."""
        with torch.inference_mode(False), torch.no_grad():
            for binding, saved in snapshot:
                ParamBinding(binding.dst, ["saved"], name=binding.name).write({"saved": saved})

    def read(self, plan: dict[str, str], tensors: list[tuple[str, Any]]) -> dict[str, torch.Tensor]:
        """The shipped parameters' values in SGLang's draft model after its load, by name in the
        Distiller's trained drafter; raises if SGLang does not hold exactly the shipped values."""
        with torch.inference_mode(False), torch.no_grad():
            out = {name: torch.empty_like(self.params[name]) for name in self.bound}
            self.reader.read(out)
            values: dict[str, torch.Tensor] = {}
            for name, tensor in tensors:
                own = plan[name]
                if own in VOCAB_MAPS:
                    continue
                held = out[own]
                expected = tensor.to(device=held.device, dtype=self.serving_dtype[own]).to(held.dtype)
                if not torch.equal(held, expected):
                    raise RuntimeError(f"{name}: SGLang's draft model does not hold the shipped values after its load")
                values[self.prefix + own] = held
        return values


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


class _LoadDrafter:
    """The draft runner's weight updater for selector "draft" (a retrained drafter): SGLang's own,
    behind TargetSync.drafter_loaded (checks first, re-read as TTS's base after, rolled back on failure).
    Begin / end of a session opened with selector "draft" are the runner's own."""

    def __init__(self, runner: Any, sync: TargetSync) -> None:
        self._runner = runner
        self._updater = runner.weight_updater
        self._sync = sync

    def __getattr__(self, name: str) -> Any:
        return getattr(self._updater, name)

    def update_weights_from_tensor(self, named_tensors: Any, load_format: str | None = None) -> tuple[bool, str]:
        if load_format is not None:
            return False, (
                f"{DRAFT_UPDATE_REFUSED}: load_format {load_format!r} is not taken for the TTS drafter; send "
                "named tensors (load_format null)"
            )
        return self._sync.drafter_loaded(
            "tensor",
            named_tensors,
            self._runner.model,
            lambda tensors: self._updater.update_weights_from_tensor(named_tensors=tensors, load_format=None),
        )

    def load_weights_from_distributed(self, named_tensors: Any) -> tuple[bool, str]:
        return self._sync.drafter_loaded(
            "distributed", named_tensors, self._runner.model, self._updater.load_weights_from_distributed
        )

    def update_weights_from_disk(self, *args: Any, **kwargs: Any) -> tuple[bool, str]:
        """Not reached in SGLang 0.5.23 (from disk and IPC know no selector: they load the target)."""
        return False, f"{DRAFT_UPDATE_REFUSED}: send a retrained drafter's tensors through /update_weights_from_tensor"

    update_weights_from_ipc = update_weights_from_disk


class RunnerView:
    """One of SGLang's ModelRunners with TTS's weight updater in place of its own."""

    def __init__(self, runner: Any, weight_updater: _TargetLoads | _KeepDrafter | _LoadDrafter) -> None:
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
    tell `sync`; the drafter keeps its weights (the target's are loaded: selector "all") or loads the
    payload as a retrained drafter (selector "draft": no target runner)."""
    with_target = any(role == "target" for role, _ in runners)
    keep = _KeepDrafter(sync)

    def view(role: str, runner: Any) -> RunnerView:
        if role == "target":
            return RunnerView(runner, _TargetLoads(runner.weight_updater, sync))
        return RunnerView(runner, keep if with_target else _LoadDrafter(runner, sync))

    return [(role, view(role, runner)) for role, runner in runners]


def select_runners_hook(original, manager, *args: Any, **kwargs: Any) -> list[tuple[str, Any]]:
    """AROUND hook on SchedulerWeightUpdaterManager._select_runners (see the module docstring)."""
    runners = original(manager, *args, **kwargs)
    sync = target_sync(manager.draft_worker)
    return runners if sync is None else route_runners(runners, sync)


def register_hooks(registry, hook_type) -> None:
    registry.register(SELECT_RUNNERS, select_runners_hook, hook_type.AROUND)


_counters: dict[str, Any] = {}


def _prometheus_counter(name: str, documentation: str, labels: list[str]):
    """A Prometheus counter where SGLang collects metrics (made once per process: prometheus_client
    refuses a second collector of the same name); None without metrics."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    if name not in _counters:
        try:
            from prometheus_client import Counter

            _counters[name] = Counter(name, documentation, labels)
        except (ImportError, ValueError):
            logger.warning("sglang-tts: the counter %s is unavailable", name, exc_info=True)
            _counters[name] = None
    return _counters[name]


def _target_update_counter():
    """Prometheus `sglang_tts:target_updates_total{source}`."""
    return _prometheus_counter(
        "sglang_tts:target_updates_total",
        "Target weight updates a TTS server applied (the drafter kept its own weights)",
        ["source"],
    )


def _drafter_update_counter():
    """Prometheus `sglang_tts:drafter_updates_total{source,result}` (result: applied, refused, failed)."""
    return _prometheus_counter(
        "sglang_tts:drafter_updates_total",
        "Retrained drafter weights sent with selector 'draft' to a TTS server: applied (re-read as the "
        "drafter's base), refused (did not fit), failed (rolled back)",
        ["source", "result"],
    )
