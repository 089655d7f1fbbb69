"""The package's layering: the library does not import its tests' helpers, and it has no import cycles."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = REPO_ROOT / "sglang_tts"
TESTING = "sglang_tts.testing"


def module_name(path: Path) -> str:
    """Dotted name of a file under the repository root (`pkg/__init__.py` -> `pkg`)."""
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node except those under `if TYPE_CHECKING:` (annotations only, never imported at run time)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                yield child
                yield from _runtime_nodes(child)
            continue
        yield node
        yield from _runtime_nodes(node)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Absolute names `module` imports at run time, at any depth (function-level too); relative
    imports are resolved, and `from a import b` yields both `a` and `a.b` (b may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in _runtime_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            prefix = node.module or ""
            if node.level:
                parts = package.split(".")
                prefix = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            names.add(prefix)
            names.update(f"{prefix}.{alias.name}" for alias in node.names)
    return names


def file_imports(path: Path) -> set[str]:
    return imported_modules(path.read_text(), module_name(path), path.name == "__init__.py")


def _imports_testing(names: set[str]) -> bool:
    return any(name == TESTING or name.startswith(TESTING + ".") for name in names)


def test_the_library_and_scripts_do_not_import_the_test_helpers():
    sources = [p for p in PACKAGE.rglob("*.py") if not p.is_relative_to(PACKAGE / "testing")]
    sources += sorted((REPO_ROOT / "scripts").glob("*.py"))
    offenders = [str(p.relative_to(REPO_ROOT)) for p in sources if _imports_testing(file_imports(p))]
    assert offenders == []


def test_the_import_scan_resolves_relative_function_level_and_type_checking_imports():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from sglang_tts.core import canvas\n"
        "def f():\n    from ..testing import reference\n"
    )
    names = imported_modules(source, "sglang_tts.bench.probe")
    assert _imports_testing(names) and "sglang_tts.testing.reference" in names
    assert "sglang_tts.core" not in names  # annotations only
    assert imported_modules("from . import server\n", "sglang_tts.bench", is_package=True) == {
        "sglang_tts.bench",
        "sglang_tts.bench.server",
    }


def package_import_graph() -> dict[str, set[str]]:
    """sglang_tts module -> the sglang_tts modules it imports at run time (lazy imports included)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: (file_imports(path) & modules.keys()) - {name} for name, path in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (each holds an import cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                component.append(member)
            if component:
                cycles.append(sorted([node, *component]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_the_package_has_no_import_cycle():
    """Lazy (function-level) imports count: they hide a cycle from the import system, not from the design."""
    assert import_cycles(package_import_graph()) == []


def test_import_cycles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
