"""`sgl_kernel.speculative` stand-in (see the package docstring)."""

from sglang_tts.platform.cpu.sgl_kernel_ops import SPECULATIVE_OPS as _OPS

globals().update(_OPS)
__all__ = sorted(_OPS)
