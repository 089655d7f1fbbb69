"""The benchmark's prompts: a seeded sample per dataset, interleaved, formatted for the server.

Every configuration gets exactly these prompts with the same sampling settings. Chat prompts are
formatted once, here, with the target tokenizer's chat template (``format_chat`` messages), so the
native ``/generate`` path sends token ids; the OpenAI path sends the messages and lets the server
apply the same template.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sglang_tts.data.prompts import DEFAULT_INSTRUCTION, Prompt, format_chat, load_prompts
from sglang_tts.data.split import interleave


@dataclass(frozen=True)
class BenchPrompt:
    """One request's input: token ids for ``/generate`` and/or chat messages for the OpenAI API."""

    id: str
    dataset: str
    input_ids: tuple[int, ...] | None = None
    messages: tuple[dict[str, str], ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["input_ids"] = None if self.input_ids is None else list(self.input_ids)
        out["messages"] = None if self.messages is None else [dict(m) for m in self.messages]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BenchPrompt:
        ids = data.get("input_ids")
        messages = data.get("messages")
        return cls(
            data["id"],
            data["dataset"],
            None if ids is None else tuple(ids),
            None if messages is None else tuple(dict(m) for m in messages),
        )


def sample_prompts(datasets: Sequence[str], num_prompts: int | None, seed: int) -> list[Prompt]:
    """``num_prompts`` seeded prompts from each dataset (all when None), datasets interleaved: every round of
    the schedule then mixes datasets."""
    return interleave([load_prompts(source, num_prompts, seed) for source in datasets])


def chat_prompts(
    prompts: Sequence[Prompt],
    tokenizer_path: str | Path | None,
    instruction: str | None = DEFAULT_INSTRUCTION,
    system: str | None = None,
) -> list[BenchPrompt]:
    """Chat-formatted prompts; with ``tokenizer_path``, also tokenized with its chat template."""
    tokenizer = None
    if tokenizer_path is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    out: list[BenchPrompt] = []
    for prompt in prompts:
        messages = format_chat(prompt, instruction=instruction, system=system)
        ids = None if tokenizer is None else _template_ids(tokenizer, messages)
        out.append(BenchPrompt(prompt.id, prompt.dataset, ids, tuple(messages)))
    return out


def _template_ids(tokenizer: Any, messages: Sequence[dict[str, str]]) -> tuple[int, ...]:
    """Chat messages as the model reads them: the chat template with the generation prompt, tokenized."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    # The template already wrote any BOS token: don't let the tokenizer add another.
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_token_counts(prompts: Sequence[BenchPrompt], tokenizer_path: str | Path) -> list[int]:
    """Each prompt's length in tokens: its ids, or its messages under the chat template."""
    tokenizer = None
    if any(p.input_ids is None for p in prompts):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    return [
        len(p.input_ids if p.input_ids is not None else _template_ids(tokenizer, p.messages or ())) for p in prompts
    ]
