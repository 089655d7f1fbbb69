"""The test/benchmark server launcher's port choice (CI once lost a server start to a port race)."""

from __future__ import annotations

import pathlib
import socket

from sglang_tts.bench.server import CPU_DEFAULT_ARGS, HTTP_PORTS, cpu_default_args, cpu_mem_fraction, free_port


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
