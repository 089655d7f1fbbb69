"""What DFLASH needs to run on CPU (filled in by the DFLASH bring-up)."""

from __future__ import annotations


def register_hooks(registry, hook_type) -> None:
    """No DFLASH hooks yet."""
    return None
