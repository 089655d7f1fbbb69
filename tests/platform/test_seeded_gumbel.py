"""sglang_tts.platform.cpu.seeded_gumbel: SGLang's seeded sample, with noise only for the columns that can win.

The reference is SGLang's `multinomial_with_seed` written out eagerly (its compiled function, the plain hash):
every row must come out the same, whatever the distribution and whatever else the batch holds."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_tts.platform.cpu import seeded_gumbel
from sglang_tts.platform.cpu.sgl_kernel_ops import murmur_hash32_cpu, murmur_hash32_reference


def sglang_sample(logprobs: torch.Tensor, seed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """sglang.srt.layers.sampler.multinomial_with_seed's arithmetic, over every column."""
    hashed = murmur_hash32_reference(seed, positions, torch.arange(logprobs.shape[1]))
    x = hashed.to(torch.float64) / torch.iinfo(torch.uint32).max
    x.log_().clamp_(min=torch.finfo(x.dtype).min, max=-(2.0**-32)).neg_()
    x.log_().neg_()
    x.add_(logprobs.to(torch.float64))
    return torch.argmax(x, dim=1, keepdim=True)


def _draws(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    seed = torch.randint(-(2**62), 2**62, (n,), generator=generator)
    return seed, torch.randint(0, 2**32, (n,), generator=generator)


# An LM's log-probabilities have a long tail; heavy-tailed logits stand in for them (most columns far below).
def _lm_like(n: int, m: int, temperature: float, generator: torch.Generator) -> torch.Tensor:
    logits = torch.distributions.StudentT(2.0).sample((n, m)) * 3.0
    return torch.log_softmax(logits / temperature, dim=-1)


@pytest.mark.parametrize("temperature", [0.2, 0.7, 1.0, 1.5, 10.0])
def test_every_row_is_sglangs_sample(temperature: float) -> None:
    g = torch.Generator().manual_seed(int(temperature * 10))
    torch.manual_seed(int(temperature * 10))
    for n, m in [(1, 50), (16, 4096), (5, 151_936)]:
        logprobs = _lm_like(n, m, temperature, g)
        seed, positions = _draws(n, g)
        assert torch.equal(
            seeded_gumbel.multinomial_with_seed_cpu(logprobs, seed, positions), sglang_sample(logprobs, seed, positions)
        )


def test_filtered_columns_ties_flat_rows_and_float64() -> None:
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    m = 3000
    rows = [
        torch.full((m,), -math.log(m)),  # flat: every column a candidate, ties everywhere but in the noise
        torch.where(torch.arange(m) < 40, torch.tensor(-math.log(40)), torch.tensor(-math.inf)),  # top-k 40
        _lm_like(1, m, 1.0, g)[0],
    ]
    tie = _lm_like(1, m, 1.0, g)[0]
    tie[7] = tie[1900] = tie.max() + 1.0  # two equal best columns
    rows.append(tie)
    one = torch.full((m,), -math.inf)
    one[123] = 0.0  # a single token left (top-p 0)
    rows.append(one)
    logprobs = torch.stack(rows)
    for dtype in (torch.float32, torch.float64):  # float64: SGLang's top-k / top-p path
        lp = logprobs.to(dtype)
        for _ in range(20):
            seed, positions = _draws(len(rows), g)
            out = seeded_gumbel.multinomial_with_seed_cpu(lp, seed, positions)
            assert torch.equal(out, sglang_sample(lp, seed, positions))
            assert out[4, 0] == 123 and out[1, 0] < 40


def test_a_row_does_not_depend_on_the_batch_around_it() -> None:
    # The lossless guarantee of seeded verify: a row's sample is its own, alone or among others.
    g = torch.Generator().manual_seed(2)
    torch.manual_seed(2)
    logprobs = _lm_like(12, 8000, 1.0, g)
    seed, positions = _draws(12, g)
    together = seeded_gumbel.multinomial_with_seed_cpu(logprobs, seed, positions)
    alone = [
        seeded_gumbel.multinomial_with_seed_cpu(logprobs[i : i + 1], seed[i : i + 1], positions[i : i + 1])
        for i in range(12)
    ]
    assert torch.equal(together, torch.cat(alone))


@pytest.fixture
def scored(monkeypatch) -> list[int]:
    """How many entries each call of the sparse scorer got."""
    counts: list[int] = []
    original = seeded_gumbel._scores
    monkeypatch.setattr(seeded_gumbel, "_scores", lambda lp, flat, s: counts.append(len(flat)) or original(lp, flat, s))
    return counts


def _sample_checked(logprobs: torch.Tensor, g: torch.Generator) -> None:
    seed, positions = _draws(logprobs.shape[0], g)
    out = seeded_gumbel.multinomial_with_seed_cpu(logprobs, seed, positions)
    assert torch.equal(out, sglang_sample(logprobs, seed, positions))


def test_only_the_columns_that_can_win_get_noise(scored) -> None:
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    logprobs = _lm_like(4, 50_000, 0.7, g)
    _sample_checked(logprobs, g)
    first, candidates = scored
    assert first == 4 and candidates < 0.1 * logprobs.numel()  # the best column of each row, then the rest
    assert seeded_gumbel.NOISE_MAX == pytest.approx(-math.log(2.0**-32))


def test_nan_and_empty_batches() -> None:
    seed, positions = torch.tensor([1, 2]), torch.tensor([3, 4])
    logprobs = torch.log_softmax(torch.randn(2, 100), dim=-1)
    logprobs[1, 5] = math.nan
    assert seeded_gumbel.multinomial_with_seed_cpu(logprobs, seed, positions) is None
    calls = []
    out = seeded_gumbel.multinomial_with_seed_hook(lambda *a: calls.append(a) or "sglang's", logprobs, seed, positions)
    assert out == "sglang's" and len(calls) == 1  # left to SGLang's function
    empty = seeded_gumbel.multinomial_with_seed_cpu(torch.zeros(0, 100), seed[:0], positions[:0])
    assert empty.shape == (0, 1)


def test_the_hook_answers_without_sglangs_function() -> None:
    g = torch.Generator().manual_seed(4)
    torch.manual_seed(4)
    logprobs = _lm_like(3, 1000, 1.0, g)
    seed, positions = _draws(3, g)
    out = seeded_gumbel.multinomial_with_seed_hook(pytest.fail, logprobs, seed, positions)
    assert torch.equal(out, sglang_sample(logprobs, seed, positions))


def test_the_fast_hash_equals_the_plain_one_over_the_whole_range() -> None:
    g = torch.Generator().manual_seed(5)
    seed = torch.cat(
        [torch.tensor([0, 1, -1, 2**63 - 1, -(2**63)]), torch.randint(-(2**63), 2**63 - 1, (27,), generator=g)]
    )
    positions = torch.cat(
        [torch.tensor([0, 2**31 - 1, 2**31, 2**32 - 1, 5]), torch.randint(0, 2**32, (27,), generator=g)]
    )
    for cols in (torch.arange(70_000), torch.randint(0, 2**32, (5000,), generator=g), torch.arange(0)):
        fast = murmur_hash32_cpu(seed, positions, cols)
        assert fast.dtype == torch.uint32 and fast.shape == (32, len(cols))
        assert torch.equal(fast.to(torch.int64), murmur_hash32_reference(seed, positions, cols).to(torch.int64))


def test_flat_distributions_score_every_column_at_once(scored) -> None:
    # Text of high entropy leaves most columns within reach of the best: the sparse bookkeeping is skipped.
    g = torch.Generator().manual_seed(6)
    torch.manual_seed(6)
    _sample_checked(_lm_like(6, 20_000, 50.0, g), g)
    assert scored == [6]  # only the best column of each row went through the sparse path


def test_a_fast_draw_that_raises_goes_to_sglangs_function_counted(monkeypatch, caplog) -> None:
    # The sampler runs inside SGLang's scheduler: a failure of the fast path must not reach the batch.
    failures = seeded_gumbel.FailureLog()
    monkeypatch.setattr(seeded_gumbel, "FAILURES", failures)
    monkeypatch.setattr(seeded_gumbel, "murmur_row_states", lambda *a: 1 / 0)
    g = torch.Generator().manual_seed(7)
    logprobs = _lm_like(3, 500, 1.0, g)
    seed, positions = _draws(3, g)
    with caplog.at_level("ERROR", logger="sglang_tts.sglang.failures"):
        for _ in range(2):
            out = seeded_gumbel.multinomial_with_seed_hook(sglang_sample, logprobs, seed, positions)
            assert torch.equal(out, sglang_sample(logprobs, seed, positions))
    assert failures.counts[seeded_gumbel.SITE] == 2
    assert "ZeroDivisionError" in failures.last_error[seeded_gumbel.SITE]
