"""Round timing: off without its environment variable; with it every timed call appends one JSON line."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang_tts.platform.cpu import round_timing


class _Registry:
    def __init__(self) -> None:
        self.hooks: dict[str, object] = {}

    def register(self, target, hook, hook_type) -> None:
        self.hooks[target] = hook


_HookType = SimpleNamespace(AROUND="around")


def test_off_without_env(monkeypatch) -> None:
    monkeypatch.delenv(round_timing.TIMING_ENV, raising=False)
    registry = _Registry()
    round_timing.register_hooks(registry, _HookType)
    assert registry.hooks == {}


def test_each_call_appends_a_record(monkeypatch, tmp_path) -> None:
    path = tmp_path / "timing.jsonl"
    monkeypatch.setenv(round_timing.TIMING_ENV, str(path))
    registry = _Registry()
    round_timing.register_hooks(registry, _HookType)
    assert set(registry.hooks) == set(round_timing.PHASES.values())

    forward = registry.hooks[round_timing.PHASES["forward"]]
    verify = registry.hooks[round_timing.PHASES["verify"]]
    mode = SimpleNamespace(name="TARGET_VERIFY")
    batch = SimpleNamespace(forward_mode=mode, input_ids=torch.zeros(8, dtype=torch.long), batch_size=2)
    runner = SimpleNamespace(is_draft_worker=False)
    assert forward(lambda owner, b, flag=None: (owner, b, flag), runner, batch, flag=1) == (runner, batch, 1)
    schedule_batch = SimpleNamespace(forward_mode=mode, reqs=[1, 2])
    verify(lambda owner, b: None, object(), schedule_batch)

    records, offset = round_timing.read_records(path)
    assert [(r["phase"], r["mode"], r.get("tokens"), r["batch"]) for r in records] == [
        ("target_forward", "target_verify", 8, 2),
        ("verify", "target_verify", None, 2),
    ]
    assert all(r["ms"] >= 0 for r in records)
    # A half-written line is left for the next read.
    with open(path, "a") as handle:
        handle.write('{"phase": "dra')
    assert round_timing.read_records(path, offset) == ([], offset)
