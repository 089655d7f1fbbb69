"""The thin SGLang adapter: flags, the TTS algorithm registration, the worker, capture and metrics.

Everything here names SGLang's own concepts (ServerArgs, EAGLEWorkerV2, EagleVerifyInput,
meta_info); the algorithm itself lives in `sglang_tts.core`.
"""
