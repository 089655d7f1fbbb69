"""Test helpers for tests/sglang (a uniquely named module, so `import` cannot pick up another test
directory's helpers): `core`, the tiny drafter and canvases of tests/core/core_testing.py, and what
the worker tests share: a stand-in for SGLang's Req, an allocation meter and a host-read guard."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch


def _core_testing():
    """tests/core/core_testing.py, loaded once under its own name."""
    if "core_testing" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "core_testing", Path(__file__).parents[1] / "core" / "core_testing.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["core_testing"] = module
        spec.loader.exec_module(module)
    return sys.modules["core_testing"]


core = _core_testing()


class FakeReq:
    """What TTS reads of SGLang's Req in a round: rid, customized_info, output_ids, options."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.customized_info = None
        self.output_ids = [0]
        self.sampling_params = SimpleNamespace(custom_params=None)

    def finished(self) -> bool:
        return False


def allocated_bytes(fn: Callable[[], object]) -> int:
    """CPU bytes allocated while fn runs (torch.profiler's memory events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(event.cpu_memory_usage, 0) for event in prof.events())


def forbid_host_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way a tensor's value reaches the host (a GPU sync on CUDA) raises until monkeypatch.undo()."""

    def host_read(*args, **kwargs):
        raise AssertionError("a host read (a GPU sync) in a round that submits no update")

    for method in ("tolist", "item", "cpu", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, method, host_read)
