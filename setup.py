"""sglang-tts: Test-Time Speculation for SGLang (online drafter distillation during generation)."""

from setuptools import find_packages, setup

setup(
    name="sglang-tts",
    version="0.1.0",
    description="Test-Time Speculation: adapt EAGLE-3 / DFlash drafters online inside SGLang",
    # One top-level name. The update kernels live in sglang_tts.kernels, not a top-level triton_kernels:
    # that is OpenAI's package, which SGLang imports for MXFP4/FP8 models (tests/test_distribution.py).
    packages=find_packages(include=["sglang_tts", "sglang_tts.*"]),
    # The workloads' committed prompt files (sglang_tts/data/workloads.py, long_context.py).
    # ... and the drafters that ship with the package, fp16 (sglang_tts/drafters/shipped.py).
    package_data={
        "sglang_tts.data": ["files/*.json", "files/*.jsonl"],
        "sglang_tts.drafters": ["shipped/*/*.json", "shipped/*/*.safetensors"],
    },
    python_requires=">=3.10",
    # sglang and torch are installed by scripts/setup_env.sh (CPU build of torch, sglang --no-deps);
    # listing them here would let pip pull CUDA wheels.
    install_requires=["safetensors", "tqdm", "numpy"],
    extras_require={
        "dev": ["pytest", "pytest-timeout", "ruff", "matplotlib", "openai"],
    },
    entry_points={
        # SGLang's load_plugins() runs this in every process (launcher, scheduler, detokenizer).
        "sglang.srt.plugins": ["sglang_tts = sglang_tts.plugin:register"],
    },
)
