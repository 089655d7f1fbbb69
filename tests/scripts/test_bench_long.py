"""scripts/bench_long.py --smoke end to end: real SGLang servers (one at a time) on tiny models, the run
stopped by SIGTERM after three requests and resumed.

The smoke run serves the loopy tiny Llama with random EAGLE-3 and DFlash drafters, frozen and TTS at
stride 1, two chat prompts through the openai client, 256 greedy tokens each. The frozen drafters
accept almost nothing; TTS learns the target's cycle within the request. The first session stops
after eagle3:frozen's two requests and eagle3:tts-s1's first (SGLANG_TTS_BENCH_TERM_AFTER=3); the
second (``--resume --run smoke``) sends the other five: five server starts in all, where an
uninterrupted run makes four.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from scripts_testing import load_script

REPO = Path(__file__).resolve().parents[2]
CONFIGS = ["eagle3:frozen", "eagle3:tts-s1", "dflash:frozen", "dflash:tts-s1"]
PLOTS = ["acceptance_by_position", "acceptance_by_dataset", "stride_sweep", "throughput"]
STOP_AFTER = 3


@dataclass
class SmokeSessions:
    run_dir: Path
    first_journal: bytes  # requests.jsonl when the first session had stopped
    first_logs: list[Path]  # its server logs
    first_stderr: str
    second_stderr: str


def _bench(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "scripts/bench_long.py", *args]
    return subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=1400, env={**os.environ, **(env or {})}
    )


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def smoke_sessions(tmp_path_factory) -> SmokeSessions:
    out = tmp_path_factory.mktemp("bench-smoke")
    run_dir = out / "smoke"
    session = ["--out", str(out), "--run", "smoke", "-q"]
    first = _bench(["--smoke", *session, "--smoke-dir", str(out / "models")], {"SGLANG_TTS_BENCH_TERM_AFTER": "3"})
    assert first.returncode == 130, f"stdout:\n{first.stdout[-4000:]}\nstderr:\n{first.stderr[-6000:]}"
    logs = sorted((run_dir / "server_logs").glob("sglang-*.log"))
    # Stopped by SIGTERM: the runner stopped its server on the way out.
    assert len(logs) == 2 and not any(_listening(int(log.name.split("-")[1])) for log in logs)
    journal = (run_dir / "requests.jsonl").read_bytes()
    second = _bench(["--resume", *session])  # the saved plan: no plan flags repeated
    assert second.returncode == 0, f"stdout:\n{second.stdout[-4000:]}\nstderr:\n{second.stderr[-6000:]}"
    assert "results: " in second.stdout and "FAILED" not in second.stdout
    return SmokeSessions(run_dir, journal, logs, first.stderr, second.stderr)


@pytest.fixture(scope="module")
def smoke_run(smoke_sessions) -> Path:
    return smoke_sessions.run_dir


def test_every_configuration_ran_every_prompt(smoke_run):
    data = json.loads((smoke_run / "results.json").read_text())
    assert [c["name"] for c in data["configs"]] == CONFIGS
    assert data["settings"]["kv_pool_tokens"] == 8192  # two short prompts, one at a time: the CPU default
    launch = (smoke_run / "server_logs").glob("sglang-*.log")
    assert any("max_total_num_tokens=8192," in log.read_text(errors="replace") for log in launch)
    assert all(not log.get("error") for log in data["schedule"])
    requests = data["requests"]
    assert sorted((r["config"], r["prompt_id"]) for r in requests) == sorted(
        (c, p) for c in CONFIGS for p in ("count-0", "story-0")
    )
    for r in requests:
        assert r["completion_tokens"] == 256 and r["sampling"] == "greedy" and r["wall_s"] > 0
        # the accept lengths cover the output: every token but the prefill one comes from a round
        # (the last round may accept past the limit; SGLang truncates the output, not the count)
        assert 255 <= sum(r["accept_lengths"]) <= 258 and len(r["accept_lengths"]) == r["spec_verify_ct"]
        assert all(1 <= n <= 4 for n in r["accept_lengths"])
        if r["config"].endswith("frozen"):
            assert r["tts_num_updates"] == 0
        else:
            # stride 1: about one update per round (rounds with nothing to learn from may be skipped)
            assert r["tts_num_updates"] > len(r["accept_lengths"]) // 2 and r["tts_update_ms"] > 0


def test_tts_accepts_more_than_frozen_and_outputs_agree(smoke_run):
    data = json.loads((smoke_run / "results.json").read_text())
    aggregates = data["aggregates"]["greedy"]
    summaries = {(s["config"], s["dataset"]): s for s in aggregates["summaries"]}
    assert aggregates["datasets"] == ["smoke-count", "smoke-story"]
    for kind in ("eagle3", "dflash"):
        frozen, tts = summaries[(f"{kind}:frozen", "all")], summaries[(f"{kind}:tts-s1", "all")]
        assert 1.0 <= frozen["accept_mean"] < 1.5  # random drafters accept almost nothing
        assert tts["accept_second_half"] > frozen["accept_second_half"] + 0.15
        assert tts["tokens_per_s"] > 0 and frozen["tokens_per_s"] > 0
        comparison = next(
            c for c in aggregates["comparisons"] if c["config"] == f"{kind}:tts-s1" and c["dataset"] == "all"
        )
        assert comparison["accept_gain_pct"] > 5
        assert [b["start"] for b in tts["buckets"]] == list(range(0, 256, 32))
    assert aggregates["best_tts"] == {"eagle3": "eagle3:tts-s1", "dflash": "dflash:tts-s1"}
    # Greedy speculative decoding is lossless: every configuration wrote the same text.
    assert aggregates["output_agreement"] == {"prompts": 2, "differing": []}
    # Every request's text was scored for repetition, quarter by quarter.
    assert all(len(r["distinct_ngrams"]) == 4 for r in data["requests"])


def test_the_resumed_run_has_every_request_once_and_sent_none_again(smoke_sessions):
    first, run_dir = smoke_sessions, smoke_sessions.run_dir
    assert "--resume --run smoke" in first.first_stderr  # how to continue, said on the way out
    assert "[bench] resuming smoke: 3 of 8 requests done" in first.second_stderr
    journal = (run_dir / "requests.jsonl").read_bytes()
    assert journal.startswith(first.first_journal)  # appended to, never rewritten
    lines = [json.loads(line) for line in journal.decode().splitlines()]
    units = [(u["config"], u["prompt_ids"][0]) for u in (line["unit"] for line in lines)]
    assert len(units) == len(set(units)) == 8 and len(first.first_journal.splitlines()) == STOP_AFTER
    assert units[:STOP_AFTER] == [
        ("eagle3:frozen", "count-0"),
        ("eagle3:frozen", "story-0"),
        ("eagle3:tts-s1", "count-0"),
    ]
    data = json.loads((run_dir / "results.json").read_text())
    # Every request once, in schedule order; the first session's records as it measured them (not sent again).
    assert data["requests"] == [r for line in lines for r in line["records"]]
    assert [s["requests_done"] for s in data["sessions"]] == [0, STOP_AFTER]
    schedule = [(log["config"], log["session"], log["done_before"]) for log in data["schedule"]]
    assert schedule == [
        ("eagle3:frozen", 0, 0),
        ("eagle3:tts-s1", 0, 0),
        ("eagle3:tts-s1", 1, 1),  # its server started again for its second prompt
        ("dflash:frozen", 1, 0),
        ("dflash:tts-s1", 1, 0),
    ]
    assert all(log["server_start_s"] > 0 for log in data["schedule"])
    assert len(list((run_dir / "server_logs").glob("sglang-*.log"))) == 5  # none for eagle3:frozen again


def test_a_resume_takes_only_the_saved_plan(smoke_run, tmp_path, capsys):
    out = tmp_path / "out"
    (out / "smoke").mkdir(parents=True)
    shutil.copy(smoke_run / "plan.json", out / "smoke" / "plan.json")
    models = str(smoke_run.parent / "models")
    same = ["--smoke", "--smoke-dir", models, "-q", "--out", str(out), "--run", "smoke"]
    for argv, message in [
        ([*same, "--resume", "--max-new-tokens", "128"], "sampling.max_new_tokens: 128 (saved: 256)"),
        ([*same, "--resume", "--configs", "frozen"], "configs: eagle3:frozen dflash:frozen (saved: eagle3:frozen"),
        (same, "already holds a run: continue it with --resume --run smoke"),
        # SmolLM2's 8,192 tokens would not hold an 8K answer either: the tiny target's context is 4,096.
        ([*same[:4], "--max-new-tokens", "4096"], "need a context of 4"),
        (["--resume", "--run", "other", "--out", str(out)], "holds no run to continue"),
        (["--resume"], "--resume needs --run NAME"),
    ]:
        with pytest.raises(SystemExit) as error:
            _script().main(argv)
        assert error.value.code == 2 and message in capsys.readouterr().err, argv
    assert sorted(p.name for p in (out / "smoke").iterdir()) == ["plan.json", "server_logs"]  # nothing run


def test_resume_replays_the_saved_command_with_this_sessions_flags(tmp_path):
    script = _script()
    (tmp_path / "r").mkdir()
    saved = ["scripts/bench_long.py", "--smoke", "--max-new-tokens", "64", "-q", "--run", "r", "--bucket", "8"]
    (tmp_path / "r" / "plan.json").write_text(json.dumps({"format": 1, "plan": {}, "argv": saved}))
    parser = script.build_parser()
    argv = ["x", "--resume", "--run", "r", "--out", str(tmp_path), "--bucket", "16", "--request-timeout", "60"]
    args = script.resumed_args(parser, parser.parse_args(argv[1:]), argv)
    assert (args.smoke, args.max_new_tokens, args.quiet, args.resume) == (True, 64, True, True)
    assert (args.bucket, args.request_timeout, args.out, args.run) == (16, 60.0, tmp_path, "r")
    # A command line with plan flags is taken as it is (and run_suite checks it against the saved plan).
    argv = ["x", "--resume", "--run", "r", "--out", str(tmp_path), "--max-new-tokens", "64"]
    args = script.resumed_args(parser, parser.parse_args(argv[1:]), argv)
    assert (args.smoke, args.max_new_tokens, args.bucket) == (False, 64, None)


def test_extend_replays_the_saved_command_with_more_prompts_and_rounds(tmp_path, capsys):
    script = _script()
    (tmp_path / "r").mkdir()
    saved = ["scripts/bench_long.py", "--smoke", "--num-prompts", "2", "--rounds=2", "-q", "--run", "r"]
    (tmp_path / "r" / "plan.json").write_text(json.dumps({"format": 1, "plan": {}, "argv": saved}))
    parser = script.build_parser()
    argv = ["x", "--resume", "--extend", "--run", "r", "--out", str(tmp_path), "--num-prompts", "4", "--rounds", "4"]
    args = script.resumed_args(parser, parser.parse_args(argv[1:]), argv)
    assert (args.smoke, args.num_prompts, args.rounds, args.quiet, args.extend) == (True, 4, 4, True, True)
    grown = script.extended_argv(saved, args)
    assert grown == ["scripts/bench_long.py", "--smoke", "-q", "--run", "r", "--num-prompts", "4", "--rounds", "4"]
    assert script.build_parser().parse_args(grown[1:]).num_prompts == 4
    for argv, message in [
        (["--resume", "--extend", "--run", "r", "--out", str(tmp_path), "--max-new-tokens", "9"], "not by --max-new"),
        (["--extend", "--run", "r", "--out", str(tmp_path), "--num-prompts", "4"], "use it with --resume"),
    ]:
        with pytest.raises(SystemExit) as error:
            script.main(argv)
        assert error.value.code == 2 and message in capsys.readouterr().err, argv


def test_report_and_plots_are_written(smoke_run):
    report = (smoke_run / "report.md").read_text()
    assert "## Sampling: greedy decoding" in report and "### Acceptance per dataset: frozen vs TTS" in report
    assert "| smoke-count |" in report and "eagle3:tts-s1" in report and "dflash:tts-s1" in report
    for stem in PLOTS:
        png = smoke_run / f"{stem}_greedy.png"
        assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size > 5000
        assert f"]({png.name})" in report


def _script():
    return load_script("bench_long")


def test_from_json_rerenders_without_servers(tmp_path, capsys):
    from sglang_tts.bench.report import write_json
    from sglang_tts.bench.runner import RequestRecord

    records = [
        RequestRecord("eagle3:frozen", "d", "p0", 0, 11, 1.0, accept_lengths=[1] * 10),
        RequestRecord("eagle3:tts-s1", "d", "p0", 0, 11, 0.5, accept_lengths=[2] * 5, tts_num_updates=5),
    ]
    configs = [
        {"name": "eagle3:frozen", "variant": "frozen", "kind": "eagle3"},
        {"name": "eagle3:tts-s1", "variant": "tts", "kind": "eagle3", "stride": 1},
    ]
    payload = {
        "run": "cli",
        "command": "x",
        "machine": {},
        "settings": {"bucket": 4},
        "configs": configs,
        "schedule": [],
        "requests": [r.to_json() for r in records],
    }
    write_json(tmp_path / "results.json", payload)
    assert _script().main(["--from-json", str(tmp_path / "results.json")]) == 0
    out = capsys.readouterr().out
    assert "| all | 1.00 | 2.00 (+100.0%) |" in out and f"results: {tmp_path / 'results.json'}" in out
    assert (tmp_path / "acceptance_by_position_greedy.png").is_file()
    # a reference added on re-rendering: tokens/s as a ratio to it (frozen: 11 tok/s, TTS: 22)
    assert _script().main(["--from-json", str(tmp_path / "results.json"), "--reference", "frozen"]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "| eagle3:tts-s1 | 22.0 (2.00x) | 2.00 |" in report
    with pytest.raises(SystemExit):
        _script().main(["--from-json", str(tmp_path / "results.json"), "--reference", "tts-s9"])
    assert "--reference 'tts-s9' is not one of the configurations" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--smoke", "--configs", "tts-s0"], "stride must be >= 1"),
        (["--base-url", "http://127.0.0.1:9", "--configs", "eagle3:frozen"], "cannot read /server_info"),
        (["--smoke", "--concurrency", "1", "0"], "--concurrency: distinct values >= 1"),
        (["--smoke", "--eagle3-shape", "5,4"], "EAGLE-3 shape '5,4'"),
        (["--smoke", "--configs", "tts-s5-global-r4"], "an adapter rank (-r<R>) only goes with the request"),
    ],
)
def test_bad_arguments_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as error:
        _script().main(argv)
    assert error.value.code == 2 and message in capsys.readouterr().err
