"""SGLang plugin entry point (`sglang.srt.plugins`): runs in every SGLang process.

1. On a machine without SGLang's native kernels, activates the CPU layer (sglang_tts.platform.cpu).
2. Registers the TTS speculative algorithm (`--speculative-algorithm TTS`).
3. Lets DFLASH capture the target layers of models SGLang wires for EAGLE-3 only (sglang_tts.sglang.dflash_capture).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_tts.platform import cpu
    from sglang_tts.sglang import dflash_capture
    from sglang_tts.sglang.algorithm import register_tts_algorithm

    cpu.install()
    register_tts_algorithm()
    dflash_capture.register_hooks(HookRegistry, HookType)
