"""Catch-all modules for the CUDA-only packages SGLang 0.5.23 imports by name (sgl_kernel, flash_mla).

Every name SGLang binds from them at import resolves; one that is called raises NotImplementedError
naming itself, so a path the GPU serving run was not meant to take fails loudly with the kernel's
name, never at import. Submodules (`sgl_kernel.anything`) come from a finder placed after the real
ones, so an installed package always wins. `BOUND` records every name handed out, for the import
check's report.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

BOUND: set[str] = set()


class Missing:
    """A kernel the stand-in does not provide."""

    def __init__(self, name: str) -> None:
        self._name = name
        BOUND.add(name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{self._name}: not in the GPU serving stand-in (no sglang-kernel on this machine)")

    def __getattr__(self, item: str) -> Missing:
        if item.startswith("__"):
            raise AttributeError(item)
        return Missing(f"{self._name}.{item}")

    def __repr__(self) -> str:
        return f"<stand-in for {self._name}>"


def missing_attr(module_name: str, item: str) -> Missing:
    """For a stand-in module's `__getattr__`: dunders stay absent, anything else is Missing."""
    if item.startswith("__") and item.endswith("__"):
        raise AttributeError(item)
    return Missing(f"{module_name}.{item}")


class _CatchAllModule(types.ModuleType):
    def __getattr__(self, item: str) -> Missing:
        return missing_attr(self.__name__, item)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self) -> None:
        self.roots: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        root, _, rest = fullname.partition(".")
        if root in self.roots and rest:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _CatchAllModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def serve_submodules(root: str) -> None:
    """Answer every `root.x.y` import that no real file provides with a catch-all module."""
    finder = next((f for f in sys.meta_path if isinstance(f, _Finder)), None)
    if finder is None:
        finder = _Finder()
        sys.meta_path.append(finder)  # last: real modules are found first
    finder.roots.add(root)
