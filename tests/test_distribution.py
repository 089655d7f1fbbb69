"""The installed distribution and the checkout root shadow no package that SGLang imports.

SGLang 0.5.23 imports OpenAI's ``triton_kernels`` for MXFP4/FP8 models (and probes it with
``find_spec``): a package of that name from sglang-tts, installed or in the working directory,
would be taken for it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTION = "sglang-tts"
_IMPORT = re.compile(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)", re.MULTILINE)


def sglang_imported_names() -> set[str]:
    """Top-level names in `import X` / `from X import` lines of SGLang's installed sources (a superset:
    a docstring line starting with "from" adds a word, never hides a name)."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    names: set[str] = set()
    for location in spec.submodule_search_locations:
        for source in Path(location).rglob("*.py"):
            names.update(_IMPORT.findall(source.read_text(errors="ignore")))
    return names


def claimed_top_level_names() -> set[str]:
    """Top-level import names the installed sglang-tts distribution provides (top_level.txt and RECORD)."""
    return {name for name, dists in importlib.metadata.packages_distributions().items() if DISTRIBUTION in dists}


def test_sglang_imports_triton_kernels():
    """The scan sees the import this test guards against (else the check below proves nothing)."""
    assert "triton_kernels" in sglang_imported_names()


def test_distribution_claims_only_its_own_name():
    claimed = claimed_top_level_names()
    assert claimed == {"sglang_tts"}
    assert not claimed & sglang_imported_names()
    providers = importlib.metadata.packages_distributions()
    assert all(providers[name] == [DISTRIBUTION] for name in claimed), {n: providers[n] for n in claimed}


def test_checkout_root_does_not_provide_triton_kernels():
    """Run from the checkout root (the working directory is sys.path[0]), as `python -m sglang.launch_server` is."""
    probe = (
        "import importlib.util, json\n"
        "spec = importlib.util.find_spec('triton_kernels')\n"
        "print(json.dumps(None if spec is None else [spec.origin, list(spec.submodule_search_locations or [])]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert str(REPO_ROOT) not in proc.stdout, proc.stdout
    # No entry of the checkout root is a name SGLang imports (a folder imports even without __init__.py).
    root_names = {p.stem if p.is_file() else p.name for p in REPO_ROOT.iterdir() if p.is_dir() or p.suffix == ".py"}
    assert not root_names & sglang_imported_names()
