"""Test helpers for tests/sglang (a uniquely named module, so `import` cannot pick up another test
directory's helpers): `core`, the tiny drafter and canvases of tests/core/core_testing.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


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
