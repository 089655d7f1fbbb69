"""DFLASH's target-layer capture for targets that SGLang 0.5.23 wires for EAGLE-3 only.

SGLang's model runner asks the target for `set_dflash_layers_to_capture(ids)` when it serves DFLASH
(`configure_aux_hidden_state_capture`, model_runner_components/attention_backend_setup.py) and refuses a
model without it. 0.5.23's `Qwen2ForCausalLM` (Qwen2.5, Qwen2.5-Coder) has only
`set_eagle3_layers_to_capture`, which for explicit output-of-layer ids does exactly what Llama's DFLASH
method does: capture on, `model.layers_to_capture = [i + 1 for i in ids]`. For the classes listed here the
hook below makes that call for DFLASH and leaves the rest of SGLang's setup as it is; every other model, and
EAGLE-3, go to SGLang unchanged. This serves stock `--speculative-algorithm DFLASH` and TTS alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.model_executor.model_runner_components.attention_backend_setup.configure_aux_hidden_state_capture"
# Target classes whose EAGLE-3 capture with explicit ids is the DFLASH capture (checked against 0.5.23's source).
EAGLE3_CAPTURE_SERVES_DFLASH = frozenset({"Qwen2ForCausalLM"})


def lacks_dflash_capture(model: Any) -> bool:
    return not hasattr(model, "set_dflash_layers_to_capture") and not hasattr(model, "set_dspark_layers_to_capture")


def configure_capture_hook(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND `configure_aux_hidden_state_capture` (keyword-only arguments)."""
    model = kwargs.get("model")
    if (
        kwargs.get("dflash_use_aux_hidden_state")
        and model is not None
        and lacks_dflash_capture(model)
        and type(model).__name__ in EAGLE3_CAPTURE_SERVES_DFLASH
    ):
        layer_ids = kwargs.get("dflash_target_layer_ids")
        if layer_ids is None:
            raise ValueError("DFLASH requires explicit target layer ids (dflash_config.target_layer_ids)")
        model.set_eagle3_layers_to_capture([int(i) for i in layer_ids])
        logger.info("sglang-tts: DFLASH captures layers %s of %s", list(layer_ids), type(model).__name__)
        kwargs = {**kwargs, "dflash_use_aux_hidden_state": False}  # done here; SGLang does the rest
    return original(*args, **kwargs)


def register_hooks(registry: Any, hook_type: Any) -> None:
    registry.register(TARGET, configure_capture_hook, hook_type.AROUND)
