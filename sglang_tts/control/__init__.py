"""The draft/stride controller: picks the draft chain length and the TTS update stride per batch.

Engine-independent (numpy only): actions, the observed state, the policies (contextual bandits, a
softmax policy, scripted ones), the Controller that drives them, policy files, offline fitting from
logged traces, and a synthetic environment with a known best action per context. The SGLang side
lives in sglang_tts/sglang/adaptive_steps.py.
"""

from sglang_tts.control.actions import Action, action_grid
from sglang_tts.control.controller import Controller, ControllerConfig, read_trace
from sglang_tts.control.observation import Observation, StateTracker, feature_names
from sglang_tts.control.policy import POLICY_KINDS, make_policy
from sglang_tts.control.policy_file import PolicyBundle, PolicyFileError, load_policy, save_policy

__all__ = [
    "Action",
    "Controller",
    "ControllerConfig",
    "Observation",
    "POLICY_KINDS",
    "PolicyBundle",
    "PolicyFileError",
    "StateTracker",
    "action_grid",
    "feature_names",
    "load_policy",
    "make_policy",
    "read_trace",
    "save_policy",
]
