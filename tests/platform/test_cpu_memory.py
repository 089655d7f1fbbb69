"""The CPU layer's memory accounting (sglang_tts.platform.cpu.memory): what another process allocates while a
server loads its weights is not charged to them, so SGLang neither shrinks nor refuses the KV pool.

CI once lost an NGRAM server to "Loaded weights leave no GPU memory for the KV cache under
--mem-fraction-static=0.1" while other processes allocated memory; these tests replay that start through
SGLang's own sizing functions (sglang_tts.testing.kv_budget), with a simulated machine.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from sglang_tts.platform.cpu import memory
from sglang_tts.testing.kv_budget import kv_budget_bytes

GIB = 2**30
MIB = 2**20
FREE_AT_START = 20 * GIB  # what the CI machine had free when the server started
CI_FRACTION = 0.1  # the --mem-fraction-static of the failed start
WEIGHTS = 256 * MIB  # allocated for real: the hook must find them in this process's memory
NEIGHBOUR = 2 * GIB  # what another process allocates while the weights load
# This process's memory moves a little between two readings besides what a test allocates (allocator, gc).
NOISE = 32 * MIB
# The KV pool the launcher asks for SmolLM2-135M: 8,192 tokens of fp32 K and V, 30 layers of 3 heads of 64.
SMOLLM2_POOL_BYTES = 8192 * 2 * 4 * 30 * 3 * 64


@pytest.fixture(autouse=True)
def _fresh_baseline():
    memory.reset()
    yield
    memory.reset()


class Machine:
    """The machine's free memory, as SGLang's `get_free_cpu_memory` reads it; the test moves it."""

    def __init__(self, free_bytes: int) -> None:
        self.free_bytes = free_bytes

    def read(self) -> int:
        return self.free_bytes


def loading(machine: Machine, neighbour_bytes: int) -> Callable[[], torch.Tensor]:
    """A weights load: this process allocates WEIGHTS, and the machine loses them and `neighbour_bytes` more."""

    def load() -> torch.Tensor:
        weights = torch.ones(WEIGHTS // 4)  # float32, every page touched
        machine.free_bytes -= WEIGHTS + neighbour_bytes
        return weights

    return load


def hooked(machine: Machine) -> Callable[[], int]:
    """`get_free_cpu_memory` with the CPU layer's hook around the machine's reading."""
    return lambda: memory.free_cpu_memory_hook(machine.read)


def test_own_memory_grows_by_what_this_process_allocates():
    before = memory.own_memory_bytes()
    weights = torch.ones(WEIGHTS // 4)
    grown = memory.own_memory_bytes() - before
    assert abs(grown - WEIGHTS) <= NOISE, grown
    del weights


def test_the_machine_is_read_once_then_only_this_process_counts(monkeypatch):
    own = SimpleNamespace(bytes=GIB, pid=100)
    monkeypatch.setattr(memory, "own_memory_bytes", lambda: own.bytes)
    monkeypatch.setattr(memory.os, "getpid", lambda: own.pid)
    machine = Machine(FREE_AT_START)
    read = hooked(machine)
    assert read() == FREE_AT_START  # the first reading is the machine's
    own.bytes += 3 * GIB  # this process loads 3 GiB ...
    machine.free_bytes -= 3 * GIB + 10 * GIB  # ... while a neighbour takes 10 GiB
    assert read() == FREE_AT_START - 3 * GIB
    own.bytes -= GIB  # freeing memory gives it back
    assert read() == FREE_AT_START - 2 * GIB
    own.pid = 101  # a forked child inherits the module's state but not the memory: its own baseline
    assert read() == machine.free_bytes


def test_a_neighbour_allocating_during_the_load_no_longer_refuses_the_kv_pool():
    # Stock accounting, the CI failure: the neighbour's 2 GiB count as weights, and 20 GiB * 0.1 cannot hold them.
    machine = Machine(FREE_AT_START)
    with pytest.raises(ValueError, match="Loaded weights leave no GPU memory for the KV cache"):
        kv_budget_bytes(CI_FRACTION, machine.read, loading(machine, NEIGHBOUR))

    # With the hook the same start gets the budget of a quiet machine: 2 GiB less this process's weights.
    machine = Machine(FREE_AT_START)
    budget = kv_budget_bytes(CI_FRACTION, hooked(machine), loading(machine, NEIGHBOUR))
    quiet = Machine(FREE_AT_START)
    quiet_budget = kv_budget_bytes(CI_FRACTION, quiet.read, loading(quiet, 0))
    assert abs(budget - quiet_budget) <= NOISE, (budget, quiet_budget)
    assert abs(budget - (CI_FRACTION * FREE_AT_START - WEIGHTS)) <= NOISE
    assert budget > SMOLLM2_POOL_BYTES  # room for the pool --max-total-tokens then fixes


def test_a_machine_without_the_memory_at_start_still_refuses():
    # The hook ignores later neighbours, not a machine that lacks the memory when the server starts.
    machine = Machine(2 * WEIGHTS)
    with pytest.raises(ValueError, match="Loaded weights leave no GPU memory for the KV cache"):
        kv_budget_bytes(CI_FRACTION, hooked(machine), loading(machine, 0))


def test_the_hook_is_registered_on_sglangs_free_memory_reading():
    hooks = []
    memory.register_hooks(SimpleNamespace(register=lambda *args: hooks.append(args)), SimpleNamespace(AROUND="around"))
    assert hooks == [(memory.TARGET, memory.free_cpu_memory_hook, "around")]
    assert callable(pkgutil.resolve_name(memory.TARGET))  # still SGLang's name for it
