"""`sgl_kernel.utils` stand-in: no programmatic dependent launch (PDL), so Triton kernels launch plainly."""

from gpu_serve_missing import missing_attr


def is_arch_support_pdl() -> bool:
    return False


def __getattr__(name):
    return missing_attr(__name__, name)
