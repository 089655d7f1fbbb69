"""SGLang plugin entry point (`sglang.srt.plugins`): runs in every SGLang process.

1. On a machine without SGLang's native kernels, activates the CPU layer (sglang_tts.platform.cpu).
2. Registers the TTS speculative algorithm (`--speculative-algorithm TTS`).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    from sglang_tts.platform import cpu
    from sglang_tts.sglang.algorithm import register_tts_algorithm

    cpu.install()
    register_tts_algorithm()
