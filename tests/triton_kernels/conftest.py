"""Test setup for triton_kernels: run Triton kernels through the interpreter on CPU tensors.

``TRITON_INTERPRET`` is read when a kernel is decorated, i.e. when the kernel module is imported; this conftest
runs before the test modules in this folder import anything, and the package loads its kernel modules lazily.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

# The package lives at the repository root; make it importable even without an (up to date) editable install.
_REPO_ROOT = str(Path(__file__).resolve().parents[2])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)
