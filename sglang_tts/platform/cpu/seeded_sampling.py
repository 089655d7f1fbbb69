"""Seeded sampling on CPU, and a verify whose output does not depend on the draft.

SGLang 0.5.23 honours a request's `sampling_seed` (OpenAI `seed`) only under
`--enable-deterministic-inference`, which the CPU build cannot take (its attention backends are
CUDA ones), and its CPU path needs `torch.ops.sgl_kernel.murmur_hash32_cpu` (the stand-in defines
it: `sgl_kernel_ops.murmur_hash32_cpu`). With the seed, SGLang's sampler draws the token after
position p by the Gumbel-max trick on noise hashed from (seed, p, column)
(`sampler.multinomial_with_seed`): a deterministic function of the distribution, the seed and the
position, distributed as the distribution itself over seeds.

This module, while the CPU layer is active:
1. gives every batch's `SamplingBatchInfo` a seed per request (`from_schedule_batch_hook`): the
   request's own, or one drawn at random once per request (kept on the `Req`, so it lives as long as
   the request). A request without a seed still samples from the target's distribution; one with a
   seed samples reproducibly. Every batch carries seeds, so SGLang's merge and filter of the
   per-request tensors stay aligned (`merge_batch_hook` covers a batch built elsewhere);
2. verifies speculative sampling requests by that same rule (`eagle_sample_hook`,
   `verify_tree_greedy_hook`): at every node of the verify tree the target's seeded sample at the
   node's position, then SGLang's greedy tree walk against those samples. A drafted token is
   accepted exactly when it is what the target samples there, and the first token that is not
   drafted is the target's sample, so the committed tokens are the ones decoding without
   speculation draws with the same seed, whatever was drafted (lossless by construction: each token
   is the target's own seeded sample given the true prefix). Greedy requests keep argmax; a batch
   that needs min-p (SGLang's seeded sampler does not support it), rejection sampling with draft
   probabilities, or a watermark takes SGLang's coin-based path as before;
3. draws those samples with less work (`seeded_gumbel`: the same tokens, noise only for the columns
   that can win);
4. keeps min-p requests working (`min_p_sampling_hook`): SGLang asserts on seeded min-p sampling,
   so a batch that needs min-p samples unseeded.

What is exact: one request at a time, and batches whose requests have the same sampling options
(SGLang's sampler picks its noise's columns by the batch: token ids when no request of the batch
filters by top-k / top-p, ranks when any does). The parallel samples of one request (`n > 1`) share
its seed, hence its text, as under SGLang's deterministic mode: give each sample its own seed.
DFlash's verify (`dflash_utils`) keeps SGLang's coin-based path: its seeded coins are deterministic
but depend on the draft.

A seeded sample that raises is not the end of the round: the verify walks against unseeded samples
of the same distributions instead (each committed token is still a target sample given the true
prefix, so the distribution is kept; that round is not reproducible), and the failure is counted
(`FAILURES`, site `seeded_verify`) and logged, with its traceback the first time, then once per 100.
"""

from __future__ import annotations

import contextvars
import random
from dataclasses import dataclass
from typing import Any

import torch

from sglang_tts.platform.cpu.seeded_gumbel import multinomial_with_seed_hook
from sglang_tts.sglang.failures import FailureLog

SEED_ATTR = "_sglang_tts_sampling_seed"  # a Req's seed when it gave none (drawn once)
_rng = random.SystemRandom()


# Seeded verify samples that raised and were replaced by unseeded ones (per process; site SITE): logged as
# every TTS failure is, with its traceback the first time, then one line per `log_every` failures.
SITE = "seeded_verify"
FAILURES = FailureLog()


def request_seed(req: Any) -> int:
    """The request's `sampling_seed`, or a random one drawn at its first batch and kept on it."""
    seed = getattr(req.sampling_params, "sampling_seed", None)
    if seed is not None:
        return int(seed)
    seed = getattr(req, SEED_ATTR, None)
    if seed is None:
        seed = _rng.getrandbits(63)
        setattr(req, SEED_ATTR, seed)
    return seed


def from_schedule_batch_hook(original, cls, batch, vocab_size, *args, **kwargs):
    """AROUND hook on SamplingBatchInfo.from_schedule_batch: every request's seed in `sampling_seed`."""
    info = original(cls, batch, vocab_size, *args, **kwargs)
    if info.sampling_seed is None and batch.reqs:
        info.sampling_seed = torch.tensor(
            [request_seed(r) for r in batch.reqs], dtype=torch.int64, device=info.temperatures.device
        )  # [bs]
    return info


def merge_batch_hook(original, self, other, *args, **kwargs):
    """AROUND hook on SamplingBatchInfo.merge_batch: where only one side has seeds (a batch built
    without `from_schedule_batch`), the other's requests get random ones, so the merged tensor has
    a seed per request (SGLang keeps one side's tensor otherwise, one request short)."""
    for side, peer in ((self, other), (other, self)):
        if side.sampling_seed is None and peer.sampling_seed is not None and len(side) > 0:
            side.sampling_seed = torch.randint(
                0, 2**62, (len(side),), dtype=torch.int64, device=peer.sampling_seed.device
            )
    return original(self, other, *args, **kwargs)


def min_p_sampling_hook(original, *args, **kwargs):
    """AROUND hook on sampler.top_k_top_p_min_p_sampling_from_probs_torch: SGLang's seeded path
    asserts without min-p, so a batch that needs min-p samples unseeded (still the target's
    distribution, not reproducible)."""
    names = ("probs", "top_ks", "top_ps", "min_ps", "need_min_p_sampling", "sampling_seed", "positions")
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    if bound.get("need_min_p_sampling") and bound.get("sampling_seed") is not None:
        bound["sampling_seed"] = None
    return original(**bound)


@dataclass
class SeededVerify:
    """What the greedy walk of one seeded verify needs: the target's processed logits (the tensor
    eagle_sample adds penalties, bias and the grammar mask to, in place, before it walks)."""

    logits: torch.Tensor  # [bs * n, vocab] the target's logits after every verify node
    info: Any  # SamplingBatchInfo of the batch
    positions: torch.Tensor  # [bs * n] each node's position in its sequence
    width: int  # n, nodes per request (draft_token_num)

    def sample(self) -> torch.Tensor:
        """[bs * n] the target's seeded sample after every node, as SGLang's sampler draws it; if that
        raises, an unseeded sample of the same distributions (counted in `FAILURES`)."""
        try:
            return seeded_target_tokens(self.logits, self.info, self.positions, self.width)
        except Exception as error:  # noqa: BLE001 - a verify must not fail the batch over its seed
            FAILURES.record(SITE, error, [])
            return seeded_target_tokens(self.logits, self.info, self.positions, self.width, seeded=False)


def seeded_target_tokens(
    logits: torch.Tensor, info: Any, positions: torch.Tensor, width: int, seeded: bool = True
) -> torch.Tensor:
    """The token SGLang's pytorch sampler draws after each row of `logits` with the row's request's
    seed at the row's position (`Sampler.forward`: temperature, softmax, `_sample_from_probs`);
    `seeded=False`: a fresh random draw from the same distribution instead.

    logits: [bs * width, vocab]; info: SamplingBatchInfo of the bs requests; positions: [bs * width].
    Returns [bs * width] int64. Rows of greedy requests (top-k 1) come out as their argmax.
    """
    from sglang.kernels.ops.sampling import softmax as sampling_softmax
    from sglang.srt.layers.sampler import sampling_from_probs_torch, top_k_top_p_min_p_sampling_from_probs_torch

    def per_node(t: torch.Tensor) -> torch.Tensor:
        return torch.repeat_interleave(t, width, dim=0)

    probs = sampling_softmax(logits, temperatures=per_node(info.temperatures))  # [bs * width, vocab]
    seeds = per_node(info.sampling_seed) if seeded else None  # [bs * width]
    pos = positions.reshape(-1).to(torch.int64)  # [bs * width]
    if not (info.need_top_p_sampling or info.need_top_k_sampling or info.need_min_p_sampling):
        tokens = sampling_from_probs_torch(probs, sampling_seed=seeds, positions=pos)
    else:
        tokens = top_k_top_p_min_p_sampling_from_probs_torch(
            probs,
            per_node(info.top_ks),
            per_node(info.top_ps),
            per_node(info.min_ps),
            False,
            seeds,
            pos,
        )
    return tokens.to(torch.int64)


_VERIFY: contextvars.ContextVar[SeededVerify | None] = contextvars.ContextVar("sglang_tts_seeded_verify", default=None)


def active_verify() -> SeededVerify | None:
    """The seeded verify eagle_sample is running, if any (read by the `_verify_uses_greedy` hook)."""
    return _VERIFY.get()


def _takes_seeded_path(batch: Any, kwargs: dict) -> bool:
    from sglang.srt.runtime_context import get_spec

    info = batch.sampling_info
    if info is None or info.sampling_seed is None or info.is_all_greedy or info.need_min_p_sampling:
        return False
    if batch.forward_mode.is_idle() or get_spec().speculative_use_rejection_sampling:
        return False
    watermark = kwargs.get("watermark_state")
    return not (watermark is not None and info.has_watermark_candidates)


def eagle_sample_hook(original, verify_input, batch, logits_output, *args, **kwargs):
    """AROUND hook on eagle_utils.eagle_sample (EAGLE, EAGLE-3, TTS, its hybrid and NGRAM verify):
    a seeded sampling batch walks the tree greedily against the target's seeded samples."""
    if not _takes_seeded_path(batch, kwargs):
        return original(verify_input, batch, logits_output, *args, **kwargs)
    token = _VERIFY.set(
        SeededVerify(
            logits=logits_output.next_token_logits,
            info=batch.sampling_info,
            positions=verify_input.positions,
            width=verify_input.draft_token_num,
        )
    )
    try:
        return original(verify_input, batch, logits_output, *args, **kwargs)
    finally:
        _VERIFY.reset(token)


def verify_tree_greedy_hook(original, *args, **kwargs):
    """AROUND hook on eagle_utils.verify_tree_greedy_func: inside a seeded verify, the walk's targets
    are the seeded samples instead of the argmax."""
    seeded = _VERIFY.get()
    if seeded is not None and "target_predict" in kwargs:
        shape = kwargs["target_predict"].shape
        kwargs["target_predict"] = seeded.sample().reshape(shape).to(kwargs["target_predict"].dtype)
    return original(*args, **kwargs)


def register_hooks(registry, hook_type) -> None:
    registry.register(
        "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo.from_schedule_batch",
        from_schedule_batch_hook,
        hook_type.AROUND,
    )
    registry.register(
        "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo.merge_batch",
        merge_batch_hook,
        hook_type.AROUND,
    )
    registry.register(
        "sglang.srt.layers.sampler.top_k_top_p_min_p_sampling_from_probs_torch",
        min_p_sampling_hook,
        hook_type.AROUND,
    )
    registry.register("sglang.srt.speculative.eagle_utils.eagle_sample", eagle_sample_hook, hook_type.AROUND)
    registry.register(
        "sglang.srt.speculative.eagle_utils.verify_tree_greedy_func", verify_tree_greedy_hook, hook_type.AROUND
    )
    # The same seeded samples for less work: only the columns that can win get their noise.
    registry.register("sglang.srt.layers.sampler.multinomial_with_seed", multinomial_with_seed_hook, hook_type.AROUND)
