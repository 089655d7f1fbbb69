"""Test setup for sglang_tts.kernels: run Triton kernels through the interpreter on CPU tensors.

``TRITON_INTERPRET`` is read when a kernel is decorated, i.e. when the kernel module is imported; this conftest
runs before the test modules in this folder import anything, and the package loads its kernel modules lazily.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
