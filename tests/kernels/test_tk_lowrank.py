"""Per-token gathered low-rank delta: the Triton kernel (interpreter mode) against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from triton_kernels.lowrank import lowrank_delta_torch, triton_lowrank_delta


@pytest.mark.parametrize("n,in_features,out_features,rank", [(7, 48, 40, 4), (1, 130, 70, 8), (0, 16, 16, 2)])
def test_kernel_matches_reference(n, in_features, out_features, rank):
    gen = torch.Generator().manual_seed(n + rank)
    slots_total = 4
    a = torch.randn(slots_total, rank, in_features, generator=gen)
    b = torch.randn(slots_total, out_features, rank, generator=gen)
    a[0], b[0] = 0, 0  # the "no adapter" row
    x = torch.randn(n, in_features, generator=gen)
    slots = torch.randint(0, slots_total, (n,), generator=gen)
    expected = lowrank_delta_torch(x, a, b, slots, 0.5)
    got = triton_lowrank_delta(x, a, b, slots, 0.5, block_in=32, block_out=32)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[slots == 0], torch.zeros_like(got[slots == 0]))


def test_kernel_refuses_mismatched_shapes_and_odd_ranks():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="shapes"):
        triton_lowrank_delta(x, torch.randn(2, 4, 9), torch.randn(2, 5, 4), torch.zeros(3, dtype=torch.long), 1.0)
    with pytest.raises(ValueError, match="power-of-two"):
        triton_lowrank_delta(x, torch.randn(2, 3, 8), torch.randn(2, 5, 3), torch.zeros(3, dtype=torch.long), 1.0)
