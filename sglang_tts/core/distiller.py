"""The Distiller: when to update the drafter, how, and when the serving copy sees the result.

Per verify round the engine adapter calls, in this order:

    distiller.barrier()        before drafting: if an update is pending *and due*, wait for it
                               (CPU-side) and, if it succeeded, publish the trained weights
    ... draft, verify ...
    distiller.observe(canvas)  every `update_stride` rounds (S, 2S, ... of the current scope),
                               submit one update on a private copy of *this* canvas (no
                               accumulation over the skipped rounds, paper appendix C.1)

When an update is due (the schedule is deterministic, independent of timing):
  - inline executor (--tts-sync): at the very next round, as in the paper's Algorithm 1;
  - async executors: the update submitted after round kS overlaps rounds kS+1 .. kS+S-1 and is
    applied by the barrier before round (k+1)S, whose observe() submits the next one (paper C.1:
    "a synchronization barrier is inserted after S-1 rounds"). With S = 1 that is the next round.
  barrier(force=True) applies a pending update now (end of a scope, tests, checkpoints).

Prompt updates (core/prompt.py, --tts-prompt-adapt): submit_prompt(batch) runs `prompt_steps`
optimizer steps of the drafter's own objective on prompt windows, at `prompt_step_lr`, moving only
the `prompt_trainable` parameters, with an optimizer state of their own (fresh per prompt update);
in the executor like any update, rolled back the same way, and published by the barrier on the same
schedule. Counted apart (stats.num_prompt_updates, ...).

Weight versions. The drafter is trained in a private copy; the serving copy is written only
inside barrier() (reset() publishes through barrier() too), and only while no update is running
(a barrier that is not due while one is in flight publishes nothing: it would copy tensors the
worker is stepping), so a draft sees either all-old or all-new weights, never a mix, and CUDA
graphs replay on complete weights. Publishing is all or nothing: if writing the serving copy
fails part-way, the last published weights are written back (counted in
stats.num_failed_publishes, logged) and the next barrier publishes again.
  - publisher is None: `drafter` *is* the serving copy; the Distiller trains a deep copy of it
    (frozen parameters and buffers are shared, not copied) and copies the trained tensors into
    `drafter`'s own parameters at barrier().
  - publisher given: `drafter` is the training copy (the engine keeps its own inference copy,
    possibly fused or TP-sharded) and barrier() calls publisher.publish(trained tensors), keyed
    by the names of drafter.trainable_named_parameters().

Failures never reach the caller: a non-finite loss, gradient or weight, or any exception inside
the update, rolls the trained copy *and* the optimizer state back to before the update, is
counted in stats.num_skipped_updates and logged. If the rollback itself fails, the trained copy
is set back to the last published weights with a fresh optimizer state. The loss and the
gradient are checked *before* the optimizer step, so a one-step update that fails has, in all
but one case, changed nothing yet, and it takes no rollback copy when the trained copy is at the
published weights (the usual case: about a fifth of an update's time on CPU saved). The one case, a
failure after its step (an exception, or non-finite weights, which finite gradients and a finite
learning rate cannot produce), goes back to the last published weights -- the weights before the
update -- with a fresh optimizer state. Multi-step and prompt updates, and per-request adapters
(small, and each request has optimizer state of its own), keep the exact rollback copy.

Do no harm (core/guard.py, on unless config.guard is False): each update scores the adapted
drafter against the base drafter on its canvas before its step; when the adapted drafter of a
unit (the shared drafter, or one request's adapter) is worse over a window, the next barrier
resets that unit to base (stats.num_guard_resets, logged once per reset).

New base weights (rebase(), sglang/weight_sync.py: a trainer shipped a retrained drafter and the
engine loaded it into the serving copy): the update in flight is collected and discarded, the
trained copy and the base weights take the new values, and reset() starts a fresh adaptation.

Memory: besides the trained copy, a base copy of the trained parameters (what a reset restores and
what the guard scores against), one rollback copy of the trained parameters and optimizer
state (refilled in place before an update that needs it) and one copy of the last published trained
parameters (what a failed publish or a failed rollback goes back to); and one set of canvas
buffers (core/canvas.py: CanvasBuffers) that engines fill through capture_buffers() and hand to
observe(canvas, owned=True), so an update's canvas is copied once, on the device.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from sglang_tts.config import TTSConfig, TTSConfigError, rounds_held
from sglang_tts.core.canvas import Canvas, CanvasBuffers, stack_rounds
from sglang_tts.core.executor import SyncExecutor, UpdateExecutor, UpdateResult
from sglang_tts.core.guard import SCOPE_UNIT, DoNoHarmGuard, greedy_scores
from sglang_tts.core.loss import compute_loss, tts_loss
from sglang_tts.core.profiling import PhaseTimer
from sglang_tts.core.prompt import PromptBatch, prompt_loss
from sglang_tts.core.publish import WeightPublisher
from sglang_tts.core.stats import DistillerStats
from sglang_tts.drafters.wgrad import WeightGradBank, deferred_weight_grads

logger = logging.getLogger(__name__)

#: What a fault injector may return for an update (tests and failure drills):
#:   "nan"   the loss of the update's last step becomes NaN (caught before backward)
#:   "raise" an exception right after the first optimizer step (weights already modified)
#:   "inf_grad"    a gradient element becomes Inf at the first step, the loss stays finite
#:   "nan_weights" a trained weight becomes NaN after the last optimizer step
Fault = Literal["nan", "raise", "inf_grad", "nan_weights"]


@dataclass
class UpdateOutcome:
    status: Literal["ok", "skipped", "empty"]  # empty: no position entered the loss, nothing done
    reason: str = ""
    loss: float = math.nan  # before the first step, i.e. of the drafter the canvas was drafted with
    kl_teacher: float = math.nan
    num_positions: int = 0
    round: int = -1  # the Distiller round that submitted this update
    update_index: int = -1  # 0-based count of submitted updates
    kind: Literal["verify", "prompt"] = "verify"
    last_loss: float = math.nan  # prompt updates: the loss before their last step
    steps: int = 0  # optimizer steps taken
    # Do-no-harm scores (core/guard.py), one per canvas row that has a unit: whether the adapted
    # drafter's and the base drafter's top token at the canvas's first position is the target's.
    guard_units: list[int] | None = None
    guard_adapted: list[float] | None = None
    guard_base: list[float] | None = None


class _RollbackPoint:
    """Copies of the trained parameters and the optimizer state, taken before each update.

    Buffers are allocated once and refilled in place, so the per-update cost is a device copy.
    """

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.param_copies = [p.detach().clone() for p in params]
        self.state_copies: dict[int, dict[str, Any]] = {}

    @torch.no_grad()
    def save(self, optimizer: torch.optim.Optimizer) -> None:
        torch._foreach_copy_(self.param_copies, [p.detach() for p in self.params])
        saved: dict[int, dict[str, Any]] = {}
        for i, p in enumerate(self.params):
            state = optimizer.state.get(p)
            if not state:
                continue
            previous = self.state_copies.get(i, {})
            entry: dict[str, Any] = {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    buf = previous.get(key)
                    same = isinstance(buf, torch.Tensor) and buf.shape == value.shape and buf.dtype == value.dtype
                    entry[key] = buf.copy_(value) if same else value.detach().clone()
                else:
                    entry[key] = copy.deepcopy(value)
            saved[i] = entry
        self.state_copies = saved

    @torch.no_grad()
    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        torch._foreach_copy_([p.detach() for p in self.params], self.param_copies)
        for i, p in enumerate(self.params):
            entry = self.state_copies.get(i)
            if entry is None:
                optimizer.state.pop(p, None)
                continue
            state = optimizer.state[p]
            for key in [k for k in state if k not in entry]:
                del state[key]
            for key, value in entry.items():
                current = state.get(key)
                if (
                    isinstance(value, torch.Tensor)
                    and isinstance(current, torch.Tensor)
                    and current.shape == value.shape
                ):
                    current.copy_(value)  # in place: the optimizer may hold these tensors elsewhere
                else:
                    state[key] = value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def select_trainable(named: list[tuple[str, nn.Parameter]], prefixes: tuple[str, ...] | None) -> list[str]:
    names = [n for n, _ in named if prefixes is None or any(n.startswith(p) for p in prefixes)]
    if not names:
        raise TTSConfigError(f"--tts-trainable {prefixes} selects none of the drafter's trainable parameters")
    return names


def _training_copy(drafter: nn.Module, train_names: list[str]) -> nn.Module:
    """A deep copy whose selected trainable parameters are new tensors; everything else (frozen
    weights such as a borrowed target LM head, and buffers) is shared with `drafter`."""
    return _copy_parameters(drafter, train_names)


def _base_copy(drafter: nn.Module, train_names: list[str]) -> tuple[nn.Module, list[torch.Tensor]]:
    """The base drafter: a copy of `drafter` whose trained parameters are frozen new tensors at their
    current (starting) values; and those tensors, in train_names order."""
    base = _copy_parameters(drafter, train_names)
    named = dict(base.trainable_named_parameters())
    tensors = [named[n] for n in train_names]
    for t in tensors:
        t.requires_grad_(False)
    return base, [t.detach() for t in tensors]


def _copy_parameters(drafter: nn.Module, train_names: list[str]) -> nn.Module:
    trained = dict(drafter.trainable_named_parameters())
    copied_ids = {id(trained[n]) for n in train_names}
    memo = {id(t): t for t in itertools.chain(drafter.parameters(), drafter.buffers()) if id(t) not in copied_ids}
    return copy.deepcopy(drafter, memo)


class Distiller:
    def __init__(
        self,
        drafter: nn.Module,
        config: TTSConfig,
        executor: UpdateExecutor | None = None,
        publisher: WeightPublisher | None = None,
        fault_injector: Callable[[int], str | None] | None = None,
    ) -> None:
        self.config = config.validate()
        self.executor = executor if executor is not None else SyncExecutor()
        self.fault_injector = fault_injector
        self.stats = DistillerStats()

        self.train_names = select_trainable(drafter.trainable_named_parameters(), config.trainable)
        # What a publish writes: the serving tensors of the trained parameters (a fused one whole), not the rest.
        self.publisher = publisher.restricted_to(self.train_names) if publisher is not None else None
        # The module to draft with when publisher is None; None when an engine owns the inference copy.
        self.serving_drafter: nn.Module | None = drafter if publisher is None else None
        # Private: only the update (in the executor) and reset() touch it.
        self.trained_drafter: nn.Module = _training_copy(drafter, self.train_names) if publisher is None else drafter

        named = dict(self.trained_drafter.trainable_named_parameters())
        self.train_params: list[nn.Parameter] = [named[n] for n in self.train_names]
        train_ids = {id(p) for p in self.train_params}
        for p in self.trained_drafter.parameters():  # no gradient work for weights we do not train
            p.requires_grad_(id(p) in train_ids)
        self._serving_params: list[torch.Tensor] = []
        if self.serving_drafter is not None:
            serving_named = dict(self.serving_drafter.trainable_named_parameters())
            self._serving_params = [serving_named[n] for n in self.train_names]

        self.device = self.train_params[0].device
        # The base drafter: the training copy's structure with the trained parameters at their
        # starting values (what reset() restores and what the guard scores against); frozen weights shared.
        self.base_drafter, self.base_weights = _base_copy(self.trained_drafter, self.train_names)
        self.guard: DoNoHarmGuard | None = (
            DoNoHarmGuard(self.config.guard_window, self.config.guard_margin)
            if self.config.guard and self.config.verify_updates
            else None
        )
        self._guard_resets: set[int] = set()  # units the next barrier resets to base
        self.last_guard_resets: list[int] = []  # units the last barrier reset (the engine credits requests)
        self._unit_names = getattr(self.trained_drafter, "slot_parameter_names", None)
        self.timer: PhaseTimer | None = None  # core/profiling.py: phase timings (profiling only)
        # Called on the serving thread with every verify update's result once it is absorbed (the
        # engine's update budget measures its cost there).
        self.on_update_done: Callable[[UpdateResult], None] | None = None
        self._stepped = False  # the running update has taken an optimizer step (worker thread only)
        self._guard_tick = -1  # updates that reached the guard's scoring (worker thread only)
        groups = getattr(self.trained_drafter, "isolation_groups", None)
        self._clip_groups = groups(self.train_names) if groups else [list(range(len(self.train_params)))]
        # One optimizer param group per isolation group (per request with adapters): the guard's
        # backoff scales one unit's learning rate (_strike).
        self.optimizer = self._make_optimizer(groups=self._clip_groups)
        self._index = {n: i for i, n in enumerate(self.train_names)}  # trained parameter name -> train_params index
        self._group_of = {i: g for g, group in enumerate(self._clip_groups) for i in group}
        self._strikes: dict[int, int] = {}  # unit -> guard resets in its life (its scope or request)
        self._rollback = _RollbackPoint(self.train_params)
        self._num_submitted = 0
        self._unpublished = False  # the trained copy holds weights the serving copy has not seen
        # The trained parameters as last published: what a failed publish writes back.
        self._published = [p.detach().clone() for p in self.train_params]
        self._weights_cache: dict[int, torch.Tensor] = {}
        self._wgrad = WeightGradBank()  # gradient buffers of the deferred weight gradients (drafters/wgrad.py)
        self._canvas_buffers = CanvasBuffers(self.device)  # see capture_buffers()
        self._window_start = 0  # scope round at which the current stride's windows began
        self._kept: list[Canvas] = []  # earlier rounds' canvases for the next update (update_window > 1)
        self._rows_per_round = 1  # the latest canvas's rows: how many rounds fit in config.window_rows
        self.last_submitted_rows: list[str] = []
        self.last_submitted_slots: torch.Tensor | None = None
        # Which trained parameters prompt steps move (indices into train_params).
        self._prompt_params = self._select_prompt_params() if self.config.prompt_updates else []

    # --- the serving-thread API -------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self.stats.weight_version

    @property
    def trained_matches_serving(self) -> bool:
        """The trained copy holds exactly the serving weights: no update in flight or unpublished."""
        return not self.executor.pending and not self._unpublished

    def next_round_submits(self) -> bool:
        """Will the next observe() submit an update? Lets the engine build a canvas only then."""
        return self.config.verify_updates and (self._window_rounds + 1) % self.config.update_stride == 0

    def next_round_keeps(self) -> bool:
        """Will the next observe() keep its canvas for the coming update (--tts-update-window > 1)?
        True for the rounds of a stride's last _rounds_per_update() that do not submit: the engine builds
        their canvases without K/V (the update reads them once, core/canvas.py: stack_rounds)."""
        return self.config.verify_updates and self._keeps(self._window_rounds + 1)

    def _keeps(self, window_round: int) -> bool:
        stride = self.config.update_stride
        return 0 < window_round % stride and window_round % stride > stride - self._rounds_per_update()

    def _rounds_per_update(self) -> int:
        """The rounds the next update trains on: min(W, S), fewer where that many rounds of the
        latest batch size would exceed the config's window_rows (the latest round always)."""
        held = rounds_held(self.config.window, self.config.window_rows, self._rows_per_round)
        return min(held, self.config.update_stride)

    def capture_buffers(self) -> CanvasBuffers:
        """Where the engine builds the next update's canvas (preallocated, reused by every update).
        A running update still reads them, so it is collected first (published at the next barrier)."""
        if self.executor.pending:
            self._absorb(self.executor.wait())
        return self._canvas_buffers

    def observe(self, canvas: Canvas | None, owned: bool = False) -> bool:
        """Count one verify round; every update_stride rounds submit an update on this canvas
        (None: the round produced no usable canvas, it still counts).

        owned: the canvas's tensors are the update's own (built outside inference mode, on this
        device, into capture_buffers() or fresh tensors nobody else writes): no private copy.
        Otherwise the update trains on a copy, as the serving path may reuse the canvas's buffers.

        Returns whether an update was submitted."""
        self.stats.rounds += 1
        self.stats.scope_rounds += 1
        if self.config.log_interval and self.stats.rounds % self.config.log_interval == 0:
            logger.info("TTS %s", self.stats.snapshot())
        if canvas is not None:
            self._rows_per_round = canvas.batch_size
        if self.config.verify_updates and canvas is not None and self._keeps(self._window_rounds):
            self._keep(canvas, owned)
            return False
        if not self.config.verify_updates or self._window_rounds % self.config.update_stride != 0 or canvas is None:
            return False
        if self.executor.pending:  # the caller skipped barrier(): collect, but publish only in barrier()
            self._absorb(self.executor.wait())
        private = canvas
        if not owned:
            # Outside inference mode, so a canvas of inference tensors becomes an autograd-usable copy.
            with torch.inference_mode(False), torch.no_grad():
                private = canvas.detach_clone()
                if private.input_ids.device != self.device:
                    private = private.to(self.device)
        if self._kept:
            earlier = self._rounds_per_update() - 1
            private = stack_rounds(self._kept[len(self._kept) - earlier :] if earlier > 0 else [], private)
            self._kept = []
        update_index, submitted_round = self._num_submitted, self.stats.rounds
        self._num_submitted += 1
        self.stats.update_rows_total += private.batch_size
        # What the engine credits (host list, and the rows' adapter slots): one entry per trained row.
        self.last_submitted_rows, self.last_submitted_slots = list(private.request_ids), private.slots
        exact = self._needs_rollback_copy(self.config.steps_per_update)
        self.executor.submit(lambda: self._update(private, update_index, submitted_round, exact))
        return True

    def _keep(self, canvas: Canvas, owned: bool) -> None:
        """Hold an earlier round's canvas for the stride's update: at most update_window - 1 of them,
        and at most window_rows (validated <= MAX_WINDOW_ROWS) rows in all with the round that submits (the
        oldest go first), so that what is kept (the target's logits at C positions per row) is
        bounded whatever the batch size: at 64 rows one request keeps up to 63 earlier rounds, a
        batch of 64 requests none."""
        if not owned:
            with torch.inference_mode(False), torch.no_grad():
                canvas = canvas.detach_clone().to(self.device)
        self._kept.append(canvas)
        del self._kept[: -max(1, self.config.window - 1)]
        while self._kept and sum(c.batch_size for c in self._kept) > self.config.window_rows - canvas.batch_size:
            del self._kept[0]

    def submit_prompt(self, batch: PromptBatch) -> bool:
        """Submit a prompt update (core/prompt.py): `prompt_steps` optimizer steps at `prompt_lr` on
        the prompt windows in `batch` (the update's own tensors, e.g. from collate_windows). It runs
        like any update -- in the executor, rolled back as a whole on failure -- and is published by
        the barrier on the same schedule (due before the round whose observe() submits the next
        update). A pending update is collected first. Returns whether it was submitted."""
        if not self.config.prompt_updates or batch.num_positions == 0:
            return False
        if self.executor.pending:
            self._absorb(self.executor.wait())
        update_index, submitted_round = self._num_submitted, self.stats.rounds
        self._num_submitted += 1
        self.executor.submit(lambda: self._update(batch, update_index, submitted_round, True))
        return True

    def _needs_rollback_copy(self, steps: int) -> bool:
        """Must the update copy the trained parameters and optimizer state before it starts? Not for
        one step of a shared drafter from the published weights: its checks run before the step,
        and a failure after it goes back to the published weights (module docstring). Per-request
        adapters always copy (they are small, and a fresh optimizer state would touch every request)."""
        return steps > 1 or self._unpublished or self._unit_names is not None

    def barrier(self, force: bool = False) -> bool:
        """Before each draft: if the pending update is due (or force), wait for it; publish the
        trained weights if they changed. Returns whether new weights were published."""
        if self.executor.pending and (force or self.update_due()):
            self._absorb(self.executor.wait())
        self.last_guard_resets = []
        if self._guard_resets and not self.executor.pending:
            self._apply_guard_resets()
        if not self._unpublished or self.executor.pending:
            # Pending: the worker is stepping the trained copy (a barrier before it was skipped and
            # its weights were collected elsewhere): they are published once it has finished.
            return False
        try:
            with self._phase("publish"):
                self._write_serving([p.detach() for p in self.train_params])
        except Exception as error:  # noqa: BLE001 - never half-new weights: put the old ones back
            self.stats.num_failed_publishes += 1
            try:
                self._write_serving(self._published)
                outcome = "the last published weights were restored; the next barrier publishes again"
            except Exception:  # noqa: BLE001
                outcome = "restoring the last published weights failed too; the next barrier tries again"
            logger.error("TTS publish failed (%r): %s", error, outcome)
            return False
        with torch.no_grad():
            torch._foreach_copy_(self._published, [p.detach() for p in self.train_params])
        self._unpublished = False
        self.stats.weight_version += 1
        return True

    def _write_serving(self, tensors: list[torch.Tensor]) -> None:
        """Write values of the trained parameters (in train_names order) into the serving copy."""
        with torch.inference_mode(False), torch.no_grad():
            if self.publisher is not None:
                # Every parameter by name, the untrained ones too (they no longer require grad, so
                # trainable_named_parameters() leaves them out): a fused binding needs all its parts.
                named = dict(self.trained_drafter.named_parameters())
                named.update(zip(self.train_names, tensors))
                self.publisher.publish(named)
            else:
                for dst, src in zip(self._serving_params, tensors):
                    dst.data.copy_(src)

    def update_due(self) -> bool:
        """Must the pending update be in the weights of the round about to be drafted?"""
        if self.executor.inline or self.config.update_stride == 1:
            return True
        # The coming round is the last of its stride window: its observe() submits the next update.
        return (self._window_rounds + 1) % self.config.update_stride == 0

    @property
    def _window_rounds(self) -> int:
        return self.stats.scope_rounds - self._window_start

    def set_update_stride(self, stride: int) -> None:
        """Change S between rounds (an adaptive-stride controller's action). A pending update is
        collected first (published at the next barrier), and the stride windows restart here, so
        the next update comes S rounds from now."""
        if not isinstance(stride, int) or stride < 1:
            raise ValueError(f"update stride must be an integer >= 1, got {stride!r}")
        if stride == self.config.update_stride:
            return
        if self.executor.pending:
            self._absorb(self.executor.wait())
        self.config.update_stride = stride
        self._window_start = self.stats.scope_rounds
        self._kept = []

    def reset(self) -> None:
        """Start a new scope: base weights (bitwise), fresh optimizer state, per-scope counters."""
        if self.executor.pending:
            self._absorb(self.executor.wait())
        with torch.no_grad():
            torch._foreach_copy_([p.detach() for p in self.train_params], self.base_weights)
        self.optimizer.state.clear()
        self.stats.scope_rounds = 0
        self._window_start = 0
        self._kept = []
        self.stats.scope_updates = 0
        self.stats.num_resets += 1
        self._unpublished = True
        self._guard_resets.clear()
        if self.guard is not None:
            self.guard.forget()
        self._strikes.clear()
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.lr
        self.barrier(force=True)

    def rebase(self, values: Mapping[str, torch.Tensor]) -> None:
        """New base weights: a retrained drafter that the engine loaded into its serving copy
        (sglang/weight_sync.py). `values` by name in trained_drafter.named_parameters() (trained and
        frozen parameters alike; names left out keep their base values). The update in flight is
        collected and discarded (it trained the old drafter); the trained copy and the base weights
        take `values`; then reset(): base weights, fresh optimizer state, the guard's scores and pending
        resets forgotten, per-scope counters, published (the serving copy already holds the values: the
        publish writes them again, and bumps weight_version).

        All or nothing for the weights: if it fails part-way, the base weights are put back, and the
        trained copy too (if reset() had begun: at the old base, with a fresh optimizer state); the
        next barrier publishes the trained copy again; then the error propagates."""
        if self.executor.pending:
            self._absorb(self.executor.wait())
        params = dict(self.trained_drafter.named_parameters())
        unknown = sorted(set(values) - set(params))
        if unknown:
            raise KeyError(f"the drafter has no parameters {unknown}")
        index = {id(p): i for i, p in enumerate(self.train_params)}
        targets = [params[name].detach() for name in values]
        based = [index[id(params[name])] for name in values if id(params[name]) in index]
        with torch.inference_mode(False), torch.no_grad():
            old_targets = [t.clone() for t in targets]
            old_base = [self.base_weights[i].clone() for i in based]
        resetting = False
        try:
            with torch.inference_mode(False), torch.no_grad():
                for target, value in zip(targets, values.values()):
                    target.copy_(value)
                for i in based:
                    self.base_weights[i].copy_(self.train_params[i])
            resetting = True
            self.reset()
        except Exception:
            with torch.inference_mode(False), torch.no_grad():
                torch._foreach_copy_(targets, old_targets)
                for i, old in zip(based, old_base):
                    self.base_weights[i].copy_(old)
                if resetting:  # reset() may have moved any trained weight: all back to the old base
                    torch._foreach_copy_([p.detach() for p in self.train_params], self.base_weights)
                    self.optimizer.state.clear()
            self._unpublished = True
            raise

    def republish(self) -> None:
        """Have the next barrier publish the trained copy again (the serving copy was written by
        someone else, e.g. a weight load that failed and could not be rolled back)."""
        self._unpublished = True

    def reset_parameters(self, names: list[str], unit: int | None = None) -> None:
        """Restore some trained parameters to their base values and forget their optimiser state
        (a per-request adapter slot being freed: `unit` is its slot, whose guard scores go too);
        published at the next barrier."""
        if self.executor.pending:
            self._absorb(self.executor.wait())
        if unit is not None:
            self._guard_resets.discard(unit)
            if self.guard is not None:
                self.guard.forget(unit)
            self._strike(unit, names, 0)
        with torch.no_grad():
            for name in names:
                i = self._index[name]
                self.train_params[i].copy_(self.base_weights[i])
                self.optimizer.state.pop(self.train_params[i], None)
        self._unpublished = True

    def close(self) -> None:
        """Finish (and account for) the pending update, then stop the executor; publishes nothing."""
        if self.executor.pending:
            self._absorb(self.executor.wait())
        self.executor.close()

    # --- the update (runs in the executor) ----------------------------------------------------

    def _update(
        self, data: Canvas | PromptBatch, update_index: int, submitted_round: int, exact: bool = True
    ) -> UpdateOutcome:
        """exact: take the rollback copy first (else a failure after the step goes back to the
        published weights with a fresh optimizer state; see _needs_rollback_copy)."""
        fault = self.fault_injector(update_index) if self.fault_injector is not None else None
        self._stepped = False
        if exact:
            with self._phase("rollback_copy"):
                self._rollback.save(self.optimizer)
        try:
            outcome = self._train_prompt(data, fault) if isinstance(data, PromptBatch) else self._train(data, fault)
        except Exception as exc:  # noqa: BLE001 - any failure becomes a skipped, rolled-back update
            outcome = UpdateOutcome("skipped", reason=f"{type(exc).__name__}: {exc}")
        if isinstance(data, PromptBatch):
            outcome.kind = "prompt"
            outcome.num_positions = data.num_positions
        if outcome.status == "skipped":
            if exact:
                self._rollback.restore(self.optimizer)
            elif self._stepped:
                self._back_to_published()
            else:  # failed before its step: nothing changed but the gradients
                self.optimizer.zero_grad(set_to_none=True)
        outcome.round = submitted_round
        outcome.update_index = update_index
        return outcome

    @torch.no_grad()
    def _back_to_published(self) -> None:
        """The trained copy at the last published weights, with a fresh optimizer state."""
        torch._foreach_copy_([p.detach() for p in self.train_params], self._published)
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.state.clear()

    def _phase(self, name: str) -> AbstractContextManager[None]:
        return self.timer.phase(name) if self.timer is not None else nullcontext()

    def _train(self, canvas: Canvas, fault: str | None) -> UpdateOutcome:
        drafter, cfg = self.trained_drafter, self.config
        with torch.no_grad(), self._phase("teacher"):
            teacher, teacher_mask = drafter.teacher_probs(canvas)
            mask = canvas.valid & teacher_mask
            if canvas.slots is not None:  # per-request adapters: rows without a slot train nothing
                mask = mask & (canvas.slots.to(mask.device) >= 0)[:, None]
            num_positions = int(mask.sum())
            if num_positions == 0:
                return UpdateOutcome("empty", reason="no position entered the loss")
            weights = self._position_weights(canvas.length)
            # With one step the regulariser's gradient is exactly zero (the step is taken at q = q_t).
            use_reg = cfg.reg_lambda > 0.0 and cfg.steps_per_update > 1
            prev_logits = drafter.canvas_logits(canvas) if use_reg else None

        reg_lambda = cfg.reg_lambda if use_reg else 0.0
        served: list[torch.Tensor] = []  # step 0's logits (or hidden) at the first position, for the guard

        def forward(step: int) -> tuple[torch.Tensor, float]:
            if getattr(drafter, "lm_head_per_row", False):  # per-request LM heads: nothing to fuse
                with self._phase("forward"):
                    logits = drafter.canvas_logits(canvas)
                if step == 0:
                    served.append(logits[:, :1].detach())
                with self._phase("loss"):
                    out = tts_loss(logits, teacher, weights, mask, prev_logits, reg_lambda)
            else:
                with self._phase("forward"):
                    hidden = drafter.canvas_hidden(canvas)
                if step == 0:
                    served.append(hidden[:, :1].detach())
                with self._phase("loss"):
                    head = drafter.lm_head_weight()
                    out = compute_loss(hidden, head, teacher, weights, mask, prev_logits, reg_lambda, cfg.loss_backend)
            return out.loss, float(out.kl_teacher) if step == 0 else math.nan

        ran = self._run_steps(cfg.steps_per_update, forward, fault)
        if isinstance(ran, UpdateOutcome):
            return ran
        first_loss, _, first_kl = ran
        outcome = UpdateOutcome(
            "ok", loss=first_loss, kl_teacher=first_kl, num_positions=num_positions, steps=cfg.steps_per_update
        )
        if self.guard is not None and served and self._scored_updates():
            with self._phase("guard"):
                self._score(canvas, served[0], teacher, mask, outcome)
        return outcome

    def _scored_updates(self) -> bool:
        """Does this update score for the guard? Every `guard_interval`th (worker thread; its own count)."""
        self._guard_tick += 1
        return self._guard_tick % self.config.guard_interval == 0

    @torch.no_grad()
    def _score(
        self, canvas: Canvas, served: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, outcome: UpdateOutcome
    ) -> None:
        """The guard's paired scores (core/guard.py) at the canvas's first position: whether the
        drafter's top token there is the target's, for the drafter that drafted this canvas (`served`:
        step 0's forward at that position, before any step) and for the base drafter, per canvas row
        with a unit. The first
        position only, because it decides whether a round gains anything, and because it keeps the
        base drafter's forward to one draft step (EAGLE-3) and the LM head to one read for both."""
        drafter = self.trained_drafter
        first = canvas.prefix(1)
        if getattr(drafter, "lm_head_per_row", False):
            adapted_logits, base_logits = served, self.base_drafter.canvas_logits(first)
        else:
            hidden = torch.cat((served, self.base_drafter.canvas_hidden(first)))  # [2B, 1, H]
            logits = hidden @ drafter.lm_head_weight().detach().t()
            adapted_logits, base_logits = logits.chunk(2)
        adapted = greedy_scores(adapted_logits, teacher[:, :1], mask[:, :1])
        base = greedy_scores(base_logits, teacher[:, :1], mask[:, :1])
        if canvas.slots is not None:
            units = canvas.slots.to(adapted.device)
            keep = units >= 0
            units, adapted, base = units[keep], adapted[keep], base[keep]
        else:
            units = torch.full_like(adapted, SCOPE_UNIT, dtype=torch.long)
        host = torch.stack((units.to(adapted.dtype), adapted, base)).tolist()  # one read, on the update's thread
        outcome.guard_units = [int(u) for u in host[0]]
        outcome.guard_adapted, outcome.guard_base = host[1], host[2]

    def _run_steps(
        self,
        steps: int,
        forward: Callable[[int], tuple[torch.Tensor, float] | None],
        fault: str | None,
        what: str = "",
        optimizer: torch.optim.Optimizer | None = None,
    ) -> tuple[float, float, float] | UpdateOutcome:
        """`steps` optimizer steps on forward(step) -> (loss, a value kept from step 0), with the fault
        injections, finite checks and clipping every update shares. Returns (the loss before the first
        step, before the last, step 0's value), or the outcome that ends the update early: skipped (the
        caller rolls back), or empty when forward returns None (nothing to train on). `optimizer`:
        default the updates' own."""
        optimizer = self.optimizer if optimizer is None else optimizer
        first = last = extra = math.nan
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            with torch.enable_grad(), deferred_weight_grads(self.trained_drafter, self._wgrad) as wgrad:
                out = forward(step)
                if out is None:
                    return UpdateOutcome("empty", reason=f"no {what}position carries a label")
                loss, value = out
                if fault == "nan" and step == steps - 1:
                    loss = loss * math.nan
                last = float(loss.detach())
                if not math.isfinite(last):
                    return UpdateOutcome("skipped", reason=f"non-finite {what}loss at step {step}")
                with self._phase("backward"):
                    loss.backward()
                    wgrad.flush()  # the unroll's weight gradients, one matmul per weight (drafters/wgrad.py)
            if step == 0:
                first, extra = last, value
                if fault == "inf_grad":
                    next(p for p in self.train_params if p.grad is not None).grad.view(-1)[0] = math.inf
            with self._phase("clip"):
                grad_norm = self._clip_gradients()
            if not math.isfinite(grad_norm):
                return UpdateOutcome("skipped", reason=f"non-finite {what}gradient at step {step}")
            self._stepped = True
            with self._phase("optimizer"):
                optimizer.step()
            if fault == "raise" and step == 0:
                raise RuntimeError("injected fault after the optimizer step")
        optimizer.zero_grad(set_to_none=True)
        with self._phase("finite_check"):
            finite = self._weights_finite(fault)
        if not finite:
            return UpdateOutcome("skipped", reason=f"non-finite weights after the {what}step")
        return first, last, extra

    def _select_prompt_params(self) -> list[int]:
        """config.prompt_trainable -> indices into train_params (see TTSConfig.prompt_trainable)."""
        layer_of = getattr(self.trained_drafter, "adapted_layer_of", lambda name: name)
        layers = [layer_of(n) for n in self.train_names]
        prefixes = self.config.prompt_trainable
        if prefixes is None:
            picked = [i for i, layer in enumerate(layers) if layer == "fc" or layer.startswith("fc.")]
            return picked or list(range(len(layers)))
        picked = [i for i, layer in enumerate(layers) if any(layer.startswith(p) for p in prefixes)]
        if not picked:
            raise TTSConfigError(
                f"--tts-prompt-trainable {','.join(prefixes)} selects none of the trained parameters "
                f"(layers: {sorted(set(layers))})"
            )
        return picked

    def _train_prompt(self, batch: PromptBatch, fault: str | None) -> UpdateOutcome:
        """`prompt_steps` steps of the drafter's own objective on prompt windows, at `prompt_lr`,
        moving only the prompt-trainable parameters (the others take no gradient meanwhile: the
        trained copy is the update's own)."""
        drafter, cfg = self.trained_drafter, self.config
        head_delta = drafter.prompt_head_delta(batch) if hasattr(drafter, "prompt_head_delta") else None
        moved = set(self._prompt_params)
        # Their own optimizer, fresh per prompt update: Adam's second moment decays over ~1,000 steps, so
        # moments shared with the verify updates would carry the prompt loss's larger gradients into
        # them and damp their steps on these parameters for hundreds of rounds.
        optimizer = self._make_optimizer([p for i, p in enumerate(self.train_params) if i in moved], cfg.prompt_step_lr)
        held = [p for i, p in enumerate(self.train_params) if i not in moved]
        for p in held:
            p.requires_grad_(False)
        try:

            def forward(step: int) -> tuple[torch.Tensor, float] | None:
                terms = drafter.prompt_terms(batch, cfg.prompt_depth)
                if terms.labels.numel() == 0:
                    return None  # no prompt position carries a label
                return prompt_loss(terms, drafter.lm_head_weight(), head_delta), math.nan

            ran = self._run_steps(cfg.prompt_steps, forward, fault, "prompt ", optimizer)
        finally:
            for p in held:
                p.requires_grad_(True)
        if isinstance(ran, UpdateOutcome):
            return ran
        first_loss, last_loss, _ = ran
        return UpdateOutcome("ok", loss=first_loss, last_loss=last_loss, steps=cfg.prompt_steps)

    def _weights_finite(self, fault: str | None) -> bool:
        with torch.no_grad():
            if fault == "nan_weights":
                self.train_params[-1].view(-1)[0] = math.nan
            # One norm over all trained tensors (foreach): NaN or Inf anywhere makes it non-finite, as
            # does a weight so large its square overflows (a broken drafter either way). A tenth of
            # the cost of isfinite(p).all() per tensor on CPU (1.6 vs 15-25 ms for 10M weights).
            return bool(torch.isfinite(torch.nn.utils.get_total_norm(self.train_params)))

    def _clip_gradients(self) -> float:
        """Clip (per isolation group: per request with adapters, so requests never scale each
        other's steps); returns the total norm for the finiteness check."""
        groups, norms = [], []
        for group in self._clip_groups:
            grads = [self.train_params[i].grad for i in group if self.train_params[i].grad is not None]
            if grads:
                groups.append(grads)
                norms.append(torch.nn.utils.get_total_norm(grads))
        if not norms:
            return 0.0
        host = torch.stack(norms).tolist()  # one read, which the finiteness check needs anyway
        limit = self.config.max_grad_norm
        if limit is not None:
            # Scale only the groups over the limit (clip_grad_norm_ multiplies every gradient, by 1.0 when
            # under it: a read and a write of every gradient, ~3 ms per update for the Qwen drafter on CPU).
            for grads, norm in zip(groups, host):
                if math.isfinite(norm) and norm > limit:
                    torch._foreach_mul_(grads, limit / (norm + 1e-6))
        return math.sqrt(sum(n * n for n in host))

    def _position_weights(self, length: int) -> torch.Tensor:
        """config.position_weights (cut to, or zero-padded to, the canvas length), else the drafter's."""
        if length not in self._weights_cache:
            if self.config.position_weights is not None:
                given = torch.tensor(self.config.position_weights[:length], dtype=torch.float32)
                weights = torch.zeros(length)
                weights[: given.numel()] = given
            else:
                weights = self.trained_drafter.default_position_weights(length)
            self._weights_cache[length] = weights.to(self.device, torch.float32)
        return self._weights_cache[length]

    def _make_optimizer(
        self,
        params: list[nn.Parameter] | None = None,
        lr: float | None = None,
        groups: list[list[int]] | None = None,
    ) -> torch.optim.Optimizer:
        """config.optimizer over `params` (default: every trained parameter) at `lr` (default config.lr);
        `groups`: indices into train_params, one param group each (instead of `params`)."""
        cfg = self.config
        params = self.train_params if params is None else params
        if groups is not None:
            params = [{"params": [self.train_params[i] for i in group]} for group in groups]
        lr = cfg.lr if lr is None else lr
        if cfg.optimizer == "sgd":
            return torch.optim.SGD(params, lr=lr, weight_decay=cfg.weight_decay)
        cls = torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.AdamW
        # The fused (single-kernel) Adam: on CPU 4.6 ms per step for 10M weights against 28.8 ms for
        # the default per-tensor loop (torch uses foreach/fused by default only on CUDA).
        fused = True if self.device.type in ("cuda", "cpu") else None
        return cls(params, lr=lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay, fused=fused)

    # --- bookkeeping (serving thread) ---------------------------------------------------------

    def _absorb(self, result: UpdateResult | None) -> None:
        """Fold a finished update into stats; mark its weights for publication if it was kept."""
        if result is None:
            return
        stats, timing = self.stats, result.timing
        if not (isinstance(result.value, UpdateOutcome) and result.value.kind == "prompt"):
            stats.update_ms_last = timing.run_s * 1e3
            stats.update_ms_total += timing.run_s * 1e3
        stats.wait_ms_total += timing.wait_blocked_s * 1e3
        stats.hidden_ms_total += timing.hidden_s * 1e3
        if result.error is not None:  # the rollback itself failed: back to the published weights
            stats.num_skipped_updates += 1
            with torch.no_grad():
                torch._foreach_copy_([p.detach() for p in self.train_params], self._published)
            self.optimizer.state.clear()
            self._unpublished = False
            logger.error(
                "TTS update failed outside its rollback (%r): the trained copy is back at the published "
                "weights, with a fresh optimizer state",
                result.error,
            )
            return
        outcome: UpdateOutcome = result.value
        if outcome.kind == "prompt":
            self._absorb_prompt(outcome, timing.run_s)
            return
        if outcome.status == "ok":
            stats.num_updates += 1
            stats.scope_updates += 1
            stats.last_loss = outcome.loss
            stats.last_kl_teacher = outcome.kl_teacher
            stats.last_update_round = outcome.round
            self._unpublished = True
            if self.guard is not None and outcome.guard_units:
                verdict = self.guard.observe(outcome.guard_units, outcome.guard_adapted, outcome.guard_base)
                self._guard_resets.update(verdict.reset_units)
                gain = self.guard.gain()
                stats.guard_gain = math.nan if gain is None else gain
                bound = self.guard.gain_bound()
                stats.guard_gain_bound = math.nan if bound is None else bound
        elif outcome.status == "skipped":
            stats.num_skipped_updates += 1
            logger.warning("TTS update %d skipped and rolled back: %s", outcome.update_index, outcome.reason)
        else:
            stats.num_empty_updates += 1
        if self.on_update_done is not None:
            self.on_update_done(result)

    def _apply_guard_resets(self) -> None:
        """Reset the units the guard found worse than base (serving thread, nothing in flight)."""
        units, self._guard_resets = sorted(self._guard_resets), set()
        for unit in units:
            strikes = self._strikes.get(unit, 0) + 1
            if unit == SCOPE_UNIT:
                names = self.train_names
                with torch.no_grad():
                    torch._foreach_copy_([p.detach() for p in self.train_params], self.base_weights)
                self.optimizer.state.clear()
            elif self._unit_names is not None:
                names = self._unit_names(unit)
                self.reset_parameters(names, unit=unit)
            else:
                continue
            lr = self._strike(unit, names, strikes)
            self._unpublished = True
            self.stats.num_guard_resets += 1
            self.last_guard_resets.append(unit)
            what = "the shared drafter" if unit == SCOPE_UNIT else f"adapter slot {unit}"
            logger.warning(
                "TTS do-no-harm guard: %s drafted worse than the base drafter over its last %d updates; "
                "reset to base, learning rate now %.3g",
                what,
                self.guard.window if self.guard is not None else 0,
                lr,
            )

    def _strike(self, unit: int, names: list[str], strikes: int) -> float:
        """Set `unit`'s guard resets so far (0: its life ended, or it never had one) and its learning
        rate, config.lr x guard_backoff ** strikes, on the param groups of its parameters `names`."""
        if strikes:
            self._strikes[unit] = strikes
        else:
            self._strikes.pop(unit, None)
        lr = self.config.lr * self.config.guard_backoff**strikes
        for g in {self._group_of[self._index[n]] for n in names if n in self._index}:
            self.optimizer.param_groups[g]["lr"] = lr
        return lr

    def _absorb_prompt(self, outcome: UpdateOutcome, run_s: float) -> None:
        stats = self.stats
        stats.prompt_ms_total += run_s * 1e3
        if outcome.status == "ok":
            stats.num_prompt_updates += 1
            stats.prompt_positions_total += outcome.num_positions
            stats.prompt_steps_total += outcome.steps
            stats.last_prompt_loss = outcome.loss
            stats.last_prompt_loss_after = outcome.last_loss
            self._unpublished = True
        elif outcome.status == "skipped":
            stats.num_skipped_updates += 1
            stats.num_skipped_prompt_updates += 1
            logger.warning("TTS prompt update %d skipped and rolled back: %s", outcome.update_index, outcome.reason)
        else:
            stats.num_empty_updates += 1
