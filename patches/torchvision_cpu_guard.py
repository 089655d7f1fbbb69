"""Make PyPI's (CUDA-built) torchvision importable beside the CPU build of torch.

Why: torchvision's compiled ops (`_C.so`) need libc10_cuda.so, so they do not load with CPU torch.
torchvision tolerates that for every op except two fake-tensor registrations, which are not
guarded like their neighbours and raise `operator torchvision::nms does not exist` at import.
SGLang imports `torchvision.transforms` at launch (multimodal utils), so the import must work.
What it changes: the decorators of `meta_nms` / `meta_qnms` register only when the ops exist,
as `register_meta` already does for the others. Only the C++ ops (nms, roi_align) stay missing.
Idempotent; run by scripts/setup_env.sh. Usage: python patches/torchvision_cpu_guard.py
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

GUARD = "if torchvision.extension._has_ops() else (lambda fn: fn)"


def patch() -> str:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return "torchvision not installed: nothing to patch"
    path = pathlib.Path(spec.origin).parent / "_meta_registrations.py"
    text = path.read_text()
    changed = text
    for op in ("nms", "qnms"):
        plain = f'@torch.library.register_fake("torchvision::{op}")\n'
        guarded = f'@(torch.library.register_fake("torchvision::{op}") {GUARD})\n'
        changed = changed.replace(plain, guarded)
    if changed == text:
        return f"{path}: already guarded" if GUARD in text else f"{path}: pattern not found, left as is"
    path.write_text(changed)
    return f"{path}: guarded the nms/qnms fake registrations"


if __name__ == "__main__":
    print(patch())
    sys.exit(0)
