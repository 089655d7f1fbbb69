"""Test helpers for tests/scripts (a uniquely named module, so `import` cannot pick up another test
directory's helpers)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load_script(name: str, module_name: str | None = None) -> ModuleType:
    """Execute scripts/<name>.py afresh as a module (registered in sys.modules, where dataclasses
    resolve their module's annotations)."""
    spec = importlib.util.spec_from_file_location(module_name or name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
