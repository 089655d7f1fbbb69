"""Wall time of each phase of SGLang's decoding on CPU, for scripts/bench_cpu_round.py.

Off unless $SGLANG_TTS_CPU_ROUND_TIMING names a file. Then every call of the functions in `PHASES`,
in every SGLang process, appends one JSON line to that file:

    {"phase": "verify", "mode": "decode", "tokens": 4, "batch": 1, "ms": 61.2}

`phase` is the key of `PHASES` (model forwards are split by runner: `target_forward`,
`draft_forward`), `mode` the batch's forward mode, `tokens` the rows the model forward ran on. On a
CPU every op is synchronous, so a call's wall time is its compute time; on a GPU it would not be
(this module is only loaded with the CPU layer).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

TIMING_ENV = "SGLANG_TTS_CPU_ROUND_TIMING"

_EAGLE = "sglang.srt.speculative.eagle_worker_v2"
PHASES = {
    "forward": "sglang.srt.model_executor.model_runner.ModelRunner.forward",
    "iteration": "sglang.srt.managers.scheduler.Scheduler.run_batch",
    "round": f"{_EAGLE}.EAGLEWorkerV2.forward_batch_generation",
    "dflash_round": "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.forward_batch_generation",
    "draft": f"{_EAGLE}.EagleDraftWorker.draft",
    "verify": f"{_EAGLE}.EAGLEWorkerV2.verify",
    "draft_extend": f"{_EAGLE}.EagleDraftWorker._draft_extend_for_decode",
}


def _describe(phase: str, owner: Any, batch: Any) -> dict[str, Any]:
    """Phase name, forward mode and sizes of one call (attributes read on the host only)."""
    record: dict[str, Any] = {"phase": phase}
    if phase == "forward":
        record["phase"] = "draft_forward" if getattr(owner, "is_draft_worker", False) else "target_forward"
    mode = getattr(batch, "forward_mode", None)
    if mode is not None:
        record["mode"] = mode.name.lower()
    input_ids = getattr(batch, "input_ids", None)
    if phase == "forward" and input_ids is not None:
        record["tokens"] = int(input_ids.shape[0])
    reqs = getattr(batch, "reqs", None)
    record["batch"] = len(reqs) if reqs is not None else getattr(batch, "batch_size", None)
    return record


def _timed(phase: str, path: str) -> Callable[..., Any]:
    def hook(original, owner, batch=None, *args, **kwargs):
        start = time.perf_counter()
        result = original(owner, batch, *args, **kwargs) if batch is not None else original(owner, *args, **kwargs)
        record = _describe(phase, owner, batch)
        record["ms"] = round((time.perf_counter() - start) * 1e3, 4)
        # O_APPEND: lines from several processes never interleave mid-line.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)
        return result

    return hook


def register_hooks(registry, hook_type) -> None:
    path = os.environ.get(TIMING_ENV, "").strip()
    if not path:
        return
    for phase, target in PHASES.items():
        registry.register(target, _timed(phase, path), hook_type.AROUND)


def read_records(path: str | os.PathLike[str], offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The records appended to `path` after byte `offset`, and the new offset."""
    with open(path, "rb") as handle:
        handle.seek(offset)
        data = handle.read()
    complete = data[: data.rfind(b"\n") + 1]
    records = [json.loads(line) for line in complete.decode().splitlines() if line.strip()]
    return records, offset + len(complete)
