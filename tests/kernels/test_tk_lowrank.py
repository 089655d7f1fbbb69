"""Per-token gathered low-rank delta: the reference, the Triton kernel (interpreter mode), and the dispatch."""

from __future__ import annotations

import pytest
import torch

from sglang_tts.kernels import lowrank_delta
from sglang_tts.kernels.lowrank import lowrank_delta_torch, triton_lowrank_delta


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


def test_reference_matches_the_dense_formula():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 2, 6, generator=gen)
    b = torch.randn(3, 5, 2, generator=gen)
    x = torch.randn(7, 6, generator=gen)
    slots = torch.tensor([0, 2, 1, 1, 0, 2, 2])
    dense = torch.stack([0.5 * b[s] @ a[s] @ x[n] for n, s in enumerate(slots.tolist())])
    torch.testing.assert_close(lowrank_delta_torch(x, a, b, slots, 0.5), dense)


def test_dispatch_auto_is_the_reference_on_cpu_and_casts_to_the_input_dtype():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(3, 3, 6, generator=gen, dtype=torch.float64)  # rank 3: never the kernel
    b = torch.randn(3, 5, 3, generator=gen, dtype=torch.float64)
    x = torch.randn(4, 6, generator=gen)
    slots = torch.tensor([2, 0, 1, 2])
    got = lowrank_delta(x, a, b, slots, 0.25)
    assert got.dtype == torch.float32
    assert torch.equal(got, lowrank_delta_torch(x, a.float(), b.float(), slots, 0.25))
    kernel = lowrank_delta(x, a[:, :2].float(), b[:, :, :2].float(), slots, 0.25, backend="triton")
    torch.testing.assert_close(kernel, lowrank_delta_torch(x, a[:, :2].float(), b[:, :, :2].float(), slots, 0.25))
    with pytest.raises(ValueError, match="unknown backend"):
        lowrank_delta(x, a, b, slots, 0.25, backend="cuda")
