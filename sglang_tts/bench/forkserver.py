"""A zygote for CPU SGLang servers: a process that has imported SGLang once and forks each server from it.

A CPU server start spends ~30 of its ~35 s importing SGLang three times (the launcher, then the spawned
scheduler and detokenizer: ~14 s of CPU each); the model load and the rest take a few seconds. The test
suite and the benchmark scripts start dozens of servers, so the zygote imports once and every server
forked from it starts in seconds: the launcher is a fork of the zygote, and on CPU (`--device cpu`) so
are SGLang's own children (SGLang asks multiprocessing for "spawn"; here it gets "fork", from a process
that has imported everything and started no thread of its own). On a GPU nothing is forked after
CUDA may have been touched: servers that are not CPU servers are never sent here (`start_server`).

The server forked is `python -m sglang.launch_server ARGS` as a user runs it: the same entry point, the
plugin loaded by SGLang's `load_plugins()` in the launcher, its hooks inherited by the children (SGLang
calls `load_plugins()` again in each child; it is idempotent). Each server gets its own session and
process group (`stop_server` kills the group), its own log file and its own environment (set before
anything of the server runs; modules that read a variable at import time read the zygote's: see
`IMPORT_TIME_ENV`, for which `start_server` does not use the zygote).

Use: `python -m sglang_tts.bench.forkserver --socket PATH` (the tests' conftest starts one per session);
`start_server` sends every CPU server there while `SGLANG_TTS_FORKSERVER=PATH` names a live one.
Protocol: one JSON line per connection, one JSON line back.
  {"op": "launch", "args": [...], "env": {...}, "cwd": "...", "log": "...", "owner": PID, "python": EXE}
    -> {"pid": N}, or {"refused": why} (another interpreter, or an import-time variable that differs)
  (the server is killed when its owner's process is gone)
  {"op": "poll", "pid": N} -> {"returncode": int | null}   (null: still running)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import socket
import sys
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

ENV = "SGLANG_TTS_FORKSERVER"

# Variables read when a module is imported, i.e. in the zygote, not in the forked server: the zygote refuses a
# server asked for with a value different from its own, and start_server starts that one the usual way.
# The plugin's registration (load_plugins(), once, in the zygote) reads some too.
IMPORT_TIME_ENV = (
    "SGLANG_TTS_CPU_SUPPORT",
    "SGLANG_TTS_CPU_ROUND_TIMING",
    "SGLANG_TTS_SKIP_COMPAT_CHECK",
    "SGLANG_USE_CPU_ENGINE",
    "SGLANG_PLATFORM",
    "TRITON_INTERPRET",
    "PYTHONPATH",
)

# The modules a CPU server's three processes import (launcher, scheduler, detokenizer); not
# sglang.launch_server itself, which each server runs as __main__ (its own imports are among these).
PRELOAD = (
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
)

_PR_SET_PDEATHSIG = 1
_EXITED_KEPT = 256  # exit codes kept for polling; older ones are dropped (bounded)


def _die_with_parent() -> None:
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _fork_children() -> None:
    """SGLang forces multiprocessing's "spawn"; a CPU server forked from the zygote forks its children."""
    import multiprocessing

    real = multiprocessing.set_start_method

    def set_start_method(method: str | None, force: bool = False) -> None:
        real("fork", force=True)

    multiprocessing.set_start_method = set_start_method  # type: ignore[assignment]
    real("fork", force=True)


def _set_title(title: str) -> None:
    """The process title `ps` shows (SGLang names its children the same way). The zygote sets one first of
    all, while the C `environ` still sits after argv: setproctitle finds argv's memory from there, and
    cannot once `os.environ` has been rewritten (as each forked server does), which would leave SGLang's
    own titles ("sglang::scheduler") unset in every forked server."""
    try:
        import setproctitle
    except ImportError:  # SGLang depends on it; without it titles are only cosmetic
        return
    setproctitle.setproctitle(title)


def _run_server(request: dict[str, Any], plugin_env: dict[str, str]) -> None:
    """In the forked child: become the server `python -m sglang.launch_server ARGS`; never returns."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the zygote's handler
        os.setsid()
        _die_with_parent()
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.chdir(request["cwd"])
        _set_title(" ".join(["python", "-m", "sglang.launch_server", *request["args"]]))
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.update(plugin_env)  # what load_plugins() set in the zygote (the CPU layer's variables)
        _fork_children()
        import runpy

        sys.argv = ["sglang.launch_server", *request["args"]]
        runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reap(exited: OrderedDict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        exited[pid] = os.waitstatus_to_exitcode(status)
        while len(exited) > _EXITED_KEPT:
            exited.popitem(last=False)


def _kill_orphans(owners: dict[int, int], exited: OrderedDict[int, int]) -> None:
    """A server dies with the process that asked for it, as a Popen'd one with die_with_parent would."""
    for pid, owner in list(owners.items()):
        if pid in exited:
            del owners[pid]
            continue
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            del owners[pid]


def serve(path: str) -> None:
    """The zygote's loop: import SGLang, then answer launch and poll requests on the Unix socket `path`."""
    import importlib

    _set_title(f"python -m sglang_tts.bench.forkserver --socket {path}")
    before = dict(os.environ)
    # As `python -m sglang.launch_server` does first: the plugins (the CPU layer among them) before the
    # modules, whose platform checks at import time read what the CPU layer sets.
    from sglang.srt.plugins import load_plugins

    load_plugins()
    plugin_env = {k: v for k, v in os.environ.items() if before.get(k) != v}
    for name in PRELOAD:
        importlib.import_module(name)
    # A server's value of an import-time variable must be what the zygote had, before the plugin ran or
    # after (the CPU layer's install is idempotent: a client that ran it itself has the latter).
    allowed = {name: {before.get(name), os.environ.get(name)} for name in IMPORT_TIME_ENV}

    owners: dict[int, int] = {}  # server pid -> the pid of the process that asked for it
    exited: OrderedDict[int, int] = OrderedDict()
    # SIGTERM (kill, pkill) runs the cleanup below too; SIGKILL leaves a socket that _unlink_stale removes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _unlink_stale(path)
    with _socket_files(path), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(path)
        sock.listen(16)
        print(f"forkserver ready on {path}", flush=True)
        while True:
            ready, _, _ = select.select([sock], [], [], 0.2)
            _reap(exited)
            _kill_orphans(owners, exited)
            if not ready:
                continue
            conn, _ = sock.accept()
            with conn:
                conn.settimeout(10.0)  # a client that connects and sends nothing cannot stall the zygote
                try:
                    request = json.loads(conn.makefile("r").readline())
                except (ValueError, OSError):  # an empty line (a probe that only connected), not JSON, a timeout
                    continue
                env = request.get("env", {})
                differs = [name for name in IMPORT_TIME_ENV if env.get(name) not in allowed[name]]
                if request.get("python", sys.executable) != sys.executable:
                    differs.append(f"python {request['python']}")
                if request["op"] == "launch" and differs:
                    reply: dict[str, Any] = {"refused": f"differs from the zygote's: {differs}"}
                elif request["op"] == "launch":
                    pid = os.fork()
                    if pid == 0:
                        conn.close()
                        sock.close()
                        _run_server(request, plugin_env)
                    owners[pid] = int(request["owner"])
                    reply = {"pid": pid}
                elif request["op"] == "poll":
                    pid = int(request["pid"])
                    _reap(exited)
                    reply = {"returncode": exited.get(pid)}
                else:
                    reply = {"error": f"unknown op {request['op']!r}"}
                conn.sendall((json.dumps(reply) + "\n").encode())


def _unlink_stale(path: str) -> None:
    """A socket file left by a killed zygote (nobody accepts on it) is removed; a live zygote's is kept, and
    bind then fails with "Address already in use"."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)
        except OSError:  # no such file, or not a socket: bind says what is wrong
            pass


@contextlib.contextmanager
def _socket_files(path: str) -> Iterator[None]:
    """The socket and the pid file are removed when the zygote stops (a killed one leaves them: `ready`
    then finds the pid gone)."""
    try:
        yield
    finally:
        _remove_files(path)


def _remove_files(path: str) -> None:
    """The zygote's socket and pid file, where they are."""
    for name in (path, path + ".pid"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def start(path: str | os.PathLike[str], log: str | os.PathLike[str]) -> Any:
    """Start a zygote listening on `path` (it dies with the calling thread); returns its Popen at once.
    Servers asked for before it is ready wait for it (`ready`)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and k != ENV}
    with open(log, "w") as out:
        zygote = subprocess.Popen(
            [sys.executable, "-m", __name__, "--socket", str(path)], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    _write_pid(str(path), zygote.pid)  # at once: `ready` waits while this pid lives
    return zygote


@contextlib.contextmanager
def running(where: str | os.PathLike[str]) -> Iterator[Any]:
    """A zygote in folder `where` (its socket and log there) for the duration of the block: CPU servers
    that `start_server` starts meanwhile are forked from it (`SGLANG_TTS_FORKSERVER` is set in this process
    and the ones it starts). It imports SGLang while the block goes on (a first server waits for it);
    it is stopped (SIGTERM: it removes its socket) when the block ends."""
    import subprocess

    folder = os.fspath(where)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "sock")
    zygote = start(path, os.path.join(folder, "zygote.log"))
    previous = os.environ.get(ENV)
    os.environ[ENV] = path
    try:
        yield zygote
    finally:
        if previous is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = previous
        zygote.terminate()
        try:
            zygote.wait(timeout=10)
        except subprocess.TimeoutExpired:  # a zygote that does not stop is killed
            zygote.kill()
            zygote.wait()
        _remove_files(path)  # left when it was stopped before it listened


def _write_pid(path: str, pid: int) -> None:
    with open(path + ".pid", "w") as f:
        f.write(str(pid))


def ready(path: str, timeout_s: float = 120.0) -> bool:
    """Whether the zygote on `path` listens, waiting while its pid file says it is still importing."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        try:
            os.kill(int(open(path + ".pid").read()), 0)
        except (OSError, ValueError):
            return False
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def request(path: str, message: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(path)
        sock.sendall((json.dumps(message) + "\n").encode())
        return json.loads(sock.makefile("r").readline())


class ForkedProcess:
    """The part of subprocess.Popen that ServerProcess uses, for a server forked by the zygote (its parent)."""

    def __init__(self, path: str, pid: int) -> None:
        self.path = path
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = request(self.path, {"op": "poll", "pid": self.pid})["returncode"]
            except OSError:  # the zygote is gone, and its servers with it (they die with their parent)
                self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                import subprocess

                raise subprocess.TimeoutExpired(f"forked server {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        return self.returncode  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", required=True, help="the Unix socket to listen on")
    args = parser.parse_args(argv)
    _die_with_parent()
    _write_pid(args.socket, os.getpid())
    serve(args.socket)


if __name__ == "__main__":
    main()
