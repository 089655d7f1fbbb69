"""SGLang plugin entry point (`sglang.srt.plugins`): runs in every SGLang process.

1. On a machine without SGLang's native kernels, activates the CPU layer (sglang_tts.platform.cpu).
2. Checks that this SGLang has the internals the plugin relies on (sglang_tts.sglang.compat); on another
   SGLang the launch stops here with one message naming every difference.
3. Registers the TTS speculative algorithm (`--speculative-algorithm TTS`).
4. Lets DFLASH capture the target layers of models SGLang wires for EAGLE-3 only (sglang_tts.sglang.dflash_capture).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_tts.platform import cpu
    from sglang_tts.sglang import compat, dflash_capture
    from sglang_tts.sglang.algorithm import register_tts_algorithm

    cpu_active = cpu.install()  # first: on a CPU-only machine SGLang's modules import only with it
    compat.require(compat.register_scopes(cpu_active))  # raises SGLangMismatchError (a SystemExit)
    register_tts_algorithm()
    dflash_capture.register_hooks(HookRegistry, HookType)
