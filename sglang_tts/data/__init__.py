"""Benchmark prompt sets and workloads, usable without a model hub (see ``prompts`` and ``workloads``).

Importing the package registers the workload names (``reasoning``, ``long-gen``, ``long-context``, ...) with
``load_prompts``.
"""

from sglang_tts.data import code_edit as _code_edit  # noqa: F401  (registers the training-only code-edit source)
from sglang_tts.data.prompts import (
    DEFAULT_INSTRUCTION,
    Prompt,
    PromptSourceError,
    available_sources,
    format_chat,
    load_prompts,
    prepare_prompt_sources,
)
from sglang_tts.data.split import Split, balanced_sample, split_prompts
from sglang_tts.data.workloads import WORKLOADS, load_workload, workload_split

__all__ = [
    "DEFAULT_INSTRUCTION",
    "Prompt",
    "PromptSourceError",
    "available_sources",
    "format_chat",
    "load_prompts",
    "prepare_prompt_sources",
    "Split",
    "WORKLOADS",
    "balanced_sample",
    "load_workload",
    "split_prompts",
    "workload_split",
]
