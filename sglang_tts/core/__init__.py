"""Engine-independent TTS update core: canvas, loss, distiller, executors, weight publication.

Nothing in this package imports SGLang; the engine adapter (sglang_tts/sglang) builds Canvas
objects, calls Distiller.barrier()/observe(), and binds its inference weights with a WeightPublisher.
"""

from sglang_tts.core.canvas import Canvas
from sglang_tts.core.distiller import Distiller, UpdateOutcome
from sglang_tts.core.drafter_api import DifferentiableDrafter
from sglang_tts.core.executor import (
    SideStreamExecutor,
    SyncExecutor,
    ThreadExecutor,
    UpdateExecutor,
    UpdateResult,
    UpdateTiming,
    make_executor,
)
from sglang_tts.core.loss import (
    LossOutput,
    compute_loss,
    dflash_weights,
    eagle3_weights,
    tts_loss,
)
from sglang_tts.core.publish import (
    ParamBinding,
    PublishError,
    ShardSpec,
    WeightPublisher,
    stacked_name_map,
)
from sglang_tts.core.stats import DistillerStats

__all__ = [
    "Canvas",
    "DifferentiableDrafter",
    "Distiller",
    "DistillerStats",
    "LossOutput",
    "ParamBinding",
    "PublishError",
    "ShardSpec",
    "SideStreamExecutor",
    "SyncExecutor",
    "ThreadExecutor",
    "UpdateExecutor",
    "UpdateOutcome",
    "UpdateResult",
    "UpdateTiming",
    "WeightPublisher",
    "compute_loss",
    "dflash_weights",
    "eagle3_weights",
    "make_executor",
    "stacked_name_map",
    "tts_loss",
]
