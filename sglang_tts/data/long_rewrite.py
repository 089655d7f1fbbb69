"""The long-rewrite workload: answers of 4-16K tokens, whole standard-library files rewritten (issue 43).

The paper's regime is answers of many thousand tokens; the other workloads' answers end at 1-2K. An answer
that rewrites a whole file runs as long as the file, and a file is text that does not loop, so the answer
does not either. This workload takes the standard library's largest modules, 4,500-16,000 tokens, none of
them in the long-context manifest (:mod:`sglang_tts.data.long_context`: no file of it reaches this one), and
asks for the whole file back: with type hints and docstrings, ported to modern Python, or ported to Go (a
translation, new text for a drafter, where the first two are close to copies of the prompt).

Two length bins (``BINS``), two workloads: ``long-rewrite-4k`` (files of 4.5-8K tokens, answers past 4,096
tokens) and ``long-rewrite-8k`` (files of 8-16K tokens, answers past 8,192), so a report's per-dataset tables
are per length. The selection rules, the manifest format and the prompt text are the long-context workload's
(:class:`~sglang_tts.data.long_context.Selection`); one manifest holds both bins, ``files/long_rewrite.json``::

    python -m sglang_tts.data.long_rewrite --write      # select the files again
    python -m sglang_tts.data.long_rewrite --check      # compare the local stdlib with the manifest

Nothing trains on it today (the shipped drafters were trained with ``--workloads``, the other three); it is
split into held-in and held-out parts like the others all the same, so a drafter trained later can use the
held-in part and benchmarks keep to the held-out one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from sglang_tts.data.long_context import (
    INSTRUCTIONS,
    Manifest,
    Selection,
    long_context_prompts,
    manifest_cli,
    prompt_id,
    size_bin,
)
from sglang_tts.data.long_context import read_manifest as read_long_context_manifest
from sglang_tts.data.prompts import Prompt

DATASETS = ("long-rewrite-4k", "long-rewrite-8k")  # one per bin
MANIFEST = Path(__file__).resolve().parent / "files" / "long_rewrite.json"
BINS: tuple[tuple[int, int], ...] = ((4500, 8000), (8000, 16001))
FILES_PER_BIN = 16
# The long-context instructions whose answer is the whole file again.
WHOLE_FILE = ("type-hints", "modernize", "port-go")


def selection() -> Selection:
    """Two bins of ``FILES_PER_BIN`` files, the whole-file instructions in turn, no long-context file."""
    instructions = tuple(i for i in INSTRUCTIONS if i.name in WHOLE_FILE)
    taken = frozenset(f.path for f in read_long_context_manifest().files)
    return Selection(BINS, FILES_PER_BIN, instructions, taken)


def read_manifest(path: Path = MANIFEST) -> Manifest:
    """The committed manifest (read once per process, like the long-context one)."""
    return read_long_context_manifest(path)


def long_rewrite_prompts(dataset: str, manifest: Manifest | None = None, root: Path | None = None) -> list[Prompt]:
    """One self-contained prompt per file of ``dataset``'s bin found under ``root`` (ids ``<dataset>-<module>``)."""
    manifest = manifest if manifest is not None else read_manifest()
    index = DATASETS.index(dataset)
    files = tuple(f for f in manifest.files if size_bin(f.tokens, manifest.bins) == index)
    return long_context_prompts(replace(manifest, files=files), root, dataset)


def by_instruction(manifest: Manifest, dataset: str) -> Callable[[Prompt], str]:
    """The split's group of a prompt: its instruction, so the held-out part has every kind of rewrite."""
    instruction = {prompt_id(f.path, dataset): f.instruction for f in manifest.files}
    return lambda prompt: instruction[prompt.id]


def main(argv: Sequence[str] | None = None) -> int:
    return manifest_cli(argv, "long-rewrite", MANIFEST, selection)


if __name__ == "__main__":
    sys.exit(main())
