"""sglang-tts: Test-Time Speculation for SGLang.

The drafter of a speculative decoder is distilled online towards the target during generation
(TTS paper, section 4). `sglang_tts.core` holds the engine-independent algorithm; `sglang_tts.sglang`
the thin SGLang adapter; `sglang_tts.plugin` registers both with SGLang's plugin entry point.
"""

__version__ = "0.1.0"
