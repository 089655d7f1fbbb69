"""The test/benchmark server launcher: its port choice (CI once lost a server start to a port race) and the
CPU launch defaults (memory, and a KV pool for a wave of long requests)."""

from __future__ import annotations

import json
import pathlib
import socket

from sglang_tts.bench.server import (
    CPU_DEFAULT_ARGS,
    CPU_KV_TOKENS,
    HTTP_PORTS,
    cpu_default_args,
    cpu_mem_fraction,
    free_port,
    kv_bytes_per_token,
    kv_pool_tokens,
)
from sglang_tts.bench.workload import BenchPrompt, prompt_token_counts


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


def test_cpu_memory_fraction_leaves_room_for_the_models_weights(tmp_path):
    gib = 2**30
    small, large = tmp_path / "small", tmp_path / "large"
    for folder, size in ((small, 540 * 2**20), (large, int(2.5 * gib))):  # SmolLM2-135M, Qwen2.5-Coder-0.5B
        folder.mkdir()
        with open(folder / "model.safetensors", "wb") as f:
            f.truncate(size)  # sparse: only the size counts
    assert cpu_mem_fraction(small, total_bytes=24 * gib) == 0.1  # the old fixed default, unchanged
    assert cpu_mem_fraction(large, total_bytes=24 * gib) == 0.33  # three copies and 0.5 GiB: 8 of 24 GiB
    assert cpu_mem_fraction(large, total_bytes=8 * gib) == 0.8  # capped
    args = cpu_default_args(large)
    assert args[args.index("--mem-fraction-static") + 1] == str(cpu_mem_fraction(large))
    assert args[: len(CPU_DEFAULT_ARGS)] == CPU_DEFAULT_ARGS and len(args) == len(CPU_DEFAULT_ARGS) + 2


def _value(args, flag: str) -> str:
    return args[args.index(flag) + 1]


def test_a_wave_of_long_requests_gets_the_kv_pool_it_needs(tmp_path):
    # Eight long-context prompts of up to 5K tokens and 1,024-token answers need ~50K tokens at once: the
    # CPU default of 8,192 made SGLang queue half of such a wave.
    lengths = [5200, 4700, 3100, 1200, 900, 2500, 3900, 1800, 800]
    assert kv_pool_tokens(lengths, 1024, 8) == sum(sorted(lengths)[1:]) + 8 * (1024 + 64)
    assert kv_pool_tokens(lengths, 1024, 1) == CPU_KV_TOKENS  # one request fits the default
    qwen = tmp_path / "qwen"  # Qwen2.5-Coder-0.5B: 24 layers, 2 KV heads of 64
    qwen.mkdir()
    config = {"hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 24}
    (qwen / "config.json").write_text(json.dumps(config))
    with open(qwen / "model.safetensors", "wb") as f:
        f.truncate(int(2.5 * 2**30))
    assert kv_bytes_per_token(qwen) == 2 * 4 * 24 * 2 * 64
    gib = 2**30
    assert cpu_mem_fraction(qwen, total_bytes=24 * gib, kv_tokens=CPU_KV_TOKENS) == 0.33  # as without a pool
    # 57,344 more tokens of 24 KiB, a quarter more for the drafter's pool: 1.7 GiB more
    assert cpu_mem_fraction(qwen, total_bytes=24 * gib, kv_tokens=65536) == 0.4
    args = cpu_default_args(qwen, kv_tokens=65536)
    assert _value(args, "--max-total-tokens") == "65536"
    assert _value(args, "--mem-fraction-static") == str(cpu_mem_fraction(qwen, kv_tokens=65536))
    assert cpu_default_args(qwen, kv_tokens=4096) == cpu_default_args(qwen)  # never below the default


def test_prompt_lengths_are_counted_under_the_chat_template(tiny_llama):
    prompts = [
        BenchPrompt("ids", "d", input_ids=(1, 2, 3)),
        BenchPrompt("chat", "d", messages=({"role": "user", "content": "def f(x):\n    return x"},)),
    ]
    counts = prompt_token_counts(prompts, tiny_llama)
    assert counts[0] == 3 and counts[1] > 5  # the template adds role markers around the text
    assert prompt_token_counts(prompts[:1], "no tokenizer needed") == [3]
