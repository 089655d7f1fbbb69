"""The test/benchmark server launcher: its port choice (CI once lost a server start to a port race) and the
CPU launch defaults (a fixed KV pool that other processes' memory cannot shrink or refuse, and one large
enough for a wave of long requests)."""

from __future__ import annotations

import pathlib
import socket
import subprocess
import sys

import pytest

from sglang_tts.bench.server import (
    CPU_DEFAULT_ARGS,
    CPU_KV_TOKENS,
    CPU_MEM_FRACTION_STATIC,
    HTTP_PORTS,
    ServerProcess,
    ServerStartError,
    _wait_healthy,
    check_kv_pool,
    cpu_default_args,
    free_port,
    kv_pool_tokens,
)
from sglang_tts.bench.workload import BenchPrompt, prompt_token_counts
from sglang_tts.testing.kv_budget import kv_budget_bytes

GIB = 2**30
# The KV pool the launcher asks for SmolLM2-135M: 8,192 tokens of fp32 K and V, 30 layers of 3 heads of 64.
SMOLLM2_POOL_BYTES = CPU_KV_TOKENS * 2 * 4 * 30 * 3 * 64


def _ephemeral_low() -> int:
    return int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_ports_come_from_outside_the_ranges_the_servers_own_processes_draw_from():
    # bind(0)/connect() in the scheduler (gloo, zmq) take ports from the ephemeral range, and SGLang
    # draws its torch.distributed port from 22000-29999; uvicorn binds the HTTP port after both.
    assert HTTP_PORTS.stop <= 22000 <= _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(p in HTTP_PORTS for p in ports)
    assert len(ports) > 1  # drawn at random, so concurrent launchers rarely pick the same one


def test_a_port_in_use_is_never_returned():
    held = []
    try:
        for port in HTTP_PORTS[:200]:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        for _ in range(50):
            assert free_port() not in taken
    finally:
        for s in held:
            s.close()


def _value(args, flag: str) -> str:
    return args[args.index(flag) + 1]


def test_cpu_servers_ask_for_a_fixed_kv_pool_and_most_of_the_free_memory():
    args = cpu_default_args()
    assert args == CPU_DEFAULT_ARGS
    assert _value(args, "--max-total-tokens") == str(CPU_KV_TOKENS)
    assert _value(args, "--mem-fraction-static") == str(CPU_MEM_FRACTION_STATIC)


def _start(free_at_start: int, neighbour_bytes: int, mem_fraction_static: float) -> int:
    """SGLang's KV budget (stock accounting, as without the CPU layer) for 1 GiB of weights, while a
    neighbour allocates `neighbour_bytes`."""
    machine = {"free": free_at_start}

    def load() -> None:
        machine["free"] -= GIB + neighbour_bytes

    return kv_budget_bytes(mem_fraction_static, lambda: machine["free"], load)


def test_a_neighbour_allocating_during_the_load_leaves_the_launchers_pool():
    # The CI failure: at --mem-fraction-static 0.1 of 20 GiB free, a neighbour's 2 GiB leave SGLang nothing.
    with pytest.raises(ValueError, match="Loaded weights leave no GPU memory for the KV cache"):
        _start(20 * GIB, 2 * GIB, 0.1)
    # The launcher's fraction holds the pool beside a neighbour taking 10 of the 20 GiB, or on a machine
    # that had only 3 GiB free; --max-total-tokens then fixes the pool at exactly what was asked.
    assert _start(20 * GIB, 10 * GIB, CPU_MEM_FRACTION_STATIC) > SMOLLM2_POOL_BYTES
    assert _start(3 * GIB, 0, CPU_MEM_FRACTION_STATIC) > SMOLLM2_POOL_BYTES


def test_a_server_given_less_kv_pool_than_asked_fails_to_start():
    check_kv_pool({"max_total_tokens": 8192, "max_total_num_tokens": 8192, "page_size": 1})
    check_kv_pool({"max_total_tokens": 8200, "max_total_num_tokens": 8192, "page_size": 16})  # whole pages of it
    check_kv_pool({"max_total_tokens": None, "max_total_num_tokens": 1000})  # no cap asked: SGLang's sizing
    short = {"max_total_tokens": 8192, "max_total_num_tokens": 5000, "page_size": 1, "mem_fraction_static": 0.9}
    with pytest.raises(ServerStartError, match="5000 tokens, below --max-total-tokens 8192"):
        check_kv_pool(short)


def test_sglangs_refusal_of_a_kv_pool_is_explained(tmp_path):
    log = tmp_path / "server.log"
    refusal = "ValueError: Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=0.9."
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", f"print({refusal!r}); raise SystemExit(1)"], stdout=out)
    proc.wait()
    with pytest.raises(ServerStartError, match="lacks the memory for the weights and the KV pool"):
        _wait_healthy(ServerProcess("http://127.0.0.1:9", 9, proc, log), timeout_s=10)


def test_a_wave_of_long_requests_gets_the_kv_pool_it_needs():
    # Eight long-context prompts of up to 5K tokens and 1,024-token answers need ~50K tokens at once: the
    # CPU default of 8,192 made SGLang queue half of such a wave.
    lengths = [5200, 4700, 3100, 1200, 900, 2500, 3900, 1800, 800]
    assert kv_pool_tokens(lengths, 1024, 8) == sum(sorted(lengths)[1:]) + 8 * (1024 + 64)
    assert kv_pool_tokens(lengths, 1024, 1) == CPU_KV_TOKENS  # one request fits the default
    args = cpu_default_args(kv_tokens=65536)
    assert _value(args, "--max-total-tokens") == "65536"
    assert _value(args, "--mem-fraction-static") == str(CPU_MEM_FRACTION_STATIC)
    assert cpu_default_args(kv_tokens=4096) == cpu_default_args()  # never below the default


def test_prompt_lengths_are_counted_under_the_chat_template(tiny_llama):
    prompts = [
        BenchPrompt("ids", "d", input_ids=(1, 2, 3)),
        BenchPrompt("chat", "d", messages=({"role": "user", "content": "def f(x):\n    return x"},)),
    ]
    counts = prompt_token_counts(prompts, tiny_llama)
    assert counts[0] == 3 and counts[1] > 5  # the template adds role markers around the text
    assert prompt_token_counts(prompts[:1], "no tokenizer needed") == [3]
