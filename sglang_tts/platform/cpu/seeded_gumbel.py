"""SGLang's seeded Gumbel-max sample on CPU, without the noise of tokens that cannot win.

Every seeded sample (and on CPU every sampled request is seeded: `seeded_sampling`) goes through
`sglang.srt.layers.sampler.multinomial_with_seed`: a MurmurHash3 of (seed, position, column) for every
column of the vocabulary, turned into Gumbel noise in float64 (two logs per column), added to the
log-probabilities, argmax. On a GPU that is one fused pass; on 2 CPU cores, for Qwen's 151,936 columns, it
cost about 45 ms for the 16 rows a chain-3 verify of 4 requests samples (SGLang's compiled function with the
project's hash; 74 ms eager with the hash as first written) and 12 ms for the 4 rows of a plain decode step.
Here: 3-4 ms for the 16 rows (Qwen's real distributions at temperature 0.7 and 1.0, 2 cores).

The noise is bounded above: the hash gives u = h / (2**32 - 1) and SGLang clamps log(u) at -2**-32, so
the noise -log(-log u) is at most 32 ln 2 (about 22.18). So once one column's score s* is known, a column
whose log-probability is below s* - 32 ln 2 cannot reach s*, and its noise is never needed.
`multinomial_with_seed_cpu` scores the most likely column of each row first, then only the
columns above that bound, with the same arithmetic per column as SGLang's (same hash, same float64
operations in the same order), and takes the first column of the largest score as `torch.argmax` does.
The sample is the one SGLang draws, for every row, whatever else the batch holds (tested against SGLang's
function on every sampling mode); only the work differs. On Qwen2.5-Coder-0.5B's answers at temperature 1.0,
3-12% of the vocabulary lies above the bound (8.5% on average), under 0.5% at 0.7.

Installed by `seeded_sampling.register_hooks` (an AROUND hook) only with the CPU layer; a draw that raises
goes to SGLang's function (counted in `FAILURES`, site `seeded_sample`), and so does a batch with a row whose
best score is not finite (a row holding a NaN: `torch.argmax` takes the NaN as the largest, so its score
is NaN), unchanged.
"""

from __future__ import annotations

import math

import torch

from sglang_tts.platform.cpu.sgl_kernel_ops import murmur_finish_, murmur_row_states, vocab_keys
from sglang_tts.sglang.failures import FailureLog

# The largest noise the hash can give: log(u) is clamped at -2**-32, so -log(-log u) <= -log(2**-32).
NOISE_MAX = 32 * math.log(2)
# Slack for rounding: the bound is compared in the log-probabilities' dtype (float32: 8e-6 at 100).
_SLACK = 1e-3
# Above this share of candidates (text of high entropy, e.g. a raw prompt at temperature 1.0: 62%) the
# bookkeeping of a sparse set costs more than the noise it saves: every column is scored, as SGLang does.
_DENSE_SHARE = 0.25

# Fast draws that raised and went to SGLang's function instead (per process), logged as every TTS failure is.
SITE = "seeded_sample"
FAILURES = FailureLog()


def _noisy(hashed: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """SGLang's score, in its operations and order: Gumbel noise from the uint32 hash, float64, plus the
    log-probability. hashed: any shape, uint32; logprobs: the same shape."""
    x = hashed.to(torch.float64) / torch.iinfo(torch.uint32).max
    x.log_().clamp_(min=torch.finfo(x.dtype).min, max=-(2.0**-32)).neg_()
    x.log_().neg_()
    return x.add_(logprobs.to(torch.float64))


def _scores(logprobs: torch.Tensor, flat: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """[k] float64: SGLang's score of the entries `flat` of `logprobs`.

    logprobs: [n, m]; flat: [k] int64 indices into logprobs.view(-1); states: [k] int32, the
    `murmur_row_states` of each entry's row."""
    m = logprobs.shape[1]
    hashed = murmur_finish_(states ^ vocab_keys(m, str(logprobs.device))[flat % m])
    return _noisy(hashed, logprobs.reshape(-1)[flat])


def multinomial_with_seed_cpu(
    logprobs: torch.Tensor, seed: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor | None:
    """SGLang's `multinomial_with_seed(logprobs, seed, positions)`: [n, 1] int64, the column of each row's
    largest log-probability + seeded Gumbel noise (the first one on a tie); None where a row's best score
    is not finite, e.g. a row holding a NaN (the caller runs SGLang's function then).

    logprobs: [n, m] float32 or float64 (-inf for filtered columns); seed: [n]; positions: [n]."""
    n, m = logprobs.shape
    if n == 0:
        return torch.zeros((0, 1), dtype=torch.int64, device=logprobs.device)
    logprobs = logprobs.contiguous()
    states = murmur_row_states(seed, positions)  # [n] int32
    # The most likely column's score, which the winner must reach (a NaN is the argmax of a row that holds one).
    top = logprobs.argmax(dim=1) + torch.arange(n, device=logprobs.device) * m  # [n] flat indices
    best = _scores(logprobs, top, states)  # [n] float64
    if not bool(torch.isfinite(best).all()):
        return None  # a row without a finite score (NaN logits): SGLang's function decides
    # A column below the bound scores less than `best` even with the largest noise: skip its noise.
    bound = (best - NOISE_MAX - _SLACK).to(logprobs.dtype)  # [n]
    mask = logprobs >= bound[:, None]  # [n, m]
    if int(torch.count_nonzero(mask)) > _DENSE_SHARE * n * m:  # flat distributions: score every column
        hashed = murmur_finish_(states[:, None] ^ vocab_keys(m, str(logprobs.device))[None, :])  # [n, m]
        return _noisy(hashed, logprobs).argmax(dim=1, keepdim=True)
    flat = mask.view(-1).nonzero().view(-1)  # [k] ascending: row by row, columns in order
    per_row = torch.bincount(flat // m, minlength=n)  # [n] candidates per row
    counts = per_row.tolist()
    if min(counts) == 0:
        return None  # not reached (a row's best columns lie above its bound); never an empty argmax
    scores = _scores(logprobs, flat, states.repeat_interleave(per_row))
    out = torch.empty((n, 1), dtype=torch.int64, device=logprobs.device)
    start = 0
    for row, count in enumerate(counts):  # argmax per row: its first largest score, as torch.argmax
        out[row, 0] = flat[start + int(scores[start : start + count].argmax())] - row * m
        start += count
    return out


def multinomial_with_seed_hook(original, logprobs, seed, positions, *args, **kwargs):
    """AROUND hook on sglang.srt.layers.sampler.multinomial_with_seed (CPU tensors only). If the fast path
    raises, SGLang's function draws the same samples instead; the failure is counted in `FAILURES` (site
    `SITE`) and logged, with its traceback the first time."""
    if logprobs.device.type == "cpu" and logprobs.dim() == 2 and not args and not kwargs:
        try:
            out = multinomial_with_seed_cpu(logprobs, seed, positions)
        except Exception as error:  # noqa: BLE001 - the sampler runs in the scheduler: never fail a batch here
            FAILURES.record(SITE, error, [])
            out = None
        if out is not None:
            return out
    return original(logprobs, seed, positions, *args, **kwargs)
