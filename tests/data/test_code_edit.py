"""Tests for sglang_tts.data.code_edit: training-only code-editing prompts over stdlib functions and classes."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from sglang_tts.data import load_prompts
from sglang_tts.data.code_edit import (
    DATASET,
    MAX_PER_FILE,
    MAX_TOKENS,
    MIN_TOKENS,
    file_segments,
    render_prompt,
    select_segments,
)
from sglang_tts.data.long_context import INSTRUCTIONS, TokenCounter, read_manifest

WORDS = TokenCounter("words", lambda text: len(text.split()))  # a stand-in tokenizer: one token per word


def _function(name: str, words: int) -> str:
    """A function of ``words`` or ``words + 1`` words: "def", "name(x):", "return" and x + x + ... ."""
    body = " + ".join(["x"] * ((words - 1) // 2))
    return f"def {name}(x):\n    return {body}\n"


def _write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_segments_are_top_level_functions_and_classes_with_their_decorators() -> None:
    source = (
        "import os\n\nX = 1\n\n"
        "@decorator\ndef first(a):\n    def inner():\n        pass\n    return a\n\n"
        "class Second(Base):\n    def method(self):\n        return 2\n\n"
        "async def third():\n    await thing()\n"
    )
    segments = file_segments("pkg/mod.py", source)
    assert [(s.name, s.kind) for s in segments] == [("first", "function"), ("Second", "class"), ("third", "function")]
    assert segments[0].text.startswith("@decorator\ndef first(a):") and segments[0].text.endswith("return a")
    assert "def method" in segments[1].text and "X = 1" not in "".join(s.text for s in segments)
    assert segments[0].id == f"{DATASET}-pkg.mod.first"
    assert file_segments("bad.py", "def broken(:\n") == []


def test_selection_skips_excluded_files_tests_and_sizes_and_caps_each_file(tmp_path: Path) -> None:
    fits = [_function(f"f{i}", MIN_TOKENS + 10 * i) for i in range(4)]
    _write(tmp_path, "alpha.py", "\n".join(fits))  # 4 fitting functions: at most MAX_PER_FILE are taken
    _write(tmp_path, "beta/core.py", fits[0] + "\n" + _function("small", MIN_TOKENS // 2))
    _write(tmp_path, "beta/huge.py", _function("big", MAX_TOKENS + 50))
    _write(tmp_path, "workload.py", fits[1])  # a long-context workload file: never used
    _write(tmp_path, "tests/test_alpha.py", fits[2])  # tests are not candidates
    chosen = select_segments(tmp_path, WORDS, frozenset({"workload.py"}))
    assert Counter(s.path for s, _ in chosen) == {"alpha.py": MAX_PER_FILE, "beta/core.py": 1}
    assert all(MIN_TOKENS <= WORDS.count(s.text) <= MAX_TOKENS for s, _ in chosen)
    # Instructions go round in the selection order; the order is seeded and deterministic.
    assert [i for _, i in chosen] == [INSTRUCTIONS[k % len(INSTRUCTIONS)] for k in range(len(chosen))]
    assert chosen == select_segments(tmp_path, WORDS, frozenset({"workload.py"}))
    # The prompt: where the segment comes from, the segment in a code block, then its instruction.
    segment, instruction = chosen[0]
    text = render_prompt(segment, instruction)
    assert text.startswith(f"Here is the function `{segment.name}` from `{segment.path}`")
    assert f"```python\n{segment.text.rstrip()}\n```\n\n{instruction.text}" in text


def test_the_real_source_uses_no_workload_file() -> None:
    prompts = load_prompts("code-edit")
    assert len(prompts) > 300  # enough to add a few hundred training prompts
    assert len({p.id for p in prompts}) == len(prompts)
    workload_paths = {f.path for f in read_manifest().files}
    for prompt in prompts:
        path = prompt.question.split("` from `", 1)[1].split("`", 1)[0]
        assert path not in workload_paths
    assert load_prompts("code-edit", 5, seed=0) == load_prompts("code-edit", 5, seed=0)
