"""Differentiable EAGLE-3 and DFlash drafters (public checkpoint layouts) and their loaders."""

from sglang_tts.drafters.common import IncompatibleDrafterError, UnsupportedDrafterConfigError
from sglang_tts.drafters.dflash import DFlashConfig, DFlashDrafter
from sglang_tts.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from sglang_tts.drafters.loading import check_compatible, drafter_kind, load_drafter

__all__ = [
    "DFlashConfig",
    "DFlashDrafter",
    "Eagle3Config",
    "Eagle3Drafter",
    "IncompatibleDrafterError",
    "UnsupportedDrafterConfigError",
    "check_compatible",
    "drafter_kind",
    "load_drafter",
]
