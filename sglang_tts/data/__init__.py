"""Benchmark prompt sets for long-reasoning workloads, usable without a model hub (see ``prompts``)."""

from sglang_tts.data.prompts import (
    DEFAULT_INSTRUCTION,
    Prompt,
    PromptSourceError,
    available_sources,
    format_chat,
    load_prompts,
    prepare_prompt_sources,
)

__all__ = [
    "DEFAULT_INSTRUCTION",
    "Prompt",
    "PromptSourceError",
    "available_sources",
    "format_chat",
    "load_prompts",
    "prepare_prompt_sources",
]
