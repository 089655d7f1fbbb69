"""The test/benchmark server launcher's port choice (CI once lost a server start to a port race)."""

from __future__ import annotations

import pathlib
import socket

from sglang_tts.bench.server import HTTP_PORTS, free_port


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
