"""Policy files: what `--tts-controller PATH` loads and `scripts/train_controller.py` writes.

One JSON object:

    {"format": "sglang-tts-controller-policy", "version": 1,
     "kind": "linucb" | "thompson" | "softmax" | "static" | "round_robin" | "uniform",
     "max_steps": M,                      # the state's size: feature_names(M, suffix)
     "feature_names": [...],              # must equal this version's feature_names(M, suffix)
     "actions": [{"num_steps": n, "update_stride": S}, ...],   # + "proposer" where not "drafter";
                                          # suffix = any action has one (actions.uses_suffix)
     "controller": {"persistence": 8, "explore": false, "reward": "tokens_per_second",
                    "cost_model": null, "initial_action": null, "ema_alpha": 0.2},
     "state": {...},                      # the policy's state_dict()
     "meta": {...}}                       # free-form provenance (how it was trained)

Everything is checked at load time; any problem is a PolicyFileError that names the file and what is
wrong with it, so a server refuses a bad file at launch instead of failing mid-serving.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_tts.control.actions import Action, uses_suffix
from sglang_tts.control.controller import Controller, ControllerConfig
from sglang_tts.control.cost import CostModel
from sglang_tts.control.observation import feature_names
from sglang_tts.control.policy import POLICY_KINDS, STATEFUL_KINDS, ControllerPolicy

POLICY_FORMAT = "sglang-tts-controller-policy"
POLICY_VERSION = 1
_CONTROLLER_KEYS = ("persistence", "explore", "reward", "cost_model", "initial_action", "ema_alpha")


class PolicyFileError(ValueError):
    """A controller policy file that cannot be used (unreadable, corrupt, or not for this setup)."""


@dataclass
class PolicyBundle:
    """A loaded policy file: the policy plus the controller settings it was trained with."""

    policy: ControllerPolicy
    config: ControllerConfig
    max_steps: int
    meta: dict[str, Any] = field(default_factory=dict)
    path: str | None = None

    @property
    def actions(self) -> list[Action]:
        return self.policy.actions

    def make_controller(self, learn: bool | None = None, explore: bool | None = None) -> Controller:
        """A Controller driving this policy; learn/explore override the file's settings."""
        config = self.config
        if learn is not None or explore is not None:
            config = ControllerConfig(
                **{
                    **{k: getattr(config, k) for k in (*_CONTROLLER_KEYS, "max_trace")},
                    "learn": config.learn if learn is None else learn,
                    "explore": config.explore if explore is None else explore,
                }
            )
        return Controller(self.policy, config, self.max_steps)


def controller_settings(config: ControllerConfig) -> dict[str, Any]:
    cost = config.cost_model
    return {
        "persistence": int(config.persistence),
        "explore": bool(config.explore),
        "reward": config.reward,
        "cost_model": cost.to_dict() if isinstance(cost, CostModel) else cost,
        "initial_action": config.initial_action.to_dict() if config.initial_action is not None else None,
        "ema_alpha": float(config.ema_alpha),
    }


def policy_document(
    policy: ControllerPolicy, config: ControllerConfig, max_steps: int, meta: dict[str, Any] | None = None
) -> dict[str, Any]:
    kind = getattr(policy, "kind", None)
    if kind not in POLICY_KINDS:
        raise ValueError(f"cannot save a policy of kind {kind!r}; known: {', '.join(POLICY_KINDS)}")
    return {
        "format": POLICY_FORMAT,
        "version": POLICY_VERSION,
        "kind": kind,
        "max_steps": int(max_steps),
        "feature_names": feature_names(max_steps, uses_suffix(policy.actions)),
        "actions": [a.to_dict() for a in policy.actions],
        "controller": controller_settings(config),
        "state": policy.state_dict(),
        "meta": dict(meta or {}),
    }


def save_policy(
    path: str | Path,
    policy: ControllerPolicy,
    config: ControllerConfig | None = None,
    max_steps: int | None = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write a policy file atomically (a reader never sees half a file). max_steps defaults to the
    largest chain length of the action set (the smallest state that covers it)."""
    config = config or ControllerConfig(explore=False, learn=False)
    max_steps = max_steps if max_steps is not None else max(1, max(a.num_steps for a in policy.actions))
    document = policy_document(policy, config, max_steps, meta)
    load_document(json.loads(json.dumps(document)), "<policy being saved>")  # never write what cannot be read
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(document, f)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_policy(path: str | Path, expected_actions: Sequence[Action] | None = None) -> PolicyBundle:
    """Read and validate a policy file. expected_actions: the action set the caller needs (same
    actions, same order), e.g. when continuing to train an existing policy on a fixed grid."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PolicyFileError(f"controller policy file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PolicyFileError(f"controller policy file {path} cannot be read: {e}") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as e:
        raise PolicyFileError(f"controller policy file {path} is not valid JSON (corrupt or truncated?): {e}") from None
    bundle = load_document(document, str(path))
    if expected_actions is not None and list(expected_actions) != bundle.actions:
        raise PolicyFileError(
            f"controller policy file {path} has actions {[str(a) for a in bundle.actions]}, "
            f"expected {[str(a) for a in expected_actions]}"
        )
    return bundle


def load_document(document: Any, source: str) -> PolicyBundle:
    """Validate a parsed policy document (see the module docstring); PolicyFileError names `source`."""

    def fail(reason: str) -> PolicyFileError:
        return PolicyFileError(f"controller policy file {source}: {reason}")

    if not isinstance(document, dict):
        raise fail(f"expected a JSON object, got {type(document).__name__}")
    if document.get("format") != POLICY_FORMAT:
        raise fail(f"format is {document.get('format')!r}, expected {POLICY_FORMAT!r} (not a policy file?)")
    if document.get("version") != POLICY_VERSION:
        raise fail(f"version {document.get('version')!r} is not supported (this sglang-tts reads {POLICY_VERSION})")
    missing = [k for k in ("kind", "max_steps", "feature_names", "actions", "controller", "state") if k not in document]
    if missing:
        raise fail(f"missing keys {missing}")
    kind = document["kind"]
    if kind not in POLICY_KINDS:
        raise fail(f"unknown policy kind {kind!r}; known: {', '.join(POLICY_KINDS)}")

    raw_actions = document["actions"]
    if not isinstance(raw_actions, list) or not raw_actions:
        raise fail("'actions' must be a non-empty list")
    try:
        actions = [Action.from_dict(a) for a in raw_actions]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise fail(f"bad action in 'actions': {e!r}") from None
    if len(set(actions)) != len(actions):
        raise fail(f"duplicate actions in {[str(a) for a in actions]}")

    max_steps = document["max_steps"]
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise fail(f"max_steps must be an integer >= 1, got {max_steps!r}")
    longest = max(a.num_steps for a in actions)
    if longest > max_steps:
        raise fail(f"an action drafts {longest} steps but the state covers max_steps={max_steps}")
    expected_names = feature_names(max_steps, uses_suffix(actions))
    if document["feature_names"] != expected_names:
        raise fail(
            f"its state features {document['feature_names']} do not match this version's "
            f"{expected_names} (trained with another feature set: retrain it)"
        )

    settings = document["controller"]
    if not isinstance(settings, dict):
        raise fail("'controller' must be an object")
    unknown = set(settings) - set(_CONTROLLER_KEYS)
    if unknown:
        raise fail(f"unknown controller settings {sorted(unknown)}; known: {list(_CONTROLLER_KEYS)}")
    try:
        kwargs = dict(settings)
        if kwargs.get("initial_action") is not None:
            kwargs["initial_action"] = Action.from_dict(kwargs["initial_action"])
        if "persistence" in kwargs and (
            isinstance(kwargs["persistence"], bool) or not isinstance(kwargs["persistence"], int)
        ):
            raise ValueError(f"persistence must be an integer, got {kwargs['persistence']!r}")
        if "ema_alpha" in kwargs and not (
            isinstance(kwargs["ema_alpha"], (int, float)) and 0 < kwargs["ema_alpha"] <= 1
        ):
            raise ValueError(f"ema_alpha must be in (0, 1], got {kwargs['ema_alpha']!r}")
        config = ControllerConfig(**kwargs)
    except (KeyError, TypeError, ValueError) as e:
        raise fail(f"bad controller settings: {e}") from None
    if config.initial_action is not None and config.initial_action not in actions:
        raise fail(f"initial action {config.initial_action} is not in the action set")
    if isinstance(config.cost_model, CostModel) and not all(
        math.isfinite(v) for v in config.cost_model.to_dict().values()
    ):
        raise fail("the cost model has NaN or Inf coefficients")

    state = document["state"]
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict):
        raise fail("'state' must be an object with a 'config' object")
    bad = _non_finite(state, "state")
    if bad is not None:
        raise fail(f"NaN or Inf in the policy's state at {bad}")
    if kind in STATEFUL_KINDS and state["config"].get("dim") != len(expected_names):
        raise fail(
            f"the {kind} state has {state['config'].get('dim')!r} features, "
            f"but max_steps={max_steps} gives {len(expected_names)}"
        )
    try:
        policy = POLICY_KINDS[kind].from_state_dict(actions, state)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise fail(f"bad {kind} state: {e!r}") from None
    meta = document.get("meta") or {}
    if not isinstance(meta, dict):
        raise fail("'meta' must be an object")
    return PolicyBundle(policy=policy, config=config, max_steps=max_steps, meta=meta, path=source)


def _non_finite(value: Any, where: str) -> str | None:
    """The path of the first NaN/Inf number in a parsed JSON value (JSON parsers accept NaN and
    Infinity), or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else where
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        bad = _non_finite(item, f"{where}[{key!r}]")
        if bad is not None:
            return bad
    return None
