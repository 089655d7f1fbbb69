"""The zygote (sglang_tts.bench.forkserver) that the test session forks its CPU servers from: a forked server
serves what a fresh `python -m sglang.launch_server` serves, its SGLang children are forks too, it dies with
the process that asked for it, and what the zygote cannot stand in for is refused and started the usual way."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import psutil
import pytest

from sglang_tts.bench import forkserver
from sglang_tts.bench.server import ServerStartError, group_alive, sglang_server, start_server
from sglang_tts.testing.reference import generate_ids, hf_greedy

IDS = [1, 5, 9, 13, 17, 21]
NEW_TOKENS = 16


@pytest.fixture
def zygote(server_zygote) -> str:
    if server_zygote is None:
        pytest.skip("SGLANG_TTS_TEST_FORKSERVER=0: this session has no zygote")
    path = os.environ[forkserver.ENV]
    assert forkserver.ready(path), "the session's zygote did not come up"
    return path


def test_a_forked_server_serves_what_a_fresh_one_does(zygote, server_zygote, tiny_llama):
    started = time.monotonic()
    with sglang_server(str(tiny_llama)) as forked:
        forked_s = time.monotonic() - started
        assert isinstance(forked.proc, forkserver.ForkedProcess)
        launcher = psutil.Process(forked.proc.pid)
        assert launcher.ppid() == server_zygote.pid
        # SGLang's scheduler and detokenizer, named as SGLang names them (tests find the scheduler by its title)
        titles = {" ".join(child.cmdline()).split()[0] for child in launcher.children()}
        assert {"sglang::scheduler", "sglang::detokenizer"} <= titles, titles
        assert launcher.cmdline()[:3] == ["python", "-m", "sglang.launch_server"]
        from_fork = generate_ids(forked.base_url, IDS, NEW_TOKENS)["output_ids"]
    assert not group_alive(forked.proc.pid)
    # SGLANG_TTS_CPU_SUPPORT is read when the plugin registers, which the zygote did with the variable unset:
    # a server that sets it is refused there and started the usual way (the CPU layer is on either way here).
    started = time.monotonic()
    with sglang_server(str(tiny_llama), env={"SGLANG_TTS_CPU_SUPPORT": "1"}) as fresh:
        fresh_s = time.monotonic() - started
        assert isinstance(fresh.proc, subprocess.Popen)
        from_fresh = generate_ids(fresh.base_url, IDS, NEW_TOKENS)["output_ids"]
    assert from_fork == from_fresh == hf_greedy(str(tiny_llama), IDS, NEW_TOKENS)
    # What the zygote is for: its servers skip the three imports of SGLang (~5 s against ~35 s on 2 cores).
    assert forked_s < fresh_s / 2, (forked_s, fresh_s)


def test_what_the_zygote_cannot_stand_in_for_is_refused(zygote, tmp_path):
    base = {"op": "launch", "args": [], "cwd": str(tmp_path), "log": str(tmp_path / "log"), "owner": os.getpid()}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    refused = forkserver.request(zygote, {**base, "env": {**env, "SGLANG_TTS_CPU_SUPPORT": "0"}})
    assert "SGLANG_TTS_CPU_SUPPORT" in refused["refused"] and "pid" not in refused
    refused = forkserver.request(zygote, {**base, "env": env, "python": "/elsewhere/bin/python"})
    assert "/elsewhere/bin/python" in refused["refused"]
    assert not (tmp_path / "log").exists()  # nothing was forked


def test_a_server_that_fails_to_start_reports_its_exit(zygote, tmp_path):
    with pytest.raises(ServerStartError, match="exited with code"):
        start_server(str(tmp_path / "no-such-model"), timeout_s=60)


def test_a_forked_server_dies_with_the_process_that_asked_for_it(zygote, tiny_llama):
    code = (
        "import sys, time\n"
        "from sglang_tts.bench.server import start_server\n"
        f"server = start_server({str(tiny_llama)!r})\n"
        "print(server.proc.pid, type(server.proc).__name__, flush=True)\n"
        "time.sleep(600)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid, kind = owner.stdout.readline().split()
        assert kind == "ForkedProcess"
        assert group_alive(int(pid))
    finally:
        owner.kill()  # SIGKILL: no cleanup in the owner
        owner.wait()
    deadline = time.monotonic() + 10
    while group_alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(int(pid)), "the forked server outlived its owner"


def test_poll_reports_exit_codes_and_running_servers(zygote, tmp_path):
    # A "server" whose launcher exits at once with SGLang's own argument error (no --model-path): code 2.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    message = {"op": "launch", "args": ["--no-such-flag"], "env": env, "cwd": str(tmp_path)}
    reply = forkserver.request(zygote, {**message, "log": str(tmp_path / "log"), "owner": os.getpid()})
    proc = forkserver.ForkedProcess(zygote, reply["pid"])
    assert proc.wait(timeout=60) == 2
    log = (tmp_path / "log").read_text()
    assert "--model-path" in log and "RuntimeWarning" not in log  # runpy ran sglang.launch_server afresh
    assert forkserver.request(zygote, {"op": "poll", "pid": reply["pid"]}) == {"returncode": 2}


def test_a_dead_zygotes_socket_is_replaced_and_a_live_ones_kept(tmp_path):
    # A zygote started over the socket file of a SIGKILLed one binds it again; over a live one's, it fails.
    path = str(tmp_path / "fs.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(path)  # a socket file nobody listens on: what a SIGKILLed zygote leaves
    forkserver._unlink_stale(path)
    assert not os.path.exists(path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(path)
        live.listen(1)
        forkserver._unlink_stale(path)  # a live one is kept
        assert os.path.exists(path)


def test_running_names_its_zygote_for_the_block_and_stops_it(tmp_path, monkeypatch):
    monkeypatch.setenv(forkserver.ENV, "/an/outer/zygote")
    with forkserver.running(tmp_path / "z") as zygote:
        assert os.environ[forkserver.ENV] == str(tmp_path / "z" / "sock")
        assert zygote.poll() is None  # importing SGLang
    assert os.environ[forkserver.ENV] == "/an/outer/zygote"
    assert zygote.returncode is not None
    assert sorted(p.name for p in (tmp_path / "z").iterdir()) == ["zygote.log"]  # no socket, no pid file
