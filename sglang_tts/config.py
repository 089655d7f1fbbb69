"""TTSConfig: every knob of Test-Time Speculation, with validation that runs at launch."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Literal

Scope = Literal["batch", "request", "group", "global"]
SCOPES = ("batch", "request", "group", "global")
ADAPTER_SCOPES = ("request", "group")  # the scopes served by per-request / per-group adapters (core/adapters.py)
LossBackend = Literal["auto", "naive", "chunked", "triton"]
PromptAdapt = Literal["off", "on", "only"]
PROMPT_ADAPT_MODES = ("off", "on", "only")
MAX_UPDATE_WINDOW = 64  # rounds one update may train on (canvases kept meanwhile: bounded)
MAX_WINDOW_ROWS = 64  # rows one update may train on (a round of a batch of B requests brings B rows)
# The window an EAGLE-3 server uses when --tts-update-window is not given: every round of the stride,
# up to DEFAULT_WINDOW_ROWS rows (docs/update-cost.md: a window gains per update what S=2 gains at a
# fraction of its time; one request at a time the whole stride gains more than its last 8 rounds).
DEFAULT_UPDATE_WINDOW = MAX_UPDATE_WINDOW
DEFAULT_WINDOW_ROWS = 32
PROMPT_LR_FACTOR = 3.0  # default prompt_lr / the update's learning rate (see TTSConfig.prompt_lr)
FULL_RANK = "full"  # --tts-adapter-rank full: a dense per-request delta instead of a low-rank one


def rounds_held(window: int, window_rows: int, batch_size: int) -> int:
    """The rounds one update trains on at most at a batch of `batch_size`, whatever the stride:
    min(window, window_rows // B), at least the latest round (TTSConfig.window and window_rows)."""
    return min(window, max(1, window_rows // max(1, batch_size)))


class TTSConfigError(ValueError):
    """A bad TTS setting; raised at launch, never mid-serving."""


@dataclass
class TTSConfig:
    # One gradient step every `update_stride` verify rounds, on the latest round's canvas only
    # (paper, appendix C.1). 5 keeps about 2/3 of the S=1 gain at a fraction of the cost.
    update_stride: int = 5
    # Set when --tts-update-stride is given: the stride stays where it is put. Otherwise the update
    # budget (core/budget.py) moves it within [min_stride, max_stride], starting at update_stride.
    stride_pinned: bool = False
    # An update trains on the canvases of the last min(update_window, S) rounds of its stride, in one
    # batch and one optimizer step (the earlier rounds' canvases are kept until then; their K/V are
    # read once, at the update). 1: the latest round only (the paper, appendix C.1). None (auto):
    # DEFAULT_UPDATE_WINDOW (every round of the stride) in at most DEFAULT_WINDOW_ROWS rows where the
    # canvases of a stride can be stacked (an EAGLE-3 server: with_default_window), else 1; `window`
    # is the value the core uses.
    update_window: int | None = None
    # Rows an update trains on at most: the window shrinks to window_rows // B rounds at a batch of B
    # (at least the latest round). Not a flag: an auto window sets DEFAULT_WINDOW_ROWS.
    window_rows: int = MAX_WINDOW_ROWS
    # Share of serving time the updates may take; None ("auto"): the do-no-harm guard's measured
    # acceptance gain g, as g / (1 + g) (so that TTS is not slower than the frozen drafter), times the scale below.
    update_budget: float | None = None
    # Multiplies the auto budget (warm-up included): 1 spends the whole measured gain on updates
    # (tokens/s at frozen's at the margin), K < 1 keeps (1 - K) of it as speed. 0.5 by measurement
    # (docs/update-cost.md). No effect with a fixed --tts-update-budget.
    update_budget_scale: float = 0.5
    min_stride: int = 1
    max_stride: int = 32
    # Do no harm (core/guard.py): score the adapted drafter against the base drafter on each update's
    # canvas; reset a unit (shared drafter / request adapter) that is worse over `guard_window` updates
    # by more than `guard_margin` (relative) and by more than two standard errors of the paired scores.
    guard: bool = True
    guard_window: int = 16
    guard_margin: float = 0.02
    # Score every Nth update only: a DFlash drafter's score reads the target's whole LM head (30 ms on
    # SmolLM2, 100 ms on Qwen2.5-0.5B on CPU, docs/update-cost.md); EAGLE-3's draft head is small.
    guard_interval: int = 1
    # After the guard resets a unit, the unit trains at `guard_backoff` x its learning rate, compounding
    # per reset, until the unit's life ends (a request's adapter: the request; the shared drafter: its
    # scope): a drafter that made itself worse than base once would do it again at the same rate.
    guard_backoff: float = 0.1
    # 3e-5..1e-4 helped in the small-scale check; 3e-4 and above hurt (notes/premise-test).
    lr: float = 1e-4
    # lambda of the KL(q_t || q) regulariser; 0 disables it (saves one no-grad drafter forward).
    reg_lambda: float = 0.1
    steps_per_update: int = 1
    # "batch": one drafter, full-parameter updates, shared by the running batch and reset to base when
    #   every request running at the last reset has finished (core/scope.py: generations; batch size 1:
    #   the paper's per-request reset).
    # "request": each request adapts its own low-rank adapter (core/adapters.py), at any batch size.
    # "group": requests that share a prompt (RL rollouts' n samples, the same prompt sent again, or a
    #   client's custom_params {"tts_group": ID}) share one adapter, freed when the last of them leaves.
    # "global": one drafter, never reset.
    scope: Scope = "batch"
    # Per-request adapters (scope "request"): rank r and alpha (delta = alpha / r * B A), the
    # learning rate of the adapters (LoRA's usual ~10x the full-parameter rate; not yet tuned on the
    # default model), and how many requests may hold an adapter at once (others: frozen drafter).
    adapter_rank: int | Literal["full"] = 8  # "full": a dense per-request delta, trained at `lr`
    adapter_alpha: float = 16.0
    adapter_lr: float = 1e-3
    # EAGLE-3 adapters also adapt the layers that write the context's K/V (fc, k_proj, v_proj). Off: the
    # K/V in SGLang's draft pool stay the base drafter's, so the do-no-harm guard's base score reads its
    # own context (on, an adapter that breaks corrupts the K/V the base is scored on, and the guard goes
    # blind: docs/update-cost.md, "The guard and the draft KV cache").
    adapter_kv: bool = False
    max_adapted_requests: int = 16
    # Run the update on the main stream / serving thread, for comparison with the async executor.
    sync: bool = False
    # On CPU, run updates on a worker thread (the side stream's CPU twin) instead of inline between rounds.
    # Off: on the 2-core machine the worker's OpenMP threads slowed every round (docs/update-cost.md).
    cpu_thread: bool = False
    # Same code path, no updates: the frozen baseline.
    freeze: bool = False
    optimizer: Literal["adam", "adamw", "sgd"] = "adam"
    adam_betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    # Clip the update's gradient norm; None disables clipping.
    max_grad_norm: float | None = 1.0
    # Comma-separated per-position weights w_1..w_C; None: the drafter's training recipe.
    position_weights: tuple[float, ...] | None = None
    # Name prefixes of drafter parameters to train; None: all trainable drafter parameters.
    trainable: tuple[str, ...] | None = None
    loss_backend: LossBackend = "auto"
    # Canvas positions the loss uses. "accepted": the accepted path plus the next position (whose
    # target distribution the first rejected draft should have matched); positions after a rejection
    # are conditioned on a rejected token, and training on them slowed adaptation down badly in our
    # replay of served canvases (docs/results.md). "full": every drafted position of a chain (paper's sum).
    canvas: Literal["accepted", "full"] = "accepted"
    # The target's logits a canvas keeps. "draft": only at the drafter's own ids (EAGLE-3's reduced
    # draft vocabulary: 8,192 of the Qwen testbed's 151,936), what the loss reads; "full": every id
    # (the canvases kept for a stride's update, and their stacking, 18.5x larger on the testbed).
    canvas_vocab: Literal["draft", "full"] = "draft"
    # Prompt-time adaptation (core/prompt.py): after a request's prefill, train the drafter on its
    # prompt (the drafter's inputs at the last `prompt_positions` prompt positions, next prompt
    # tokens as labels) before and while its first rounds decode. "on": then TTS as usual; "only":
    # no verify-round updates (prompt adaptation alone); "off": never (the default until it has
    # proved itself on the long-context workload, docs/prompt-adaptation.md).
    prompt_adapt: PromptAdapt = "off"
    prompt_positions: int = 512
    # Prompts whose prefill computed fewer positions than this are not learned: a short prompt (a
    # question, a one-line instruction) teaches little and the step still moves the drafter: on short
    # reasoning prompts prompt adaptation cost 2% of acceptance (docs/prompt-adaptation.md).
    prompt_min_positions: int = 256
    prompt_steps: int = 4  # optimizer steps per prompt update
    # Adam learning rate of those steps; None: 3x the rate the trained parameters update at (`lr`, or
    # `adapter_lr` for per-request low-rank adapters), i.e. 3e-4 and 3e-3 by default.
    prompt_lr: float | None = None
    # EAGLE-3: draft steps of the training-time-test unroll over the prompt (row t predicts t+2..t+1+depth);
    # DFlash: block slots trained per anchor (at most block_size - 1).
    prompt_depth: int = 3
    # Name prefixes of the trained parameters the prompt steps move (with per-request adapters: of
    # the adapted layers). None: the feature projection `fc` where it is trained, else all of them.
    # Offline on the long-context workload, training everything on the prompt hurt the answer
    # (the drafter was trained on answer positions only; prompt positions are another regime), while
    # `fc` alone helped (docs/prompt-adaptation.md). ("",): every trained parameter.
    prompt_trainable: tuple[str, ...] | None = None
    # Log a summary line every this many rounds (0: never).
    log_interval: int = 50
    # Record per-round accepted lengths for requests that ask for them (meta_info).
    record_accept_lengths: bool = True
    # Honour a request's custom_params.tts_return_weight_digest (sha256 of the serving drafter at the
    # request's first and last round). Hashing the drafter costs a full read of its weights whenever
    # they change (every update), so a client could make every round of every request pay for it:
    # off unless the operator turns it on (tests, audits).
    allow_weight_digest: bool = False
    # RL weight sync (sglang/weight_sync.py): what the adapted drafter(s) do when the target's weights
    # change through SGLang's weight-update endpoints. "reset": back to base (fresh optimizer state)
    # before the next round: what was adapted fitted the old policy, and every policy starts from the
    # same drafter. "keep": adapt on from where they are (the policy moves little per RL step).
    on_target_update: Literal["keep", "reset"] = "reset"
    # RL controller (sglang_tts/control): a policy file that picks the draft chain length and the
    # update stride every few rounds; None keeps the fixed flags. EAGLE-3 chains (topk 1) only.
    controller: str | None = None
    # Keep learning online from the served rounds (otherwise the policy only acts greedily).
    controller_learn: bool = False
    # Append the controller's (state, action, reward) records to this JSONL file (offline training).
    controller_trace: str | None = None
    # Hybrid drafting (core/hybrid.py, sglang/hybrid.py; EAGLE-3 chains): per request and round, verify
    # a suffix chain from SGLang's NGRAM corpus (prompt, output, other live requests) instead of the
    # drafter's when it is at least `hybrid_min_match` tokens (0: the whole chain) and its expected
    # accepted tokens on this request are at least the drafter's minus `hybrid_margin`.
    hybrid: bool = False
    hybrid_min_match: int = 0
    hybrid_margin: float = 0.0
    # The suffix side of that comparison: the suffix proposer's moving "average" of accepted tokens on
    # the request, or the "chain" at hand's score (how often the request's own context continued its
    # deepest matching suffix with the chain's tokens).
    hybrid_score: Literal["average", "chain"] = "average"
    # Weigh measured round costs: when the whole batch on suffix chains (the drafter's steps skipped)
    # yields more expected tokens per second than the rule's choice, every request takes its chain.
    hybrid_cost: bool = False
    # What the drafter trains on: "all" verified rounds (the target teaches whoever proposed), or only
    # the "drafter"'s own rounds (the spans the suffix proposer drafts are left out).
    hybrid_train: Literal["all", "drafter"] = "all"
    # An update is due at the end of a stride in which the learned drafter drafted none of the
    # request-rounds (the suffix proposer drafted them all): "skip" it (its gain would pay only on
    # rounds the drafter drafts), or "run" it as any other.
    hybrid_idle_updates: Literal["skip", "run"] = "skip"
    # Retire a request's drafter (suffix chains only for the rest of the request; no drafter steps,
    # draft-extend or canvases for it) once it has drafted `hybrid_retire_after` of its rounds at fewer
    # than `hybrid_retire_below` accepted tokens per round (0: never).
    hybrid_retire_below: float = 0.0
    hybrid_retire_after: int = 32

    def validate(self) -> TTSConfig:
        self._check_finite()
        if not isinstance(self.update_stride, int) or self.update_stride < 1:
            raise TTSConfigError(f"--tts-update-stride must be an integer >= 1, got {self.update_stride!r}")
        if not (self.lr > 0.0):
            raise TTSConfigError(f"--tts-lr must be > 0, got {self.lr!r}")
        if self.lr > 1e-1:
            raise TTSConfigError(f"--tts-lr {self.lr} is far above any useful value (1e-5..1e-3)")
        if self.reg_lambda < 0.0:
            raise TTSConfigError(f"--tts-reg-lambda must be >= 0, got {self.reg_lambda!r}")
        if not isinstance(self.steps_per_update, int) or self.steps_per_update < 1:
            raise TTSConfigError(f"--tts-steps-per-update must be an integer >= 1, got {self.steps_per_update!r}")
        if self.scope not in SCOPES:
            raise TTSConfigError(f"--tts-scope must be one of {'|'.join(SCOPES)}, got {self.scope!r}")
        if self.adapter_rank != FULL_RANK and (not isinstance(self.adapter_rank, int) or self.adapter_rank < 1):
            raise TTSConfigError(f"--tts-adapter-rank must be an integer >= 1 or 'full', got {self.adapter_rank!r}")
        if not isinstance(self.max_adapted_requests, int) or self.max_adapted_requests < 1:
            raise TTSConfigError(f"--tts-max-adapted-requests must be >= 1, got {self.max_adapted_requests!r}")
        if not (0.0 < self.adapter_lr <= 1e-1):
            raise TTSConfigError(f"--tts-adapter-lr must be in (0, 0.1], got {self.adapter_lr!r}")
        if not (self.adapter_alpha > 0.0):
            raise TTSConfigError(f"--tts-adapter-alpha must be > 0, got {self.adapter_alpha!r}")
        if self.optimizer not in ("adam", "adamw", "sgd"):
            raise TTSConfigError(f"--tts-optimizer must be adam, adamw or sgd, got {self.optimizer!r}")
        if self.loss_backend not in ("auto", "naive", "chunked", "triton"):
            raise TTSConfigError(f"--tts-loss-backend must be auto|naive|chunked|triton, got {self.loss_backend!r}")
        if self.canvas not in ("accepted", "full"):
            raise TTSConfigError(f"--tts-canvas must be 'accepted' or 'full', got {self.canvas!r}")
        if self.canvas_vocab not in ("draft", "full"):
            raise TTSConfigError(f"--tts-canvas-vocab must be 'draft' or 'full', got {self.canvas_vocab!r}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise TTSConfigError("--tts-max-grad-norm must be > 0 (or omitted)")
        if self.position_weights is not None:
            if len(self.position_weights) == 0 or any(w < 0 for w in self.position_weights):
                raise TTSConfigError("--tts-position-weights must be non-negative numbers")
        if self.controller is not None and not str(self.controller).strip():
            raise TTSConfigError("--tts-controller needs a policy file path (or 'none')")
        if self.prompt_adapt not in PROMPT_ADAPT_MODES:
            raise TTSConfigError(
                f"--tts-prompt-adapt must be one of {'|'.join(PROMPT_ADAPT_MODES)}, got {self.prompt_adapt!r}"
            )
        for flag, value in (
            ("--tts-prompt-positions", self.prompt_positions),
            ("--tts-prompt-min-positions", self.prompt_min_positions),
            ("--tts-prompt-steps", self.prompt_steps),
            ("--tts-prompt-depth", self.prompt_depth),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TTSConfigError(f"{flag} must be an integer >= 1, got {value!r}")
        if self.prompt_positions > 65536:
            raise TTSConfigError(
                f"--tts-prompt-positions {self.prompt_positions} is above 65536 (memory grows with it)"
            )
        if self.prompt_lr is not None and not (0.0 < self.prompt_lr <= 1e-1):
            raise TTSConfigError(f"--tts-prompt-lr must be in (0, 0.1], got {self.prompt_lr!r}")
        if self.on_target_update not in ("keep", "reset"):
            raise TTSConfigError(f"--tts-on-target-update must be keep|reset, got {self.on_target_update!r}")
        if self.log_interval < 0:
            raise TTSConfigError("--tts-log-interval must be >= 0")
        if self.update_budget is not None and not (0.0 < self.update_budget < 1.0):
            raise TTSConfigError(f"--tts-update-budget must be 'auto' or a share in (0, 1), got {self.update_budget!r}")
        if not (isinstance(self.update_budget_scale, (int, float)) and 0.0 < self.update_budget_scale <= 1.0):
            raise TTSConfigError(f"--tts-update-budget-scale must be in (0, 1], got {self.update_budget_scale!r}")
        for flag, value in (("--tts-min-stride", self.min_stride), ("--tts-max-stride", self.max_stride)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TTSConfigError(f"{flag} must be an integer >= 1, got {value!r}")
        if self.min_stride > self.max_stride:
            raise TTSConfigError(f"--tts-min-stride {self.min_stride} is above --tts-max-stride {self.max_stride}")
        if self.update_window is not None and (
            not isinstance(self.update_window, int)
            or isinstance(self.update_window, bool)
            or not (1 <= self.update_window <= MAX_UPDATE_WINDOW)
        ):
            raise TTSConfigError(
                f"--tts-update-window must be an integer in 1..{MAX_UPDATE_WINDOW}, got {self.update_window!r}"
            )
        if not isinstance(self.window_rows, int) or not (1 <= self.window_rows <= MAX_WINDOW_ROWS):
            raise TTSConfigError(f"window_rows must be an integer in 1..{MAX_WINDOW_ROWS}, got {self.window_rows!r}")
        if not isinstance(self.guard_window, int) or isinstance(self.guard_window, bool) or self.guard_window < 1:
            raise TTSConfigError(f"--tts-guard-window must be an integer >= 1, got {self.guard_window!r}")
        if not isinstance(self.guard_interval, int) or isinstance(self.guard_interval, bool) or self.guard_interval < 1:
            raise TTSConfigError(f"--tts-guard-interval must be an integer >= 1, got {self.guard_interval!r}")
        if not (0.0 <= self.guard_margin < 1.0):
            raise TTSConfigError(f"--tts-guard-margin must be in [0, 1), got {self.guard_margin!r}")
        if not (0.0 < self.guard_backoff <= 1.0):
            raise TTSConfigError(f"--tts-guard-backoff must be in (0, 1], got {self.guard_backoff!r}")
        if not isinstance(self.hybrid_min_match, int) or self.hybrid_min_match < 0:
            raise TTSConfigError(f"--tts-hybrid-min-match must be an integer >= 0, got {self.hybrid_min_match!r}")
        if self.hybrid_score not in ("average", "chain"):
            raise TTSConfigError(f"--tts-hybrid-score must be average|chain, got {self.hybrid_score!r}")
        if self.hybrid_train not in ("all", "drafter"):
            raise TTSConfigError(f"--tts-hybrid-train must be all|drafter, got {self.hybrid_train!r}")
        if self.hybrid_idle_updates not in ("skip", "run"):
            raise TTSConfigError(f"--tts-hybrid-idle-updates must be skip|run, got {self.hybrid_idle_updates!r}")
        if self.hybrid_retire_below < 0.0:
            raise TTSConfigError(f"--tts-hybrid-retire-below must be >= 0, got {self.hybrid_retire_below!r}")
        after = self.hybrid_retire_after
        if not isinstance(after, int) or isinstance(after, bool) or after < 1:
            raise TTSConfigError(f"--tts-hybrid-retire-after must be an integer >= 1, got {after!r}")
        return self

    @property
    def governed_stride(self) -> bool:
        """Does the update budget move the stride? (not when pinned, frozen or run by the controller)"""
        return not self.stride_pinned and self.verify_updates and self.controller is None

    def _check_finite(self) -> None:
        """Every number must be finite: NaN passes each `< 0` check and Inf each `> 0` one, and
        either would reach the optimizer (NaN lambda, alpha or position weight: NaN weights)."""
        for f in fields(self):
            value = getattr(self, f.name)
            numbers = value if isinstance(value, tuple) else (value,)
            for number in numbers:
                if isinstance(number, float) and not math.isfinite(number):
                    flag = f"--tts-{f.name.replace('_', '-')}"
                    raise TTSConfigError(f"{flag} must be a finite number, got {value!r}")

    @property
    def window(self) -> int:
        """The rounds an update trains on, at most (update_window; auto: 1, the latest round)."""
        return 1 if self.update_window is None else self.update_window

    def with_default_window(self, stackable: bool) -> TTSConfig:
        """This config with an auto update_window resolved: where a stride's canvases can be stacked
        into one update (EAGLE-3), every round of the stride up to DEFAULT_WINDOW_ROWS rows; 1 where
        they cannot (DFlash)."""
        if self.update_window is not None:
            return self
        if not stackable:
            return replace(self, update_window=1)
        return replace(self, update_window=DEFAULT_UPDATE_WINDOW, window_rows=DEFAULT_WINDOW_ROWS)

    @property
    def verify_updates(self) -> bool:
        """Do verify rounds update the drafter? (not frozen, not prompt adaptation alone)"""
        return not self.freeze and self.prompt_adapt != "only"

    @property
    def prompt_step_lr(self) -> float:
        """The learning rate of prompt steps (prompt_lr, or 3x `lr`: the runtime passes the adapters'
        rate as `lr` with per-request adapters)."""
        return self.prompt_lr if self.prompt_lr is not None else PROMPT_LR_FACTOR * self.lr

    @property
    def prompt_updates(self) -> bool:
        """Does a request's prompt update the drafter?"""
        return not self.freeze and self.prompt_adapt != "off"

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
