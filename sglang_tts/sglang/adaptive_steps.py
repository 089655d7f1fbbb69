"""`--tts-controller PATH`: the draft/stride controller on SGLang's adaptive speculative machinery.

SGLang 0.5.23's `--speculative-adaptive` (EAGLEWorkerV2, topk 1) pre-builds one runtime state per
candidate chain length (attention backends, CUDA graphs on GPU) and swaps whole states between
batches; its AdaptiveController asks a policy object which chain length to run
(`get_steps_for_batch` before each decode batch, `on_verify_complete` after each verify, from the
scheduler once accept lengths are on CPU). TTS uses that machinery as is:

- at launch (`prepare_launch`, from the TTS validate_server_args): load and check the policy file,
  then turn on `speculative_adaptive` with a generated adaptive config whose candidate steps are
  the policy's chain lengths (so SGLang builds exactly those states and sizes its buffers for the
  longest);
- SGLang's `adaptive_unsupported_reason` accepts only EAGLE/EAGLE3 by name: a hook
  (`adaptive_reason_hook`, registered by algorithm.py) evaluates it for TTS as for EAGLE3 (all its
  other conditions still apply);
- in the worker, `ControlledSteps` replaces the adaptive policy: it turns each verify into an
  Observation (round time measured between verify completions, TTS time on the serving path, TTS
  loss, output position), feeds the Controller, and applies the chosen action: the chain length
  through SGLang's state switch, the update stride through `Distiller.set_update_stride`, and
  (a policy with the proposer axis, `--tts-hybrid on`) who drafts through `HybridDrafting.set_mode`;
  the hybrid's offers of the round (sglang/hybrid.py RoundOffer) go into the Observation.

Decisions depend on measured time, so they could differ between tensor-parallel ranks: the
controller runs with one rank only (tp = pp = 1, no attention DP).
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sglang_tts.control.actions import Action, uses_suffix
from sglang_tts.control.controller import Controller
from sglang_tts.control.observation import Observation
from sglang_tts.control.policy_file import PolicyBundle, PolicyFileError, load_policy
from sglang_tts.sglang.failures import FailureLog

logger = logging.getLogger(__name__)

ADAPTIVE_REASON_TARGET = "sglang.srt.speculative.adaptive_spec_params.adaptive_unsupported_reason"


def prepare_launch(server_args, config, kind: str, error: type[Exception]) -> PolicyBundle:
    """Check the controller's preconditions and set the server args SGLang's adaptive machinery
    needs (see the module docstring). Raises `error` with a message naming the problem."""
    if kind != "eagle3":
        raise error(f"--tts-controller needs an EAGLE-3 drafter (chain drafting); this drafter is {kind}")
    try:
        bundle = load_policy(config.controller)
    except PolicyFileError as e:
        raise error(f"--tts-controller: {e}") from None
    candidates = sorted({a.num_steps for a in bundle.actions})
    if uses_suffix(bundle.actions) and not config.hybrid:
        raise error(
            f"--tts-controller {config.controller} chooses the proposer (hybrid / suffix actions): "
            "it needs --tts-hybrid on"
        )

    def arg(name):
        return getattr(server_args, name, None)

    topk = arg("speculative_eagle_topk")
    if topk not in (None, 1):
        raise error(f"--tts-controller switches draft chains: it needs --speculative-eagle-topk 1, got {topk}")
    for name in ("tp_size", "pp_size", "dp_size"):
        if (arg(name) or 1) > 1:
            raise error(
                f"--tts-controller runs on a single rank (its decisions use measured time); got {name}={arg(name)}"
            )
    if arg("enable_dp_attention"):
        raise error("--tts-controller does not support --enable-dp-attention")
    if arg("speculative_adaptive_config"):
        raise error("--tts-controller writes SGLang's adaptive config itself; drop --speculative-adaptive-config")
    steps = arg("speculative_num_steps")
    if steps is None:
        initial = bundle.config.initial_action
        steps = initial.num_steps if initial is not None else candidates[len(candidates) // 2]
    if steps not in candidates:
        raise error(
            f"--speculative-num-steps {steps} is not a chain length of the policy in {config.controller} "
            f"(its actions: {', '.join(str(a) for a in bundle.actions)}); pass one of {candidates} or omit it"
        )
    draft_tokens = arg("speculative_num_draft_tokens")
    if draft_tokens is not None and draft_tokens != steps + 1:
        raise error(
            f"--tts-controller drafts chains: --speculative-num-draft-tokens must be steps + 1 = {steps + 1}, "
            f"got {draft_tokens} (or omit it)"
        )
    config_dir = Path(tempfile.mkdtemp(prefix="sglang-tts-controller-"))
    adaptive_config = config_dir / "adaptive.json"
    adaptive_config.write_text(json.dumps({"1": {"candidate_steps": candidates}}))
    server_args.speculative_adaptive = True
    server_args.speculative_adaptive_config = str(adaptive_config)
    server_args.speculative_eagle_topk = 1
    server_args.speculative_num_steps = steps
    server_args.speculative_num_draft_tokens = steps + 1
    logger.info(
        "sglang-tts: controller %s (%s, %d actions: %s)",
        config.controller,
        getattr(bundle.policy, "kind", "?"),
        len(bundle.actions),
        ", ".join(str(a) for a in bundle.actions),
    )
    return bundle


class _AsBuiltin:
    """server_args as SGLang's adaptive check should see them for TTS: the builtin's name."""

    def __init__(self, server_args, name: str) -> None:
        object.__setattr__(self, "_args", server_args)
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr: str) -> Any:
        args = object.__getattribute__(self, "_args")
        if attr == "speculative_algorithm":
            return object.__getattribute__(self, "_name")
        if attr == "_resolved_overrides":
            return [
                (source, {k: v for k, v in declared.items() if k != "speculative_algorithm"})
                for source, declared in (getattr(args, "_resolved_overrides", None) or ())
            ]
        return getattr(args, attr)


def adaptive_reason_hook(algorithm_name: str, builtin_name: Callable[[], str]):
    """AROUND hook for SGLang's adaptive support check: run it for `algorithm_name` as for the
    builtin that algorithm delegates to (`builtin_name()`, asked per call: the drafter kind is
    known only at launch). The names come from the caller, so this module never imports algorithm.py."""

    def hook(original, server_args, *args, **kwargs):
        from sglang.srt.arg_groups.overrides import resolving_view

        if resolving_view(server_args).speculative_algorithm == algorithm_name:
            server_args = _AsBuiltin(server_args, builtin_name())
        return original(server_args, *args, **kwargs)

    return hook


class ControlledSteps:
    """SGLang's AdaptiveSpecPolicy, answered by a Controller (see the module docstring).

    The worker calls `round_done(...)` after each decode forward and `forward_started()` before
    every forward; SGLang calls `on_verify_complete` once per decode batch, in order."""

    def __init__(self, controller: Controller, set_stride, trace_path: str | None = None) -> None:
        self.controller = controller
        # Served decisions go to the trace file as they are made: memory keeps only the latest.
        controller.keep_trace(1 if trace_path else 0)
        self._set_stride = set_stride
        # Who drafts (HybridDrafting.set_mode): set by the worker when the hybrid is on and the policy
        # has the proposer axis; otherwise the proposer field is not applied.
        self.set_proposer: Callable[[str], None] | None = None
        self._cuda_graph_bs: list[int] | None = None
        self._rounds: deque[dict[str, Any]] = deque(maxlen=8)
        self._forward_seq = 0
        self._last_complete: tuple[float, int] | None = None  # (time, forward seq) of the last verify
        self.switches = 0
        self.trace_path = trace_path
        # A controller that fails keeps the current action (the worker passes its runtime's log).
        self.failures = FailureLog()
        if trace_path:
            path = Path(trace_path)
            if not path.exists() or path.stat().st_size == 0:
                path.write_text(json.dumps(controller.trace_header()) + "\n")
        set_stride(controller.current.update_stride)

    # --- SGLang's AdaptiveSpecPolicy ----------------------------------------------------------

    @property
    def candidate_steps(self) -> list[int]:
        return sorted({a.num_steps for a in self.controller.policy.actions})

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
        self._cuda_graph_bs = sorted(cuda_graph_bs) if cuda_graph_bs else None

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        return self._cuda_graph_bs  # every chain length can run at every batch size

    def get_steps_for_batch(self, batch_size: int) -> int:
        return self.controller.current.num_steps

    def on_verify_complete(self, num_correct_drafts_per_req: list[int], batch_size: int) -> int | None:
        """SGLang asks for the next chain length (None: keep it); a failure keeps it too."""
        with self.failures.absorb("controller"):
            return self._decide(num_correct_drafts_per_req, batch_size)
        return None

    def _decide(self, num_correct_drafts_per_req: list[int], batch_size: int) -> int | None:
        if not num_correct_drafts_per_req or batch_size <= 0:
            return None
        now = time.perf_counter()
        info = self._rounds.popleft() if self._rounds else {}
        seq = info.get("seq")
        if self._last_complete is not None and seq is not None and seq == self._last_complete[1] + 1:
            seconds = now - self._last_complete[0]  # the whole round, scheduler included
        else:
            seconds = info.get("forward_seconds", 0.0)  # first round after a prefill (or unknown)
        self._last_complete = (now, seq if seq is not None else -10)
        obs = Observation(
            accept_lengths=[int(n) + 1 for n in num_correct_drafts_per_req],
            num_steps=int(info.get("num_steps", self.controller.current.num_steps)),
            batch_size=int(batch_size),
            output_position=float(info.get("output_position", 0.0)),
            round_seconds=float(seconds),
            update_seconds=float(info.get("tts_seconds", 0.0)),
            tts_loss=info.get("tts_loss"),
            suffix_offered=info.get("suffix_offered"),
            suffix_expected=info.get("suffix_expected"),
        )
        before = self.controller.current
        action = self.controller.observe(obs)
        if action is None:
            return None
        self._write_trace_record()
        if action != before:
            self.switches += 1
            logger.info("sglang-tts: controller %s -> %s", before, action)
        self._set_stride(action.update_stride)
        self.apply_proposer()
        return action.num_steps

    def apply_proposer(self) -> None:
        """Hand the current action's proposer to the hybrid (a policy without the axis: nothing)."""
        if self.set_proposer is not None and uses_suffix(self.controller.policy.actions):
            self.set_proposer(self.controller.current.proposer)

    # --- fed by the worker ----------------------------------------------------------------------

    def forward_started(self) -> None:
        self._forward_seq += 1

    def round_done(
        self,
        num_steps: int,
        forward_seconds: float,
        tts_seconds: float,
        output_position: float,
        tts_loss: float | None,
        suffix_offered: float | None = None,
        suffix_expected: float | None = None,
    ) -> None:
        self._rounds.append(
            {
                "seq": self._forward_seq,
                "num_steps": num_steps,
                "forward_seconds": forward_seconds,
                "tts_seconds": tts_seconds,
                "output_position": output_position,
                "tts_loss": tts_loss,
                "suffix_offered": suffix_offered,
                "suffix_expected": suffix_expected,
            }
        )

    @property
    def current(self) -> Action:
        return self.controller.current

    def _write_trace_record(self) -> None:
        if not self.trace_path or not self.controller.trace:
            return
        try:
            with open(self.trace_path, "a") as f:
                f.write(json.dumps({"type": "decision", **self.controller.trace[-1]}) + "\n")
        except OSError:
            logger.exception("sglang-tts: cannot append to the controller trace %s", self.trace_path)
