"""What stock `--speculative-algorithm DFLASH` needs to serve on CPU.

SGLang 0.5.23 builds DFLASH for CUDA/NPU/XPU only. On CPU it fails at the places below; each is
fixed at the narrowest point SGLang offers, and only while the CPU layer is active
(`sglang_tts.platform.cpu.install()` calls `register_hooks`):

1. `_handle_dflash` (arg_groups/speculative_hook.py) refuses device "cpu" outright.
   -> `handle_dflash_hook` lets the CPU device through and leaves every other check standing.
2. The DFLASH draft attention backend must be in `DRAFT_ATTENTION_BACKEND_CHOICES`; otherwise the
   scheduler-side `resolve_draft_worker_attention_backend` swaps in flashinfer, which cannot run
   on CPU (`NameError: BatchPrefillWithRaggedKVCacheWrapper`).
   -> `torch_native` is added through SGLang's own `add_draft_attention_backend_choices`.
3. `DFlashWorkerV2.forward_batch_generation` calls `batch.seq_lens.record_stream(...)`
   unconditionally; on a CPU tensor PyTorch raises "unknown parameter type".
   -> `forward_batch_generation_hook` makes `record_stream` a no-op for CPU tensors while it runs.
4. `DFlashAttention` picks the fused Triton `table_qk_norm_rope_` kernel for bf16 activations;
   Triton has no CPU driver ("0 active drivers").
   -> `dflash_attention_init_hook` switches `use_table_qk_norm_rope` off, so the layer takes the
   plain `apply_qk_norm` + rotary path it already has.
5. The draft block runs as a TARGET_VERIFY batch through ENCODER_ONLY (bidirectional) layers; the
   torch-native TARGET_VERIFY attention in `attention.py` handles that (no hook here).
6. `ModelRunner._extend_forward_kwargs` casts `input_embeds` to bf16 whatever the model dtype, and
   DFLASH drafts from input_embeds, so `--dtype float32` fails with a dtype mismatch.
   -> `extend_forward_kwargs_hook` keeps the runner's dtype.
7. DFLASH's sampling verify (`dflash_utils.compute_dflash_sampling_correct_drafts_and_bonus`)
   needs `tree_speculative_sampling_target_only`, a CUDA kernel; without it DFLASH verifies
   sampling requests by the target's argmax, which does not keep the target's distribution.
   -> `forward_batch_generation_hook` installs the PyTorch version (spec_sampling.py) into
   `dflash_utils` once, so CPU sampling requests take SGLang's own rejection-sampling path; the
   top-k / top-p renormalisation there gets the kernels' semantics too (ties at the pivot kept)
   instead of dflash_utils' own rank-based fallback.

DFLASH keeps SGLang's overlap scheduler on CPU: `_handle_dflash` (unlike the EAGLE and NGRAM
handlers) does not turn it off for CPU, and DFlashWorkerV2 serves correctly overlapped once the
hooks above are in place.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

DRAFT_BACKEND = "torch_native"

HANDLE_DFLASH = "sglang.srt.arg_groups.speculative_hook._handle_dflash"
FORWARD_BATCH_GENERATION = "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.forward_batch_generation"
DFLASH_ATTENTION_INIT = "sglang.srt.models.dflash.DFlashAttention.__init__"
EXTEND_FORWARD_KWARGS = "sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs"


# --- 1 + 2: argument resolution ---------------------------------------------------------------


class _CpuDFlashPlatform:
    """Stand-in for `current_platform` while `_handle_dflash` runs on a CPU device.

    `_handle_dflash` asks the platform, through SGLang's out-of-tree platform API, whether DFLASH
    and a draft attention backend are supported; for in-tree platforms it instead hard-codes
    "cuda/npu/xpu". This stand-in answers through the out-of-tree API: DFLASH yes, draft backend
    torch_native. Everything else is delegated to the real platform.
    """

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def is_out_of_tree(self) -> bool:
        return True

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return algorithm == "DFLASH"

    def supports_speculative_draft_attention_backend(self, algorithm: str, backend: str) -> bool:
        return algorithm == "DFLASH" and backend == DRAFT_BACKEND

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return DRAFT_BACKEND


def handle_dflash_hook(original: Callable[..., Any], server_args: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on `sglang.srt.arg_groups.speculative_hook._handle_dflash`.

    Stock SGLang rejects DFLASH on device "cpu" before looking at anything else. For a CPU device
    the original function runs with `current_platform` presented as a platform that supports
    DFLASH with a torch_native draft (see `_CpuDFlashPlatform`), so every other validation and
    default of `_handle_dflash` (pp size, draft path, block size, dp attention, ...) still applies,
    and a non-torch_native draft backend request falls back to torch_native instead of flashinfer.
    Other devices are passed through untouched.
    """
    from sglang.srt.arg_groups import speculative_hook
    from sglang.srt.arg_groups.overrides import resolving_view

    if resolving_view(server_args).device != "cpu":
        return original(server_args, *args, **kwargs)
    logger.info("sglang-tts: DFLASH on CPU, draft attention %s", DRAFT_BACKEND)
    real = speculative_hook.current_platform
    speculative_hook.current_platform = _CpuDFlashPlatform(real)
    try:
        return original(server_args, *args, **kwargs)
    finally:
        speculative_hook.current_platform = real


def allow_torch_native_draft_backend() -> None:
    """Add torch_native to SGLang's DFLASH draft attention backends (idempotent).

    `DRAFT_ATTENTION_BACKEND_CHOICES` is consulted by `draft_worker_common.
    resolve_draft_worker_attention_backend` when the scheduler builds the DFLASH draft worker;
    without torch_native there it silently swaps in flashinfer. The list feeds no CLI `choices=`,
    and only DFLASH-family draft workers read it.
    """
    from sglang.srt.arg_groups.choices import DRAFT_ATTENTION_BACKEND_CHOICES, add_draft_attention_backend_choices

    if DRAFT_BACKEND not in DRAFT_ATTENTION_BACKEND_CHOICES:
        add_draft_attention_backend_choices([DRAFT_BACKEND])


# --- 3: record_stream on CPU tensors ----------------------------------------------------------


def _guarded_record_stream(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def record_stream(tensor: torch.Tensor, stream: Any) -> Any:
        # A CPU tensor has no caching-allocator stream to record; PyTorch raises instead of
        # ignoring it. Every other device keeps the real call.
        if tensor.device.type == "cpu":
            return None
        return original(tensor, stream)

    record_stream.__sglang_tts_cpu_guard__ = True  # type: ignore[attr-defined]
    return record_stream


@contextlib.contextmanager
def cpu_record_stream_is_noop() -> Iterator[None]:
    """Within the block, `Tensor.record_stream` does nothing for CPU tensors."""
    current = torch.Tensor.record_stream
    if getattr(current, "__sglang_tts_cpu_guard__", False):
        yield
        return
    torch.Tensor.record_stream = _guarded_record_stream(current)  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.record_stream = current  # type: ignore[method-assign]


def forward_batch_generation_hook(original: Callable[..., Any], worker: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on `DFlashWorkerV2.forward_batch_generation` (speculative/dflash_worker_v2.py).

    Each decode step calls `batch.seq_lens.record_stream(current_stream())` so the CUDA caching
    allocator knows the overlap-carried tensor is used on this stream. CPU tensors have no such
    bookkeeping and PyTorch raises; for the duration of this call only, the CPU case is a no-op.
    """
    enable_sampling_verify()
    with cpu_record_stream_is_noop():
        return original(worker, *args, **kwargs)


# --- 7: sampling verify ---------------------------------------------------------------------


def enable_sampling_verify() -> None:
    """Give `dflash_utils` the PyTorch target-only sampler where the platform has no kernel.

    `dflash_utils` resolves its availability flag at import time; both names are module globals
    read at call time by `is_dflash_sampling_verify_available` and the sampling verify itself.
    """
    import sglang.srt.speculative.dflash_utils as dflash_utils

    from sglang_tts.platform.cpu.spec_sampling import fill_missing_sampling_ops

    if dflash_utils.tree_speculative_sampling_target_only is None:
        fill_missing_sampling_ops(dflash_utils)
        dflash_utils._DFLASH_SAMPLING_VERIFY_AVAILABLE = True


# --- 4: fused Triton QK-norm + RoPE ----------------------------------------------------------


def dflash_attention_init_hook(result: None, attention: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on `sglang.srt.models.dflash.DFlashAttention.__init__`.

    `DFlashAttention.forward` uses the Triton kernel `table_qk_norm_rope_` for bf16 activations
    when this flag is set; Triton cannot launch on CPU. With the flag off the layer uses its
    existing `apply_qk_norm` + `rotary_emb` path (identical maths).
    """
    attention.use_table_qk_norm_rope = False
    return None


# --- 6: input_embeds dtype ------------------------------------------------------------------


def extend_forward_kwargs_hook(
    result: dict[str, Any], runner: Any, forward_batch: Any, *args: Any, **kwargs: Any
) -> dict[str, Any]:
    """AFTER hook on `sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs`.

    That function hands `forward_batch.input_embeds` to the model as `.bfloat16()` whatever the
    model's dtype. DFLASH feeds its draft block as input_embeds (the target's embedding of
    [bonus, mask, ...]), so with `--dtype float32` the draft's first projection sees bf16
    activations against fp32 weights and fails ("expected m1 and m2 to have the same dtype"),
    besides losing precision. Where the runner's dtype is not bf16 the embeddings are re-cast
    from the original tensor to it, and the `replace_embeds` scatter the function applies is
    redone on the re-cast copy. bf16 runners keep the stock result.
    """
    embeds = forward_batch.input_embeds
    if embeds is None or "input_embeds" not in result:
        return result
    dtype = runner.dtype
    if dtype == torch.bfloat16 or result["input_embeds"].dtype == dtype:
        return result
    fixed = embeds.to(dtype)
    if forward_batch.replace_embeds is not None and forward_batch.replace_positions is not None:
        fixed = fixed.clone() if fixed is embeds else fixed
        fixed[forward_batch.replace_positions] = forward_batch.replace_embeds.to(dtype)
    result["input_embeds"] = fixed
    return result


def register_hooks(registry: Any, hook_type: Any) -> None:
    """Register the DFLASH-on-CPU hooks with SGLang's HookRegistry (see module docstring)."""
    allow_torch_native_draft_backend()
    registry.register(HANDLE_DFLASH, handle_dflash_hook, hook_type.AROUND)
    registry.register(FORWARD_BATCH_GENERATION, forward_batch_generation_hook, hook_type.AROUND)
    registry.register(DFLASH_ATTENTION_INIT, dflash_attention_init_hook, hook_type.AFTER)
    registry.register(EXTEND_FORWARD_KWARGS, extend_forward_kwargs_hook, hook_type.AFTER)
