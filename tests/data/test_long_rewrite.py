"""Tests for sglang_tts.data.long_rewrite: the at-length workload's manifest, selection and prompts."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from sglang_tts.data import long_rewrite
from sglang_tts.data.long_context import Selection, TokenCounter, read_manifest, select_files, size_bin


def test_manifest_has_two_full_bins_of_whole_file_rewrites_disjoint_from_long_context() -> None:
    manifest = long_rewrite.read_manifest()
    assert manifest.bins == long_rewrite.BINS
    assert Counter(size_bin(f.tokens, manifest.bins) for f in manifest.files) == {0: 16, 1: 16}
    assert all(4500 <= f.tokens <= 16000 for f in manifest.files)
    assert {f.instruction for f in manifest.files} == set(long_rewrite.WHOLE_FILE)
    assert not {f.path for f in manifest.files} & {f.path for f in read_manifest().files}
    assert len({f.path for f in manifest.files}) == 32


def test_prompts_ask_for_the_whole_file_back_one_workload_per_bin() -> None:
    short, long = (long_rewrite.long_rewrite_prompts(name) for name in long_rewrite.DATASETS)
    assert len(short) == len(long) == 16
    assert {p.dataset for p in short} == {"long-rewrite-4k"} and {p.dataset for p in long} == {"long-rewrite-8k"}
    prompts = short + long
    uuid = next(p for p in prompts if p.id == "long-rewrite-4k-uuid")
    assert "Here is the file `uuid.py`" in uuid.question and "Return the whole rewritten file" in uuid.question
    assert all(p.self_contained for p in prompts)


def test_selection_leaves_out_excluded_files_and_uses_its_bins(tmp_path: Path) -> None:
    for name, lines in {"a.py": 50, "b.py": 60, "c.py": 200, "d.py": 210, "e.py": 220}.items():
        (tmp_path / name).write_text("x = 1\n" * lines)
    lines = TokenCounter("lines", lambda text: text.count("\n"))
    instructions = long_rewrite.selection().instructions
    chosen = Selection(((40, 100), (150, 300)), 2, instructions, frozenset({"e.py"}))
    manifest = select_files(tmp_path, lines, seed=1, selection=chosen)
    assert manifest.bins == ((40, 100), (150, 300))
    assert sorted(f.path for f in manifest.files) == ["a.py", "b.py", "c.py", "d.py"]
    assert [i.name for i in instructions] == list(long_rewrite.WHOLE_FILE)
