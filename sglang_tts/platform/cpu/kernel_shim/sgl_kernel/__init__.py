"""CPU stand-in for the `sgl_kernel` package (its CPU build is not on PyPI).

This directory is put on sys.path by `sglang_tts.platform.cpu.install()` ONLY when no real
`sgl_kernel` is importable, and after every other entry, so a real install always wins.
The ops themselves live in `sglang_tts.platform.cpu.sgl_kernel_ops`.
"""

from sglang_tts.platform.cpu.sgl_kernel_ops import OPS as _OPS
from sglang_tts.platform.cpu.sgl_kernel_ops import register_torch_ops as _register_torch_ops

_register_torch_ops()  # torch.ops.sgl_kernel.* (murmur_hash32_cpu: the noise of seeded sampling)

globals().update(_OPS)
__all__ = sorted(_OPS)
# Marker so tests (and users) can tell the stand-in from the real package.
SGLANG_TTS_CPU_STANDIN = True
