"""Saving each finished request as it comes, and resuming an interrupted benchmark run (sglang_tts.bench.suite,
runner): the append-only requests.jsonl and its torn last line, the refusal of another plan, which units run
again, and that a resumed run ends with every request exactly once, in an uninterrupted run's order."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sglang_tts.bench import server as server_module
from sglang_tts.bench.configs import BenchConfig, ConfigError, build_configs
from sglang_tts.bench.metrics import aggregate_by_sampling
from sglang_tts.bench.runner import (
    RequestRecord,
    Runner,
    RunnerSettings,
    SamplingSettings,
    Unit,
    plan_schedule,
)
from sglang_tts.bench.suite import (
    PLAN,
    REQUESTS,
    RESULTS,
    BenchPlan,
    Journal,
    plan_differences,
    plan_identity,
    run_suite,
)
from sglang_tts.bench.workload import BenchPrompt

PROMPTS = [BenchPrompt(f"p{i}", "d", messages=({"role": "user", "content": f"q{i}"},)) for i in range(3)]
META = {
    "completion_tokens": 8,
    "spec_accept_length": 2.33,
    "spec_verify_ct": 3,
    "tts_accept_lengths": [1, 3, 3],
    "tts_num_updates": 3,
    "tts_num_skipped_updates": 0,
    "tts_update_ms": 12.5,
    "finish_reason": {"type": "length", "length": 8},
}


def _record(config: str, prompt: str, wall_s: float = 1.0, sampling: str = "greedy") -> RequestRecord:
    return RequestRecord(config, "d", prompt, 0, 8, wall_s, sampling, accept_lengths=[1, 3, 3])


class _Fake(BaseHTTPRequestHandler):
    """Every launched server at once: /<server>/v1/chat/completions answers like SGLang with meta_info and
    logs (server, prompt text, max_tokens)."""

    sent: list[tuple[str, str, int]] = []

    def do_POST(self):  # noqa: N802 - BaseHTTPRequestHandler's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Fake.sent.append((self.path.split("/")[1], body["messages"][0]["content"], body["max_tokens"]))
        reply = {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "w1 w2 w3 w4 w5 w6 w7 w8"},
                    "finish_reason": "length",
                    "meta_info": META,
                }
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13},
        }
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@dataclass
class _FakeProcess:
    base_url: str

    def log_tail(self, n: int = 60) -> str:
        return ""


class _Launches(list):
    """The configurations whose servers were started, in order; those in ``failing`` fail to start."""

    failing: set[str]


@pytest.fixture
def servers(monkeypatch):
    """Fake launches: start_server hands out a path of one local HTTP server per configuration; yields the
    list of configurations started, in order."""
    http = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    started = _Launches()
    started.failing = set()
    _Fake.sent = []

    def start(model, server_args, **kwargs):
        assert kwargs["die_with_parent"] is True  # a killed benchmark leaves no server running
        name = server_args[server_args.index("--name") + 1]
        started.append(name)
        if name in started.failing:
            raise RuntimeError(f"{name} did not start")
        return _FakeProcess(f"http://127.0.0.1:{http.server_address[1]}/{name}")

    monkeypatch.setattr(server_module, "start_server", start)
    monkeypatch.setattr(server_module, "stop_server", lambda process: None)
    try:
        yield started
    finally:
        http.shutdown()


def _configs() -> list[BenchConfig]:
    configs = build_configs(["frozen", "tts-s1"], ["eagle3"], {"eagle3": "/e"})
    # Tag each with its name, for the fake launcher.
    return [BenchConfig.from_json({**c.to_json(), "server_args": [*c.server_args, "--name", c.name]}) for c in configs]


def _plan(run_dir: Path, max_new_tokens: int = 8, concurrencies=(1, 2)) -> BenchPlan:
    settings = RunnerSettings(
        model="m",
        sampling=SamplingSettings(max_new_tokens=max_new_tokens),
        concurrencies=tuple(concurrencies),
        warmup_tokens=2,
        cpu_defaults=False,
    )
    return BenchPlan(run_dir, ["bench_long.py"], _configs(), PROMPTS, settings, rounds=1, bucket=4, progress=False)


def _stop_after(count: int):
    seen = []

    def hook(unit: Unit, records: list[RequestRecord]) -> None:
        seen.append(unit)
        if len(seen) == count:
            raise KeyboardInterrupt

    return hook


def _journal_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / REQUESTS).read_text().splitlines()]


def _measured(sent: list[tuple[str, str, int]]) -> list[tuple[str, str]]:
    """The recorded requests sent (a server's warm-up asks for 2 tokens, a wave's prompt warm-up for 1)."""
    return [(server, prompt) for server, prompt, max_tokens in sent if max_tokens not in (1, 2)]


# ----------------------------------------------------------------------------------------------------------
# requests.jsonl
# ----------------------------------------------------------------------------------------------------------


def test_the_journal_keeps_whole_units_and_cuts_a_torn_last_line(tmp_path):
    journal = Journal(tmp_path / REQUESTS)
    single = Unit("a", 0, "greedy", 1, 0, ("p0",))
    wave = Unit("a", 0, "greedy-c2", 2, 0, ("p1", "p0"))
    pair = [_record("a", "p1", 2.0, "greedy-c2"), _record("a", "p0", 2.0, "greedy-c2")]
    journal.append(single, [_record("a", "p0")])
    journal.append(wave, pair)
    assert journal.load() == ({single: [_record("a", "p0")], wave: pair}, [])
    whole = journal.path.read_bytes()

    # A kill mid-write: half of a third line, no newline.
    later = Unit("b", 0, "greedy", 1, 1, ("p1",))
    line = json.dumps({"unit": later.to_json(), "records": [_record("b", "p1").to_json()]}) + "\n"
    with open(journal.path, "ab") as out:
        out.write(line.encode()[: len(line) // 2])
    done, notes = journal.load()
    assert list(done) == [single, wave] and len(notes) == 1 and "torn last line" in notes[0]
    assert journal.path.read_bytes() == whole  # cut off, so the next line starts on its own
    journal.append(later, [_record("b", "p1")])
    done, notes = journal.load()
    assert list(done) == [single, wave, later] and notes == []

    # A damaged line inside the file, a wave missing a record and a unit written twice: dropped, noted.
    lines = journal.path.read_text().splitlines()
    broken_wave = json.dumps({"unit": wave.to_json(), "records": [_record("a", "p1").to_json()]})
    journal.path.write_text("\n".join(["{not json", lines[0], broken_wave, lines[0], lines[2]]) + "\n")
    done, notes = journal.load()
    assert list(done) == [single, later]
    expected = ["line 1: unreadable", "line 3: 1 of 2 records", "line 4: a unit already finished above"]
    assert len(notes) == 3 and all(e in n for e, n in zip(expected, notes))


def test_units_are_requests_or_whole_waves_in_run_order():
    settings = RunnerSettings(model="m", temperatures=(0.0, 0.7), concurrencies=(1, 2))
    (slot,) = plan_schedule(_configs()[:1], PROMPTS[:3], 1)
    units = [p.unit for p in Runner(settings).units(slot)]
    name = "eagle3:frozen"
    assert units == [
        Unit(name, 0, "greedy", 1, 0, ("p0",)),
        Unit(name, 0, "t0.7", 1, 0, ("p0",)),
        Unit(name, 0, "greedy", 1, 1, ("p1",)),
        Unit(name, 0, "t0.7", 1, 1, ("p1",)),
        Unit(name, 0, "greedy", 1, 2, ("p2",)),
        Unit(name, 0, "t0.7", 1, 2, ("p2",)),
        Unit(name, 0, "greedy-c2", 2, 0, ("p0", "p1")),
        Unit(name, 0, "greedy-c2", 2, 1, ("p2", "p0")),  # the list is cycled to fill the wave
        Unit(name, 0, "t0.7-c2", 2, 0, ("p0", "p1")),
        Unit(name, 0, "t0.7-c2", 2, 1, ("p2", "p0")),
    ]
    assert all(Unit.from_json(json.loads(json.dumps(u.to_json()))) == u for u in units)


# ----------------------------------------------------------------------------------------------------------
# The runner: which units run
# ----------------------------------------------------------------------------------------------------------


def test_the_runner_sends_only_unfinished_units_and_starts_servers_only_for_them(servers):
    configs = _configs()
    settings = RunnerSettings(model="m", concurrencies=(1, 2), warmup_tokens=2, cpu_defaults=False)
    schedule = plan_schedule(configs, PROMPTS[:2], 1)
    runner = Runner(settings)
    frozen_units = [p.unit for p in runner.units(schedule[0])]
    tts_units = [p.unit for p in runner.units(schedule[1])]
    # Earlier: frozen finished; TTS finished its first request and its wave, not its second request.
    earlier = [*frozen_units, tts_units[0], tts_units[2]]
    done = {u: [_record(u.config, p, 9.0, u.sampling) for p in u.prompt_ids] for u in earlier}
    saved: list[tuple[Unit, list[RequestRecord]]] = []
    records = runner.run(schedule, progress=False, on_record=lambda u, r: saved.append((u, r)), done=done)
    assert servers == ["eagle3:tts-s1"]  # nothing left for frozen: no server
    assert _measured(_Fake.sent) == [("eagle3:tts-s1", "q1")]
    assert [u for u, _ in saved] == [tts_units[1]]
    # Every unit's records, in the order an uninterrupted run writes them.
    assert [(r.config, r.prompt_id, r.sampling) for r in records] == [
        (u.config, p, u.sampling) for u in [*frozen_units, *tts_units] for p in u.prompt_ids
    ]
    assert records[-3].wall_s != 9.0 and all(r.wall_s == 9.0 for r in records if r is not records[-3])
    (log,) = runner.slot_logs
    assert (log.config, log.done_before) == ("eagle3:tts-s1", 2) and log.warmup_s is not None


def test_a_failing_save_stops_the_run_instead_of_failing_a_configuration(servers):
    def broken(unit: Unit, records: list[RequestRecord]) -> None:
        raise OSError("No space left on device")

    settings = RunnerSettings(model="m", warmup_tokens=0, cpu_defaults=False)
    runner = Runner(settings)
    with pytest.raises(OSError, match="No space left"):
        runner.run(plan_schedule(_configs(), PROMPTS[:2], 1), progress=False, on_record=broken)
    assert _measured(_Fake.sent) == [("eagle3:frozen", "q0")] and runner.slot_logs[0].error is None


# ----------------------------------------------------------------------------------------------------------
# run_suite: interrupt, resume
# ----------------------------------------------------------------------------------------------------------


def test_an_interrupted_run_resumes_with_every_request_once(servers, tmp_path, capsys):
    run_dir = tmp_path / "run"
    # Per configuration: 3 single requests, then 2 waves of 2. Stop after frozen's 5 units and TTS's first.
    with pytest.raises(KeyboardInterrupt):
        run_suite(_plan(run_dir), on_record=_stop_after(6))
    first = _journal_lines(run_dir)
    assert len(first) == 6 and servers == ["eagle3:frozen", "eagle3:tts-s1"]
    interim = json.loads((run_dir / RESULTS).read_text())  # rewritten after every unit
    assert len(interim["requests"]) == 3 + 4 + 1 and interim["aggregates"] is None
    sent_before = len(_measured(_Fake.sent))
    capsys.readouterr()

    result = run_suite(_plan(run_dir), resume=True)
    assert "[bench] resuming run: 8 of 14 requests done" in capsys.readouterr().err
    assert servers == ["eagle3:frozen", "eagle3:tts-s1", "eagle3:tts-s1"]  # frozen had nothing left
    # Only the missing requests were sent: TTS's last two single requests and its two waves.
    again = [prompt for server, prompt in _measured(_Fake.sent)[sent_before:] if server == "eagle3:tts-s1"]
    assert len(again) == len(_measured(_Fake.sent)[sent_before:]) == 6
    # (a wave's requests are sent together: in any order within it)
    assert again[:2] == ["q1", "q2"] and sorted(again[2:4]) == ["q0", "q1"] and sorted(again[4:]) == ["q0", "q2"]
    lines = _journal_lines(run_dir)
    assert lines[:6] == first and len(lines) == 10
    units = [Unit.from_json(line["unit"]) for line in lines]
    assert len(set(units)) == 10

    # results.json: the records in schedule order, the earlier session's untouched, aggregated as they stand.
    data = json.loads(result.results.read_text())
    runner = Runner(_plan(run_dir).runner)
    order = [p.unit for slot in plan_schedule(_configs(), PROMPTS, 1) for p in runner.units(slot)]
    by_unit = {u: line["records"] for u, line in zip(units, lines)}
    expected = [r for u in order for r in by_unit[u]]
    assert data["requests"] == expected and len(expected) == 14
    records = [RequestRecord.from_json(r) for r in expected]
    aggregates = aggregate_by_sampling(records, _configs(), 4)
    assert data["aggregates"] == json.loads(json.dumps({k: a.to_json() for k, a in aggregates.items()}))
    assert [s["requests_done"] for s in data["sessions"]] == [0, 8]
    assert [(log["config"], log["session"], log["done_before"]) for log in data["schedule"]] == [
        ("eagle3:frozen", 0, 0),
        ("eagle3:tts-s1", 0, 0),
        ("eagle3:tts-s1", 1, 1),
    ]
    assert result.failures == [] and (run_dir / "report.md").is_file()


def test_a_resume_runs_a_failed_configuration_again(servers, tmp_path):
    run_dir = tmp_path / "run"
    servers.failing.add("eagle3:tts-s1")
    first = run_suite(_plan(run_dir, concurrencies=(1,)))
    assert first.failures == ["eagle3:tts-s1 (round 0)"] and len(_journal_lines(run_dir)) == 3
    servers.failing.clear()
    second = run_suite(_plan(run_dir, concurrencies=(1,)), resume=True)
    assert second.failures == [] and len(_journal_lines(run_dir)) == 6
    data = json.loads(second.results.read_text())
    assert sorted((r["config"], r["prompt_id"]) for r in data["requests"]) == sorted(
        (c.name, p.id) for c in _configs() for p in PROMPTS
    )
    earlier, again = [log for log in data["schedule"] if log["config"] == "eagle3:tts-s1"]
    assert "error" not in earlier and "did not start" in earlier["error_before_resume"]
    assert again["session"] == 1 and again["error"] is None and again["done_before"] == 0
    assert servers == ["eagle3:frozen", "eagle3:tts-s1", "eagle3:tts-s1"]


def test_a_resume_refuses_another_plan_and_a_new_run_refuses_a_used_folder(servers, tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match="holds no run to continue"):
        run_suite(_plan(run_dir), resume=True)
    with pytest.raises(KeyboardInterrupt):
        run_suite(_plan(run_dir), on_record=_stop_after(1))
    saved = json.loads((run_dir / PLAN).read_text())
    assert saved["plan"]["sampling"]["max_new_tokens"] == 8 and saved["argv"] == ["bench_long.py"]
    with pytest.raises(ConfigError, match="already holds a run: continue it with --resume --run run"):
        run_suite(_plan(run_dir))
    with pytest.raises(ConfigError) as refused:
        run_suite(_plan(run_dir, max_new_tokens=16, concurrencies=(1,)), resume=True)
    message = str(refused.value)
    assert "asks for another plan" in message and "sampling.max_new_tokens: 16 (saved: 8)" in message
    assert "concurrencies: [1] (saved: [1, 2])" in message
    other = _plan(run_dir)
    other.configs = other.configs[:1]
    with pytest.raises(ConfigError, match=r"configs: eagle3:frozen \(saved: eagle3:frozen eagle3:tts-s1\)"):
        run_suite(other, resume=True)
    assert len(_journal_lines(run_dir)) == 1  # nothing was sent or written by the refused attempts
    assert len(_measured(_Fake.sent)) == 1


def test_a_run_resumes_in_another_checkout_with_the_same_shipped_drafter(tmp_path):
    def identity(drafter: str) -> dict:
        plan = _plan(tmp_path / "run")
        plan.configs = build_configs(["frozen"], ["eagle3"], {"eagle3": drafter})
        plan.settings = {"drafters": f"eagle3={drafter}"}
        return plan_identity(plan)

    shipped = "sglang_tts/drafters/shipped/Qwen2.5-Coder-0.5B-Instruct-eagle3"
    saved = identity(f"/work/bench-wt/{shipped}")
    assert plan_differences(saved, identity(f"/home/ci/checkout/{shipped}")) == []
    other = plan_differences(saved, identity(f"/home/ci/checkout/{shipped[:-6]}dflash"))
    assert other[0] == "configs: the launch flags or drafter of eagle3:frozen changed"
    assert other[1].startswith("settings.drafters: 'eagle3=<checkout>/sglang_tts/drafters/shipped/Qwen2.5")
    trained = "/root/.cache/sglang_tts/drafters/Qwen2.5-Coder-0.5B-Instruct-eagle3"  # not shipped: by its path
    moved = trained.replace("/root/", "/home/u/")
    assert len(plan_differences(identity(trained), identity(moved))) == 2


def test_prefilling_a_waves_prompts_is_part_of_what_a_run_with_waves_measures(tmp_path):
    waves = _plan(tmp_path / "run", concurrencies=(1, 2))
    saved = plan_identity(waves)
    saved.pop("warm_prompts")  # a plan saved before waves prefilled their prompts
    assert plan_differences(saved, plan_identity(waves)) == ["warm_prompts: True (saved: None)"]
    single = _plan(tmp_path / "run", concurrencies=(1,))
    assert "warm_prompts" not in plan_identity(single)  # no waves: such a plan resumes as it was saved


def test_an_extended_run_adds_prompts_and_sends_only_theirs(servers, tmp_path, capsys):
    run_dir = tmp_path / "run"
    small = _plan(run_dir, concurrencies=(1,))
    small.prompts, small.rounds = PROMPTS[:2], 2
    run_suite(small)
    assert len(_journal_lines(run_dir)) == 4 and len(_measured(_Fake.sent)) == 4
    grown = _plan(run_dir, concurrencies=(1,))
    grown.rounds, grown.argv = 3, ["bench_long.py", "--num-prompts", "3"]
    # A plain resume of the grown plan is refused; so is an extension without resume.
    with pytest.raises(ConfigError, match="asks for another plan"):
        run_suite(grown, resume=True)
    with pytest.raises(ConfigError, match="extend needs resume"):
        run_suite(grown, extend=True)
    # The saved prompts must come first and stay in their rounds; the rest of the plan stays.
    reordered = _plan(run_dir, concurrencies=(1,))
    reordered.prompts, reordered.rounds = [PROMPTS[1], PROMPTS[0], PROMPTS[2]], 3
    with pytest.raises(ConfigError, match="keeps the saved prompts first"):
        run_suite(reordered, resume=True, extend=True)
    one_round = _plan(run_dir, concurrencies=(1,))  # 3 prompts in 1 round: p1 moves to round 0
    with pytest.raises(ConfigError, match="2 finished units .* would not be in the grown schedule"):
        run_suite(one_round, resume=True, extend=True)
    longer = _plan(run_dir, max_new_tokens=16, concurrencies=(1,))
    longer.rounds = 3
    with pytest.raises(ConfigError, match=r"more than more prompts and rounds .*\n  sampling.max_new_tokens"):
        run_suite(longer, resume=True, extend=True)
    assert len(_measured(_Fake.sent)) == 4 and len(_journal_lines(run_dir)) == 4  # the refusals sent nothing

    capsys.readouterr()
    result = run_suite(grown, resume=True, extend=True)
    assert "resuming run: 4 of 6 requests done" in capsys.readouterr().err
    assert sorted(_measured(_Fake.sent)[4:]) == [("eagle3:frozen", "q2"), ("eagle3:tts-s1", "q2")]
    data = json.loads(result.results.read_text())
    assert sorted((r["config"], r["prompt_id"]) for r in data["requests"]) == sorted(
        (c.name, p.id) for c in _configs() for p in PROMPTS
    )
    saved = json.loads((run_dir / PLAN).read_text())
    assert [p["id"] for p in saved["plan"]["prompts"]] == ["p0", "p1", "p2"] and saved["plan"]["rounds"] == 3
    assert saved["argv"] == grown.argv  # a later plain resume continues the grown plan
    assert run_suite(grown, resume=True).failures == [] and len(_measured(_Fake.sent)) == 6


def test_a_killed_benchmark_takes_its_server_with_it(tmp_path):
    # The bench process dies by SIGKILL (no cleanup runs): the server it launched must not keep computing.
    code = (
        "import subprocess, sys\n"
        "from sglang_tts.bench import server\n"
        "p = subprocess.Popen(['sleep', '60'], start_new_session=True, preexec_fn=server._kill_when_parent_dies)\n"
        "print(p.pid, flush=True)\n"
        "import time; time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert server_module.group_alive(child)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(timeout=30)
    deadline = time.monotonic() + 10
    while server_module.group_alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not server_module.group_alive(child)
    with contextlib.suppress(ProcessLookupError):
        os.kill(child, signal.SIGKILL)
