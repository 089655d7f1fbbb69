"""``code-edit``: training-only code-editing prompts over functions and classes of the Python standard library.

The long-context workload asks for edits of whole standard-library files (:mod:`sglang_tts.data.long_context`),
but only 36 of its files are held in, too few to teach a drafter what a code-editing answer looks like. This
source makes many more prompts of the same kind from the rest of the standard library: every top-level function
or class of ``MIN_TOKENS``-``MAX_TOKENS`` tokens in a candidate module (the long-context selection's rules:
no tests, generated, vendored or deprecated modules) whose file is **not** in the long-context manifest, so no
held-out workload file reaches training. Each gets one of the long-context workload's editing instructions.

Selection is deterministic for an interpreter's standard library: segments in seeded hash order, at most
``MAX_PER_FILE`` per file, instructions in turn. Another Python version gives another (equally valid) set; the
drafter's ``train/held_in.jsonl`` records the prompts it was trained on. Token counts use the tokenizer
:func:`~sglang_tts.data.long_context.token_counter` finds (else ``len(text) / 3.5``).

``load_prompts("code-edit")`` returns them all; ``scripts/train_drafter.py --extra-source code-edit
--extra-prompts N`` adds a seeded sample of N to a drafter's training prompts. Benchmarks never use it.
"""

from __future__ import annotations

import ast
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

from sglang_tts.assets import PathLike
from sglang_tts.data.long_context import (
    CHARS_PER_TOKEN,
    INSTRUCTIONS,
    Instruction,
    TokenCounter,
    is_candidate,
    read_manifest,
    stdlib_root,
    token_counter,
)
from sglang_tts.data.prompts import Prompt, PromptSourceError, SourceFamily, register_source_family
from sglang_tts.data.split import rank_key

logger = logging.getLogger(__name__)

DATASET = "code-edit"
MIN_TOKENS = 200
MAX_TOKENS = 1500
MAX_PER_FILE = 2
SEED = 0


@dataclass(frozen=True)
class Segment:
    """A top-level function or class: its file (relative to the stdlib root), name, kind and source text."""

    path: str
    name: str
    kind: str  # "function" or "class"
    text: str

    @property
    def id(self) -> str:
        return f"{DATASET}-{self.path.removesuffix('.py').replace('/', '.')}.{self.name}"


def file_segments(relative: str, source: str) -> list[Segment]:
    """The top-level functions and classes of one module's source, decorators included; [] if it does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.end_lineno is not None:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            out.append(Segment(relative, node.name, kind, "\n".join(lines[first - 1 : node.end_lineno])))
    return out


def render_prompt(segment: Segment, instruction: Instruction) -> str:
    return (
        f"Here is the {segment.kind} `{segment.name}` from `{segment.path}` in the Python standard library.\n\n"
        f"```python\n{segment.text.rstrip()}\n```\n\n{instruction.text}"
    )


def select_segments(
    root: Path, counter: TokenCounter, excluded: frozenset[str], seed: int = SEED
) -> list[tuple[Segment, Instruction]]:
    """Every eligible segment under ``root`` (see the module docstring), in seeded order, with its instruction."""
    eligible: list[Segment] = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if relative.as_posix() in excluded:
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        if not is_candidate(relative, source):
            continue
        for segment in file_segments(relative.as_posix(), source):
            approx = len(segment.text) / CHARS_PER_TOKEN
            if not MIN_TOKENS / 2 <= approx <= MAX_TOKENS * 2:  # cheap pre-filter before the tokenizer
                continue
            if MIN_TOKENS <= counter.count(segment.text) <= MAX_TOKENS:
                eligible.append(segment)
    per_file: dict[str, int] = {}
    chosen: list[tuple[Segment, Instruction]] = []
    for segment in sorted(eligible, key=lambda s: rank_key(seed, s.id)):
        if per_file.get(segment.path, 0) >= MAX_PER_FILE:
            continue
        per_file[segment.path] = per_file.get(segment.path, 0) + 1
        chosen.append((segment, INSTRUCTIONS[len(chosen) % len(INSTRUCTIONS)]))
    return chosen


@functools.lru_cache(maxsize=2)
def _code_edit_prompts(root: Path) -> tuple[Prompt, ...]:
    excluded = frozenset(entry.path for entry in read_manifest().files)
    chosen = select_segments(root, token_counter(), excluded)
    logger.info("code-edit: %d prompts from %s", len(chosen), root)
    return tuple(
        Prompt(segment.id, DATASET, render_prompt(segment, instruction), None, self_contained=True)
        for segment, instruction in chosen
    )


def code_edit_prompts(root: Path | None = None) -> list[Prompt]:
    """All code-edit prompts of the standard library at ``root`` (default: this interpreter's)."""
    return list(_code_edit_prompts(root if root is not None else stdlib_root()))


def _load(key: str, cache_dir: PathLike | None = None) -> list[Prompt]:
    if key != DATASET:
        raise PromptSourceError(f"unknown source {key!r}; the code-edit source has no parts")
    return code_edit_prompts()


register_source_family(SourceFamily((DATASET,), lambda key: key.partition(":")[0] == DATASET, _load))
