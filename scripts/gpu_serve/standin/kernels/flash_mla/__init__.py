"""`flash_mla` (sgl-flash-mla) stand-in: imported, never called, when EAGLE sets up its draft-extend CUDA graph."""

from gpu_serve_missing import missing_attr, serve_submodules

serve_submodules("flash_mla")


def __getattr__(name):
    return missing_attr(__name__, name)
