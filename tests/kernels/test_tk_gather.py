"""Target -> EAGLE-3 draft vocabulary gather: reference semantics and the Triton kernel (interpreter mode)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from sglang_tts.kernels import gather_draft_probs
from sglang_tts.kernels.gather import gather_draft_probs_torch, gather_draft_probs_triton, target_to_draft_mask


def make_vocab_map(vt: int, vd: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """EAGLE-3 style mapping: sorted draft->target ids stored as offsets ``d2t[i] = target_id - i``."""
    gen = torch.Generator().manual_seed(seed)
    target_ids = torch.sort(torch.randperm(vt, generator=gen)[:vd]).values
    return target_ids, target_ids - torch.arange(vd)


def make_logits(n: int, vt: int, target_ids: Tensor, seed: int = 0) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vt, generator=gen) * 3.0
    outside = torch.ones(vt, dtype=torch.bool)
    outside[target_ids] = False
    logits[0, target_ids[5]] = 40.0  # argmax inside the draft vocabulary
    logits[1, torch.nonzero(outside)[0, 0]] = 40.0  # argmax outside it
    logits[2] = float("-inf")
    logits[2, torch.nonzero(outside)[-1, 0]] = 1.0  # only finite logit is outside: no draft mass at all
    logits[3, vt - 1] = 60.0  # argmax in the last (masked tail) target block
    if n > 4:
        # Tie across blocks: torch.argmax picks the first maximum (a draft id); the later one is outside the draft.
        logits[4, target_ids[0]] = 50.0
        logits[4, torch.nonzero(outside)[-1, 0]] = 50.0
    return logits


def brute_force(target_probs: Tensor, target_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Independent statement of the contract: restrict, renormalise (zeros if no mass), mask = argmax in draft."""
    restricted = target_probs[:, target_ids]
    total = restricted.sum(-1, keepdim=True)
    probs = torch.where(total > 0, restricted / total.clamp_min(1e-30), torch.zeros_like(restricted))
    in_draft = torch.zeros(target_probs.shape[1], dtype=torch.bool)
    in_draft[target_ids] = True
    return probs, in_draft[target_probs.argmax(-1)]


def test_target_to_draft_mask() -> None:
    target_ids, d2t = make_vocab_map(50, 12)
    t2d = target_to_draft_mask(d2t, 50)
    assert t2d.dtype == torch.bool and int(t2d.sum()) == 12
    assert torch.equal(torch.nonzero(t2d).squeeze(1), target_ids)


@pytest.mark.parametrize("input_is_logits", [True, False])
def test_torch_reference_matches_brute_force(input_is_logits: bool) -> None:
    target_ids, d2t = make_vocab_map(300, 77)
    logits = make_logits(6, 300, target_ids)
    full_probs = torch.softmax(logits, dim=-1)
    probs, mask = gather_draft_probs_torch(logits if input_is_logits else full_probs, d2t, None, input_is_logits)
    want_probs, want_mask = brute_force(full_probs, target_ids)
    torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-6)
    assert torch.equal(mask, want_mask)
    assert mask[:5].tolist() == [True, False, False, target_ids[-1].item() == 299, True]
    assert torch.count_nonzero(probs[2]) == 0  # no mass -> zeros, not NaN
    torch.testing.assert_close(probs[[0, 1, 3, 4, 5]].sum(-1), torch.ones(5))


@pytest.mark.parametrize("input_is_logits", [True, False])
@pytest.mark.parametrize(
    ("n", "vt", "vd", "block_size"),
    [
        (6, 300, 77, 32),  # both vocabularies ragged w.r.t. the block
        (5, 256, 64, 64),  # exact multiples
        (5, 130, 129, None),  # default blocks, almost every target id kept
    ],
)
def test_triton_matches_torch(n: int, vt: int, vd: int, block_size: int | None, input_is_logits: bool) -> None:
    target_ids, d2t = make_vocab_map(vt, vd, seed=vt)
    logits = make_logits(n, vt, target_ids, seed=vd)
    target = logits if input_is_logits else torch.softmax(logits, dim=-1)
    want_probs, want_mask = gather_draft_probs_torch(target, d2t, None, input_is_logits)
    probs, mask = gather_draft_probs_triton(target, d2t, None, input_is_logits, block_size=block_size)
    torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-6)
    assert torch.equal(mask, want_mask)
    assert not torch.isnan(probs).any()


def test_explicit_t2d_and_half_precision_input() -> None:
    target_ids, d2t = make_vocab_map(200, 50)
    logits = make_logits(4, 200, target_ids).to(torch.bfloat16)
    t2d = target_to_draft_mask(d2t, 200)
    want = gather_draft_probs_torch(logits, d2t, t2d)
    got = gather_draft_probs_triton(logits, d2t, t2d, block_size=64)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_dispatch(backend: str) -> None:
    target_ids, d2t = make_vocab_map(100, 30)
    logits = make_logits(4, 100, target_ids)
    probs, mask = gather_draft_probs(logits, d2t, backend=backend)
    want_probs, want_mask = brute_force(torch.softmax(logits, -1), target_ids)
    torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-6)
    assert torch.equal(mask, want_mask)
    with pytest.raises(ValueError, match="unknown backend"):
        gather_draft_probs(logits, d2t, backend="numpy")
