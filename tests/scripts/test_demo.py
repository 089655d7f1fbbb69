"""scripts/demo.py: the shipped drafter by default, the untrained one only on request, and the demo's
table and files, checked end to end on the tiny looping pair (two real servers, frozen and TTS)."""

from __future__ import annotations

import json

import pytest
from scripts_testing import load_script

from sglang_tts.bench.demo import Answer, DemoResult, render
from sglang_tts.drafters.shipped import write_compact


def _demo():
    return load_script("demo", "demo_script")


def _result(frozen_lengths, tts_lengths, text="one two three four five six seven eight nine ten " * 4):
    def answer(variant, lengths, seconds):
        return Answer(variant, text, 1 + sum(lengths), seconds, list(lengths), updates=len(lengths) // 2)

    return DemoResult(
        model="m",
        drafter="d",
        drafter_trained=True,
        question="q",
        max_tokens=64,
        launch_args=[],
        answers={"frozen": answer("frozen", frozen_lengths, 4.0), "TTS": answer("TTS", tts_lengths, 2.0)},
        server_start_s={"frozen": 1.0, "TTS": 1.0},
        repetition=[1.0, 0.9, 0.3, 0.2],
    )


def test_acceptance_is_split_by_the_quarter_each_round_starts_in():
    # 17 tokens: the prefill token, then rounds starting at 1, 5, 9, 13 (4 tokens each)
    answer = Answer("TTS", "", 17, 1.0, [4, 4, 4, 4])
    assert answer.accept_by_quarter() == [4.0, 4.0, 4.0, 4.0]
    answer = Answer("TTS", "", 9, 1.0, [1, 1, 1, 1, 4])  # starts 1, 2, 3, 4, 5 -> quarters 0,0,1,1,2
    assert answer.accept_by_quarter() == [1.0, 1.0, 4.0, None]


def test_render_prints_the_table_the_speedup_and_the_loop_warning():
    text = render(_result([2, 2, 2, 2], [3, 3, 3, 3]))
    lines = text.splitlines()
    frozen = next(line for line in lines if line.startswith("frozen"))
    tts = next(line for line in lines if line.startswith("TTS" + " " * 5))
    assert frozen.split() == ["frozen", "2.00", "2.00", "2.00", "2.00", "2.00"]
    assert tts.split()[:6] == ["TTS", "3.00", "3.00", "3.00", "3.00", "3.00"] and tts.endswith("(+50%)")
    assert "tokens/s: frozen 2.2; TTS 6.5 (2.89x frozen)" in text
    assert "outputs identical: NO (9 and 13 tokens)" in text  # different lengths: not identical
    assert "WARNING: the answer loops" in text
    assert "TTS updates: 2 made" in text


def test_render_adds_no_speculation_and_the_hybrid_with_its_proposers():
    result = _result([2, 2, 2, 2], [3, 3, 3, 3])
    text = "one two three four five six seven eight nine ten " * 4
    result.answers["no-spec"] = Answer("no-spec", text, 9, 3.0, [])
    result.answers["hybrid"] = Answer(
        "hybrid", text, 17, 1.0, [4, 4, 4, 4], suffix_rounds=3, suffix_accepted=9, drafter_rounds=1, drafter_accepted=3
    )
    rendered = render(result)
    hybrid = next(line for line in rendered.splitlines() if line.startswith("TTS+hybrid "))
    assert hybrid.split()[1:6] == ["4.00"] * 5 and hybrid.endswith("(+100%)")
    assert "suffix chains verified in 3 of 4 rounds (3.00 drafted tokens accepted per round)" in rendered
    assert "TTS+hybrid 17.0 (7.56x frozen, 5.67x no speculation)" in rendered
    assert "no speculation 3.0;" in rendered
    assert "outputs identical: NO" in rendered  # the answers differ in length


def test_the_shipped_drafter_is_the_default_and_the_untrained_one_needs_its_flag(tmp_path, monkeypatch, capsys):
    demo = _demo()
    monkeypatch.setenv("SGLANG_TTS_CACHE", str(tmp_path))
    model = tmp_path / "NoSuchModel"
    model.mkdir()
    with pytest.raises(SystemExit):
        demo.main(["--model", str(model)])
    assert "no drafter ships for NoSuchModel" in capsys.readouterr().err


def test_extra_args_may_start_with_dashes():
    demo = _demo()
    given = ["--extra-args", "--tts-sync", "--out", "x"]
    assert demo.attach_extra_args(given) == ["--extra-args=--tts-sync", "--out", "x"]
    assert demo.attach_extra_args(["--extra-args=--tts-lr 1e-3"]) == ["--extra-args=--tts-lr 1e-3"]


@pytest.mark.timeout(900)
def test_the_demo_on_the_tiny_looping_pair_prints_its_table_and_writes_json_and_png(
    tmp_path, loopy_llama, loopy_eagle3, capsys
):
    """Both servers load an fp16-stored drafter (the shipped form); TTS adapts, the outputs are equal."""
    drafter = write_compact(loopy_eagle3, tmp_path / "drafter", {"train_command": "test"})
    out = tmp_path / "out"
    rc = _demo().main(
        [
            "--model", str(loopy_llama), "--drafter", str(drafter), "--max-tokens", "96", "--out", str(out),
            "--question", "hello there", "--extra-args", "--tts-update-stride 2 --tts-lr 1e-2",
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "tokens per verify round (bonus included), by quarter of the output:" in printed
    assert "outputs identical: yes" in printed
    payload = json.loads((out / "demo.json").read_text())
    frozen, tts = payload["answers"]["frozen"], payload["answers"]["TTS"]
    plain, hybrid = payload["answers"]["no-spec"], payload["answers"]["hybrid"]
    assert payload["identical"] and frozen["text"] == tts["text"] == plain["text"] == hybrid["text"]
    assert frozen["updates"] == 0 and tts["updates"] > 0 and hybrid["updates"] > 0
    assert plain["accept_lengths"] == [] and hybrid["suffix_rounds"] > 0  # the tiny pair's answer loops
    assert hybrid["suffix_rounds"] + hybrid["drafter_rounds"] == len(hybrid["accept_lengths"])
    assert len(tts["accept_by_quarter"]) == 4 and tts["tokens_per_s"] > 0
    # the prefill emits the first token; the last round may run past max_tokens (SGLang trims the output)
    assert tts["completion_tokens"] - 1 <= sum(tts["accept_lengths"]) <= tts["completion_tokens"] + 3
    assert payload["table"] in printed
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "demo.md").read_text()
    assert payload["table"] in report and "--max-tokens 96" in report and tts["text"] in report
