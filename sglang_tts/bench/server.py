"""Launch a real SGLang server process on a free loopback port, wait for health, shut it down.

Used by the benchmark runner, the demo and the tests' server fixtures. The server runs in its own
process group so shutdown reaches SGLang's scheduler and detokenizer children too (no orphans).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang_tts.bench import forkserver

# uvicorn binds the HTTP port only after SGLang's scheduler has started, so the port must be one no
# process of the server can take first: not from the kernel's ephemeral range (every bind(0) and
# connect() of the scheduler, gloo included, draws from it; a port found free by bind(0) here can be
# handed out again in between, and uvicorn then exits with code 3), and not from 22000-29999, where
# SGLang draws its own later-bound torch.distributed port.
HTTP_PORTS = range(15000, 22000)


def free_port(attempts: int = 64) -> int:
    """A free loopback port for an SGLang server, outside the ranges its own processes draw from."""
    for port in random.sample(HTTP_PORTS, attempts):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port among {attempts} tries in {HTTP_PORTS.start}-{HTTP_PORTS.stop - 1}")


CPU_KV_TOKENS = 8192  # the KV pool of one long request; kv_pool_tokens raises it for a wave of them

# The share of the memory free at a CPU server's start that its weights and KV pool may take. The pool is
# fixed by --max-total-tokens, so this decides only when SGLang refuses to start, never how much it
# allocates: high, so that SGLang refuses only when the weights and that pool do not fit the free memory,
# and a tenth left for what SGLang does not preallocate (activations, the runtime's own buffers). A small
# fraction made the pool depend on the memory other processes held or took while the server loaded
# (docs/cpu.md, "Memory").
CPU_MEM_FRACTION_STATIC = 0.9

CPU_DEFAULT_ARGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--disable-cuda-graph",
    "--dtype",
    "float32",
    "--max-total-tokens",
    str(CPU_KV_TOKENS),
    "--mem-fraction-static",
    str(CPU_MEM_FRACTION_STATIC),
    "--skip-server-warmup",
    # The scheduler busy-polls a core when idle otherwise: on a 2-core machine that halves everything else.
    "--sleep-on-idle",
)

# SGLang's words when the loaded weights leave no room for a KV pool (KVCacheConfigurator._profile_available_bytes).
KV_REFUSAL = "leave no GPU memory for the KV cache"


# KV tokens a request may hold beyond its prompt and answer: the draft tokens of its last verify round.
DRAFT_MARGIN = 64


def waves_kv_tokens(waves: Iterable[Sequence[int]], max_new_tokens: int) -> int:
    """Tokens of KV cache the largest wave needs at once (`waves`: the prompt lengths of each wave, a prompt
    that a wave holds twice counted twice): its prompts plus their whole answers (and a few draft tokens
    each), at least CPU_KV_TOKENS. A smaller pool makes SGLang queue part of a wave (or retract requests
    mid-answer), which a benchmark of N requests in flight must not measure."""
    need = max((sum(n + max_new_tokens + DRAFT_MARGIN for n in wave) for wave in waves), default=0)
    return max(CPU_KV_TOKENS, need)


def kv_pool_tokens(prompt_lengths: Sequence[int], max_new_tokens: int, concurrency: int) -> int:
    """Tokens of KV cache that `concurrency` requests in flight need at once: the longest prompts plus
    their answers, at least CPU_KV_TOKENS (waves_kv_tokens of the worst wave). With fewer prompts than
    `concurrency`, a wave repeats them (runner.waves cycles the list): the longest count again."""
    longest = sorted(prompt_lengths, reverse=True) or [0]
    wave = [longest[i % len(longest)] for i in range(max(1, concurrency))]
    return waves_kv_tokens([wave], max_new_tokens)


# SGLang serves a request at most context_len - 1 tokens in all (its scheduler's max_req_len) and clips its
# answer one token below that: a whole answer needs prompt + max_new_tokens + 2 <= context_len.
CONTEXT_MARGIN = 2


def model_context_length(model_path: str | os.PathLike[str]) -> int | None:
    """The context length SGLang derives for a model (its config's max_position_embeddings or kin, with
    rope scaling), unless --context-length overrides it; None when transformers cannot read its config
    (the server's launch then says why)."""
    from sglang.srt.utils.hf_transformers.common import get_context_length
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(model_path))
    except (OSError, ValueError, KeyError):
        return None
    return int(get_context_length(config.get_text_config()))


def context_length_arg(server_args: Sequence[str]) -> int | None:
    """The value of a --context-length (or --context-length=N) in a server's launch flags, the last one."""
    value = None
    for i, arg in enumerate(server_args):
        if arg == "--context-length" and i + 1 < len(server_args):
            value = int(server_args[i + 1])
        elif arg.startswith("--context-length="):
            value = int(arg.split("=", 1)[1])
    return value


def context_shortfall(context_len: int, longest_prompt: int, max_new_tokens: int) -> str | None:
    """Why the longest prompt's whole answer does not fit the server's context (None when it does): SGLang
    refuses such a request (HTTP 400) or cuts its answer short."""
    need = longest_prompt + max_new_tokens + CONTEXT_MARGIN
    if need <= context_len:
        return None
    return (
        f"the longest prompt ({longest_prompt} tokens) and --max-new-tokens {max_new_tokens} need a context of "
        f"{need} tokens; the server's is {context_len}"
    )


def cpu_launch(device: str) -> bool:
    """Whether servers get the CPU launch flags: ``--device cpu``, or ``auto`` on a machine without CUDA."""
    if device != "auto":
        return device == "cpu"
    import torch

    return not torch.cuda.is_available()


def cpu_default_args(kv_tokens: int | None = None) -> tuple[str, ...]:
    """CPU_DEFAULT_ARGS with a KV pool of `kv_tokens` when that is above CPU_KV_TOKENS (kv_pool_tokens of a
    benchmark's waves). The pool is always fixed: SGLang's own sizing reads the machine's free memory."""
    args = list(CPU_DEFAULT_ARGS)
    args[args.index("--max-total-tokens") + 1] = str(max(CPU_KV_TOKENS, kv_tokens or 0))
    return tuple(args)


class ServerStartError(RuntimeError):
    pass


def _libc_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Looked up here, not in the forked child (which should run as little Python as possible before exec).
_PRCTL = _libc_prctl()
_PR_SET_PDEATHSIG = 1


def _kill_when_parent_dies() -> None:
    """In the server's child process before exec: SIGKILL it when the thread that forked it exits."""
    _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


def check_kv_pool(info: dict) -> None:
    """Raise unless SGLang gave the server the whole KV pool --max-total-tokens asked for (`info`: its
    /server_info). SGLang only warns when the memory it may use holds less ("max_total_tokens=N is larger
    than the profiled value"), and a benchmark would then measure a server that queues part of a wave."""
    cap, pool = info.get("max_total_tokens"), info.get("max_total_num_tokens")
    if cap is None or pool is None:
        return
    page = info.get("page_size") or 1
    if pool < cap // page * page:
        raise ServerStartError(
            f"SGLang sized the KV pool to {pool} tokens, below --max-total-tokens {cap}: the machine lacks the "
            f"memory for that pool beside the weights (with --mem-fraction-static "
            f"{info.get('mem_fraction_static')} of the memory free at start)"
        )


def _memory_hint(log_tail: str) -> str:
    """What SGLang's refusal of a KV pool means on CPU, where its message speaks of GPU memory."""
    if KV_REFUSAL not in log_tail:
        return ""
    return (
        "\nThe machine lacks the memory for the weights and the KV pool: on CPU, SGLang's 'GPU memory' is the"
        " machine's free memory (docs/cpu.md, section Memory). Free some, or lower --max-total-tokens."
    )


@dataclass
class ServerProcess:
    base_url: str
    port: int
    proc: subprocess.Popen | forkserver.ForkedProcess
    log_path: pathlib.Path
    args: list[str] = field(default_factory=list)

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def server_info(self) -> dict:
        """SGLang's /server_info: the resolved server arguments and the scheduler's state."""
        with urllib.request.urlopen(self.base_url + "/server_info", timeout=30) as r:
            return json.load(r)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False


def _wait_healthy(server: ServerProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not server.alive():
            tail = server.log_tail()
            raise ServerStartError(
                f"SGLang server exited with code {server.proc.returncode} during startup; log tail:\n{tail}"
                + _memory_hint(tail)
            )
        if server.healthy():
            return
        time.sleep(1.0)
    raise ServerStartError(f"SGLang server not healthy after {timeout_s:.0f} s; log tail:\n{server.log_tail()}")


def start_server(
    model_path: str,
    extra_args: Sequence[str] = (),
    cpu_defaults: bool = True,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    log_dir: str | None = None,
    kv_tokens: int | None = None,
    die_with_parent: bool = False,
) -> ServerProcess:
    """`cpu_defaults`: add cpu_default_args(kv_tokens) before `extra_args` (which win), and fail unless the
    server got the whole KV pool they ask for (check_kv_pool). `die_with_parent` (Linux): the server is
    killed when the thread that calls this exits, its process's death included, even by SIGKILL, which
    runs no cleanup (SGLang's own children die with it); so call it from a thread that lives as long as
    the server should (the main thread); a server forked by the zygote dies with the calling process.
    With `SGLANG_TTS_FORKSERVER` naming a zygote, a CPU server is forked from it (`_forked`)."""
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *(cpu_default_args(kv_tokens) if cpu_defaults else ()),
        *extra_args,
    ]
    log_file = tempfile.NamedTemporaryFile(prefix=f"sglang-{port}-", suffix=".log", dir=log_dir, delete=False, mode="w")
    proc_env = dict(os.environ)
    # Test-suite settings that must not reach the server (the Triton tests run the interpreter).
    proc_env.pop("TRITON_INTERPRET", None)
    proc_env.update(env or {})
    proc = _forked(args, proc_env, log_file.name)
    if proc is None:
        preexec = _kill_when_parent_dies if die_with_parent and _PRCTL is not None else None
        proc = subprocess.Popen(
            args, stdout=log_file, stderr=subprocess.STDOUT, env=proc_env, start_new_session=True, preexec_fn=preexec
        )
    log_file.close()
    server = ServerProcess(f"http://127.0.0.1:{port}", port, proc, pathlib.Path(log_file.name), args)
    try:
        _wait_healthy(server, timeout_s)
        if cpu_defaults:
            check_kv_pool(server.server_info())
    except BaseException:
        stop_server(server)
        raise
    return server


def _forked(args: Sequence[str], env: dict[str, str], log: str) -> forkserver.ForkedProcess | None:
    """The server forked by the zygote that `SGLANG_TTS_FORKSERVER` names (sglang_tts.bench.forkserver), for
    a CPU server; None without one, for another device, or when the zygote refuses (start it with Popen)."""
    path = env.get(forkserver.ENV)
    if not path or "cpu" not in _flag_values(args, "--device") or not forkserver.ready(path):
        return None
    message = {"op": "launch", "args": list(args[3:]), "env": env, "cwd": os.getcwd(), "log": log}
    message.update(owner=os.getpid(), python=sys.executable)
    try:
        reply = forkserver.request(path, message)
    except OSError:  # a zygote that stopped: start the usual way
        return None
    return forkserver.ForkedProcess(path, reply["pid"]) if "pid" in reply else None


def _flag_values(args: Sequence[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]


def stop_server(server: ServerProcess, timeout_s: float = 30.0) -> None:
    """SIGKILL the server's whole process group (launcher, scheduler, detokenizer) and wait until it is gone.

    Not SIGTERM: SGLang's graceful stop drains requests and polls for the signal every 5 s, so each stop
    took 10 s, and a server has nothing to save (results are the client's; GPU and CPU memory go back
    to the OS with the processes)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.proc.wait(timeout=timeout_s)
    # SIGKILL is delivered asynchronously and reparented children are reaped by init: wait for it.
    deadline = time.monotonic() + timeout_s
    while group_alive(server.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is still in process group `pgid`."""
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields: state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


@contextlib.contextmanager
def sglang_server(model_path: str, extra_args: Sequence[str] = (), **kwargs) -> Iterator[ServerProcess]:
    server = start_server(model_path, extra_args, **kwargs)
    try:
        yield server
    finally:
        stop_server(server)
