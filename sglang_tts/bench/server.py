"""Launch a real SGLang server process on a free loopback port, wait for health, shut it down.

Used by the benchmark runner, the demo and the tests' server fixtures. The server runs in its own
process group so shutdown reaches SGLang's scheduler and detokenizer children too (no orphans).
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

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
    "--skip-server-warmup",
    # The scheduler busy-polls a core when idle otherwise: on a 2-core machine that halves everything else.
    "--sleep-on-idle",
)


def kv_pool_tokens(prompt_lengths: Sequence[int], max_new_tokens: int, concurrency: int) -> int:
    """Tokens of KV cache that `concurrency` requests in flight need at once: the longest prompts plus
    their answers (and a few draft tokens each), at least CPU_KV_TOKENS. A smaller pool makes SGLang
    queue part of a wave, which a benchmark of N requests in flight must not measure."""
    longest = sorted(prompt_lengths, reverse=True)[: max(1, concurrency)]
    return max(CPU_KV_TOKENS, sum(n + max_new_tokens + 64 for n in longest))


def kv_bytes_per_token(model_path: str | os.PathLike[str]) -> int:
    """fp32 K and V of every layer for one token, from the model's config.json (0 when it has none)."""
    config = pathlib.Path(model_path) / "config.json"
    if not config.is_file():
        return 0
    c = json.loads(config.read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * 4 * c["num_hidden_layers"] * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim


def cpu_mem_fraction(model_path: str | os.PathLike[str], total_bytes: int | None = None, kv_tokens: int = 0) -> float:
    """--mem-fraction-static for a CPU server of this model: SGLang counts the CPU layer's packed linear
    weights as weights too, so room for three copies of the fp32 checkpoint and 0.5 GiB (at least 0.1, the
    value that fits SmolLM2-135M; Qwen2.5-Coder-0.5B gets 0.33 of 24 GiB), plus a KV pool of `kv_tokens`
    beyond CPU_KV_TOKENS (with a quarter more for the drafter's pool). A bound, not an allocation:
    --max-total-tokens caps the KV pool."""
    folder = pathlib.Path(model_path)
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors")) if folder.is_dir() else 0
    if total_bytes is None:
        total_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    kv = 1.25 * max(0, kv_tokens - CPU_KV_TOKENS) * kv_bytes_per_token(folder)
    return max(0.1, min(0.8, round((3 * weights + 2**29 + kv) / total_bytes, 2)))


def cpu_default_args(model_path: str | os.PathLike[str], kv_tokens: int | None = None) -> tuple[str, ...]:
    """CPU_DEFAULT_ARGS and the --mem-fraction-static this model needs (cpu_mem_fraction); with `kv_tokens`
    above CPU_KV_TOKENS (kv_pool_tokens of a benchmark's waves), a KV pool of that many tokens."""
    pool = max(CPU_KV_TOKENS, kv_tokens or 0)
    args = list(CPU_DEFAULT_ARGS)
    args[args.index("--max-total-tokens") + 1] = str(pool)
    return (*args, "--mem-fraction-static", str(cpu_mem_fraction(model_path, kv_tokens=pool)))


class ServerStartError(RuntimeError):
    pass


@dataclass
class ServerProcess:
    base_url: str
    port: int
    proc: subprocess.Popen
    log_path: pathlib.Path
    args: list[str] = field(default_factory=list)

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

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
            raise ServerStartError(
                f"SGLang server exited with code {server.proc.returncode} during startup; log tail:\n"
                + server.log_tail()
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
) -> ServerProcess:
    """`cpu_defaults`: add cpu_default_args(model_path, kv_tokens) before `extra_args` (which win)."""
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
        *(cpu_default_args(model_path, kv_tokens) if cpu_defaults else ()),
        *extra_args,
    ]
    log_file = tempfile.NamedTemporaryFile(prefix=f"sglang-{port}-", suffix=".log", dir=log_dir, delete=False, mode="w")
    proc_env = dict(os.environ)
    # Test-suite settings that must not reach the server (the Triton tests run the interpreter).
    proc_env.pop("TRITON_INTERPRET", None)
    proc_env.update(env or {})
    proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env=proc_env, start_new_session=True)
    server = ServerProcess(f"http://127.0.0.1:{port}", port, proc, pathlib.Path(log_file.name), args)
    try:
        _wait_healthy(server, timeout_s)
    except BaseException:
        stop_server(server)
        raise
    return server


def stop_server(server: ServerProcess, timeout_s: float = 30.0) -> None:
    """SIGTERM the launcher (SGLang then stops its own children), then SIGKILL the whole group."""
    if server.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.proc.pid, signal.SIGTERM)
        try:
            server.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    # Children (scheduler, detokenizer) share the group: make sure none survive the leader.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.proc.wait(timeout=timeout_s)
    # SIGKILL is delivered asynchronously and reparented children are reaped by init: wait for it.
    deadline = time.monotonic() + timeout_s
    while group_alive(server.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)


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
