"""Fixtures shared by tests/core (helpers live in core_testing.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)
