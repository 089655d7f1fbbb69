"""Training the testbed drafters (EAGLE-3 and DFlash) for a target, from its own greedy answers.

``data`` builds the generated set, ``target`` loads the target and caches its hidden states,
``eagle3`` / ``dflash`` are the two recipes, ``loop`` the resumable optimisation loop, ``weights``
initialisation and public-layout export, ``pipeline`` the end-to-end run behind
``scripts/train_drafter.py``.
"""

from sglang_tts.training.data import DataConfig, SequenceSet, build_sequence_set
from sglang_tts.training.dflash import DFlashTrainConfig
from sglang_tts.training.eagle3 import Eagle3TrainConfig
from sglang_tts.training.loop import LoopConfig, OptimConfig
from sglang_tts.training.pipeline import KindResult, TrainRequest, default_out, tiny_request, train_drafters

__all__ = [
    "DFlashTrainConfig",
    "DataConfig",
    "Eagle3TrainConfig",
    "KindResult",
    "LoopConfig",
    "OptimConfig",
    "SequenceSet",
    "TrainRequest",
    "build_sequence_set",
    "default_out",
    "tiny_request",
    "train_drafters",
]
