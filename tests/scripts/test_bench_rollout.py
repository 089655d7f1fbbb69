"""scripts/bench_rollout.py --smoke --drift end to end: real SGLang servers (one at a time) on the tiny models.

Two RL steps of 2 prompts x 2 samples (48 tokens at temperature 1), the same prompts in both steps
(--same-prompts), step 1 on a drifted copy of the loopy tiny target loaded with /update_weights_from_disk;
no speculation, and TTS with one global drafter kept or reset at the update; a seed per sample
(--sampling-seed), so every configuration samples the same answers. Then the run is interrupted by
hand (one step's results removed) and continued with --run, and re-rendered with --from-json.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from scripts_testing import load_script

REPO = Path(__file__).resolve().parents[2]
CONFIGS = ["no-spec", "eagle3:tts-s1-global+keep", "eagle3:tts-s1-global+reset"]
PLOTS = ["makespan.png", "tokens_per_round_by_position.png", "tokens_per_round_by_step.png"]


def _command(out: Path) -> list[str]:
    cmd = [sys.executable, "scripts/bench_rollout.py", "--smoke", "--drift", "--same-prompts", "-q", "--out", str(out)]
    cmd += ["--sampling-seed", "0"]
    return [
        *cmd,
        "--run",
        "smoke",
        "--smoke-dir",
        str(out / "models"),
        "--configs",
        "no-spec",
        "tts-s1-global+keep",
        "tts-s1-global+reset",
    ]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
    assert "results: " in proc.stdout and "FAILED" not in proc.stdout
    return proc


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("rollout-smoke")
    cmd = _command(out)
    _run(cmd)
    results = out / "smoke" / "results.json"
    first = json.loads(results.read_text())
    # Interrupt it by hand: no-spec's step 1 never finished.
    cut = dict(first)
    cut["log"] = [log for log in first["log"] if (log["config"], log["step"]) != ("no-spec", 1)]
    cut["samples"] = [s for s in first["samples"] if (s["config"], s["step"]) != ("no-spec", 1)]
    results.write_text(json.dumps(cut))
    resumed = _run(cmd)
    return {"dir": out / "smoke", "first": first, "resumed": json.loads(results.read_text()), "log": resumed.stderr}


def test_every_configuration_ran_every_step_with_grouped_samples(smoke_run):
    data = smoke_run["first"]
    assert [c["name"] for c in data["configs"]] == CONFIGS
    assert [c["server_args"][-2:] for c in data["configs"][1:]] == [
        ["--tts-on-target-update", "keep"],
        ["--tts-on-target-update", "reset"],
    ]
    assert [(log["config"], log["step"], log["finished"], log["error"]) for log in data["log"]] == [
        (c, k, True, None) for c in CONFIGS for k in (0, 1)
    ]
    assert [log["server_start_s"] is not None for log in data["log"]] == [True, False] * 3
    samples = data["samples"]
    assert sorted((s["config"], s["step"], s["group"], s["sample"]) for s in samples) == sorted(
        (c, k, f"{k}-{p}", j)
        for c in CONFIGS
        for k, ps in ((0, ("count-0", "story-0")), (1, ("count-0", "story-0")))  # --same-prompts
        for p in ps
        for j in (0, 1)
    )
    for s in samples:
        assert s["completion_tokens"] == 48 and s["sampling"] == "t1" and 0 < s["wall_s"] <= s["wave_wall_s"]
        assert s["concurrency"] == 4 and len(s["distinct_ngrams"]) == 4
        if s["config"] == "no-spec":
            assert s["accept_lengths"] is None and s["tts_num_updates"] is None
        else:
            # the per-round lengths cover the output (every token but the prefill one), one per verify round
            assert 47 <= sum(s["accept_lengths"]) <= 50 and len(s["accept_lengths"]) == s["spec_verify_ct"]
            assert s["tts_num_updates"] > 0  # stride 1, a shared (global) drafter
    steps = {(s["config"], s["step"]): s for s in data["aggregates"]["steps"]}
    for c in CONFIGS:
        for k in (0, 1):
            summary = steps[(c, k)]
            assert summary["makespan_s"] > 0 and summary["counts"]["samples"] == 4
            assert summary["tokens_per_s"] == pytest.approx(4 * 48 / summary["makespan_s"])
            if c != "no-spec":
                assert summary["counts"]["tokens_per_round"] >= 1.0 and summary["speedup_vs_no_spec"] > 0
    # seeded: every configuration wrote the same text for each sample (TTS adapting, the weights changed at
    # step 1), while the two samples of a prompt differ
    digests: dict[tuple, set] = {}
    for s in samples:
        digests.setdefault((s["step"], s["group"], s["sample"]), set()).add(s["output_digest"])
    assert len(digests) == 8 and all(len(d) == 1 for d in digests.values())
    assert all(digests[(k, g, 0)] != digests[(k, g, 1)] for k, g, _ in digests)
    assert (
        "every configuration wrote the same text for each of the 8 samples they share"
        in (smoke_run["dir"] / "report.md").read_text()
    )
    # the change ratio: step 1's tokens per round over step 0's (the weights changed at step 1)
    keep0, keep1 = steps[(CONFIGS[1], 0)], steps[(CONFIGS[1], 1)]
    ratio = keep1["counts"]["tokens_per_round"] / keep0["counts"]["tokens_per_round"]
    assert keep1["change_ratio"] == pytest.approx(ratio) and keep0["change_ratio"] is None


def test_the_drift_step_loaded_new_weights_into_every_server(smoke_run):
    data = smoke_run["first"]
    drifted = data["steps"][1]["weights_path"]
    assert (Path(drifted) / "config.json").is_file() and (Path(drifted) / "model.safetensors").is_file()
    assert [s["weights"] for s in data["steps"]] == ["launch", "loopy-llama-drift1"]
    logs = {(log["config"], log["step"]): log for log in data["log"]}
    for c in CONFIGS:
        before, after = logs[(c, 0)], logs[(c, 1)]
        assert before["update"] is None
        assert after["update"]["success"] is True and after["update"]["model_path"] == drifted
        if c != "no-spec":  # TTS's weight sync answered: the target only, the drafter kept or reset per the flag
            action = "kept" if c.endswith("+keep") else "reset to base"
            assert f"the TTS drafter keeps its own weights ({action})" in after["update"]["message"]
        # the server's greedy output of the same prompt changed with the weights ...
        assert before["probe"]["output_ids"] != after["probe"]["output_ids"]
        assert len(before["probe"]["output_ids"]) == 16
        assert after["probe"]["weight_version"] == "loopy-llama-drift1"
        # ... and equals every other configuration's on the same weights (greedy speculation is lossless)
        assert before["probe"]["digest"] == logs[(CONFIGS[0], 0)]["probe"]["digest"]
        assert after["probe"]["digest"] == logs[(CONFIGS[0], 1)]["probe"]["digest"]
    versions = {(s["config"], s["step"], s["weight_version"]) for s in data["samples"]}
    assert {v for c, k, v in versions if k == 1} == {"loopy-llama-drift1"}
    assert "loopy-llama-drift1" not in {v for c, k, v in versions if k == 0}


def test_an_interrupted_run_continues_where_it_stopped(smoke_run):
    first, resumed = smoke_run["first"], smoke_run["resumed"]
    assert "1 (configuration, step) pairs to run, 5 kept" in smoke_run["log"]
    assert len(resumed["sessions"]) == 2
    assert [(log["config"], log["step"]) for log in resumed["log"]][-1] == ("no-spec", 1)
    rerun = resumed["log"][-1]
    assert rerun["finished"] and rerun["resumed"] and rerun["server_start_s"] is not None
    # a fresh server on the launch weights, updated to the drifted ones: the same greedy probe as before
    assert rerun["update"]["success"] and rerun["probe"]["digest"] == first["log"][1]["probe"]["digest"]
    # the kept pairs' samples are the very same records; the rerun step has its 4 new ones
    key = lambda s: (s["config"], s["step"], s["group"], s["sample"])  # noqa: E731
    kept = {key(s): s for s in resumed["samples"] if (s["config"], s["step"]) != ("no-spec", 1)}
    assert kept == {key(s): s for s in first["samples"] if (s["config"], s["step"]) != ("no-spec", 1)}
    assert len(resumed["samples"]) == len(first["samples"]) == 24
    # seeded: the rerun step sampled the very same answers on its fresh server
    digest = lambda samples: {key(s): s["output_digest"] for s in samples if (s["config"], s["step"]) == ("no-spec", 1)}  # noqa: E731
    assert digest(resumed["samples"]) == digest(first["samples"]) and len(digest(first["samples"])) == 4


def test_report_and_plots_are_written_and_rerendered(smoke_run, capsys):
    run_dir = smoke_run["dir"]
    report = (run_dir / "report.md").read_text()
    assert "# RL rollout benchmark (policy drift): smoke" in report
    assert "## Policy drift: tokens per round per step" in report and "| step 1 (loopy-llama-drift1) |" in report
    assert "every configuration wrote the same output at every step" in report
    assert "Resumed on a fresh server" in report and "no-spec at step 1" in report
    for name in PLOTS:
        png = run_dir / name
        assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size > 5000
        assert f"]({name})" in report
    script = load_script("bench_rollout")
    assert script.main(["--from-json", str(run_dir / "results.json"), "--bucket", "8"]) == 0
    assert "buckets of 8)" in capsys.readouterr().out
    assert json.loads((run_dir / "results.json").read_text())["aggregates"]["bucket"] == 8


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--smoke", "--drift", "--configs", "stock"], "the stale drafter under drift is `frozen`"),
        (["--smoke", "--configs", "tts-s0"], "stride must be >= 1"),
        (["--base-url", "http://127.0.0.1:9"], "cannot read /server_info"),
        (["--from-json", "/nonexistent/results.json"], "cannot read it"),
    ],
)
def test_bad_arguments_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as error:
        load_script("bench_rollout").main(argv)
    assert error.value.code == 2 and message in capsys.readouterr().err
