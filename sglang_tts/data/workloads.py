"""The three benchmark workloads, each split once into held-in and held-out prompts.

=============  ===========================================================================  ======
workload       prompts                                                                      split
=============  ===========================================================================  ======
reasoning      MATH-500 (subset), AIME 2024, AIME 2025, CHAMP (built-in sets; natural ends)  by set
long-gen       ``files/long_gen.jsonl``: programs with tests and docs, multi-part             by
               derivations, long technical documents (answers meant to exceed 1,500 tokens)  category
long-context   Python standard-library files of 1-6K tokens with an editing instruction     by size
               (:mod:`sglang_tts.data.long_context`)                                        bin
long-rewrite-  the largest standard-library files rewritten whole (:mod:`~.long_rewrite`):   by in-
4k, -8k        files of 4.5-8K / 8-16K tokens, answers past 4,096 / 8,192 tokens             struction
=============  ===========================================================================  ======

Source names (``load_prompts`` and ``scripts/bench_long.py --datasets`` take them):

- ``reasoning``, ``long-gen``, ``long-context``: the held-out prompts (benchmarks only);
- ``<workload>:held-in`` (drafter training may use them), ``<workload>:held-out``, ``<workload>:all``;
- ``workloads:held-in`` / ``workloads:held-out``: the first three workloads' parts together, interleaved
  (``scripts/train_drafter.py --workloads`` trains on ``workloads:held-in``). The long-rewrite
  workloads are not in the mix: their answers run to 4-16K tokens, workloads of their own for runs at length.

Every prompt carries its workload's name as ``Prompt.dataset``, so benchmark reports are per workload. The
split (:func:`sglang_tts.data.split.split_prompts`, seed ``SPLIT_SEED``) holds out ``HELD_OUT_FRACTION`` of
each group, so the held-out part covers every set, category and length bin. It is fixed: the benchmark's
``--seed`` only picks which held-out prompts run.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from sglang_tts.assets import PathLike, resolve_cache_dir
from sglang_tts.data.long_context import bin_of_prompt, long_context_prompts, read_manifest
from sglang_tts.data.long_rewrite import by_instruction, long_rewrite_prompts
from sglang_tts.data.long_rewrite import read_manifest as read_rewrite_manifest
from sglang_tts.data.prompts import Prompt, PromptSourceError, SourceFamily, load_prompts, register_source_family
from sglang_tts.data.split import Split, interleave, rank_key, split_prompts

SPLIT_SEED = 0
HELD_OUT_FRACTION = 0.25
PARTS = ("held-out", "held-in", "all")
MIX = "workloads"  # all workloads together: workloads:held-in, workloads:held-out
REASONING_SETS = ("math500", "champ", "aime2024", "aime2025")
LONG_GEN_FILE = Path(__file__).resolve().parent / "files" / "long_gen.jsonl"

Grouping = Callable[[Prompt], str]  # the split's group of a prompt


@dataclass(frozen=True)
class Workload:
    """A named prompt set; ``build`` returns its prompts (in a fixed order) and the split's grouping."""

    name: str
    description: str
    build: Callable[[Path], tuple[list[Prompt], Grouping]]  # asset cache root -> (prompts, grouping)


def _build_reasoning(cache_dir: Path) -> tuple[list[Prompt], Grouping]:
    # A seeded mix: each set in hash order, the sets interleaved; every prompt relabelled "reasoning".
    origin: dict[str, str] = {}
    ordered: list[list[Prompt]] = []
    for name in REASONING_SETS:
        prompts = sorted(load_prompts(name, cache_dir=cache_dir), key=lambda p: rank_key(SPLIT_SEED, p.id))
        origin.update((p.id, name) for p in prompts)
        ordered.append([replace(p, dataset="reasoning") for p in prompts])
    return interleave(ordered), lambda prompt: origin[prompt.id]


def _build_long_gen(cache_dir: Path) -> tuple[list[Prompt], Grouping]:
    with open(LONG_GEN_FILE, encoding="utf-8") as handle:
        category = {row["id"]: row["category"] for row in map(json.loads, filter(str.strip, handle))}
    prompts = [replace(p, dataset="long-gen") for p in load_prompts(str(LONG_GEN_FILE))]
    return prompts, lambda prompt: category[prompt.id]


def _build_long_context(cache_dir: Path) -> tuple[list[Prompt], Grouping]:
    manifest = read_manifest()
    return long_context_prompts(manifest), bin_of_prompt(manifest)


def _long_rewrite_builder(dataset: str) -> Callable[[Path], tuple[list[Prompt], Grouping]]:
    def build(cache_dir: Path) -> tuple[list[Prompt], Grouping]:
        manifest = read_rewrite_manifest()
        return long_rewrite_prompts(dataset, manifest), by_instruction(manifest, dataset)

    return build


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("reasoning", "MATH-500 subset, AIME 2024/2025, CHAMP: natural ends", _build_reasoning),
        Workload("long-gen", "long structured answers: programs, derivations, documents", _build_long_gen),
        Workload("long-context", "stdlib files of 1-6K tokens with an editing instruction", _build_long_context),
        Workload(
            "long-rewrite-4k", "stdlib files of 4.5-8K tokens rewritten whole", _long_rewrite_builder("long-rewrite-4k")
        ),
        Workload(
            "long-rewrite-8k", "stdlib files of 8-16K tokens rewritten whole", _long_rewrite_builder("long-rewrite-8k")
        ),
    )
}
MIXED = ("reasoning", "long-gen", "long-context")  # what workloads:held-in / held-out interleave


def parse_source(key: str) -> tuple[str, str]:
    """``long-gen`` -> (``long-gen``, ``held-out``); ``reasoning:held-in`` -> (``reasoning``, ``held-in``)."""
    name, _, part = key.strip().lower().partition(":")
    part = part or "held-out"
    if name not in WORKLOADS and name != MIX:
        raise PromptSourceError(f"unknown workload {name!r}; workloads: {', '.join(WORKLOADS)}, {MIX}")
    if part not in PARTS or (name == MIX and part == "all"):
        raise PromptSourceError(f"unknown part {part!r} of {name!r}; use one of {', '.join(PARTS)}")
    return name, part


def is_workload_source(key: str) -> bool:
    """Whether ``key`` names a workload (possibly with a part; the part is checked when it is loaded)."""
    name = key.strip().lower().partition(":")[0]
    return name in WORKLOADS or name == MIX


@functools.lru_cache(maxsize=8)
def _built(name: str, cache_dir: Path) -> tuple[tuple[Prompt, ...], Split]:
    prompts, grouping = WORKLOADS[name].build(cache_dir)
    return tuple(prompts), split_prompts(prompts, HELD_OUT_FRACTION, SPLIT_SEED, grouping)


def workload_split(name: str, cache_dir: PathLike | None = None) -> Split:
    """The held-in and held-out prompts of workload ``name`` (cached per process)."""
    if name not in WORKLOADS:
        raise PromptSourceError(f"unknown workload {name!r}; workloads: {', '.join(WORKLOADS)}")
    return _built(name, resolve_cache_dir(cache_dir))[1]


def load_workload(key: str, cache_dir: PathLike | None = None) -> list[Prompt]:
    """The prompts a workload source name stands for (see the module docstring), in a fixed order."""
    name, part = parse_source(key)
    if name == MIX:
        return interleave([load_workload(f"{workload}:{part}", cache_dir) for workload in MIXED])
    if part == "all":
        return list(_built(name, resolve_cache_dir(cache_dir))[0])
    split = workload_split(name, cache_dir)
    return list(split.held_in if part == "held-in" else split.held_out)


register_source_family(SourceFamily(tuple(WORKLOADS), is_workload_source, load_workload))
