"""Torch-native attention for speculative decoding on CPU.

SGLang's `torch_native` backend serves plain prefill/decode but knows neither TARGET_VERIFY
(the target scores all draft tokens of a request in one pass) nor the multi-step draft decode
that EAGLE-style drafting needs; `DraftBackendFactory` has no `torch_native` entry at all. On GPU
those paths run in fused kernels; the CPU kernels that would do it (intel_amx) need AMX and the
CPU build of sgl-kernel. This module supplies both in plain PyTorch:

- `forward_target_verify`: query = the request's draft tokens; keys = its prefix plus the draft
  tokens. The prefix is fully visible; among drafts, a chain (tree_topk == 1) is causal, a tree uses
  the QLEN_ONLY [n, n] ancestor mask that `build_tree_kernel_efficient` writes on CPU, and an
  ENCODER_ONLY layer (DFlash's draft block) sees the whole block.
- `forward_extend_prefix_aware`: EXTEND and DRAFT_EXTEND without the stock backend's padding. SGLang's
  `_run_sdpa_forward_extend` pads each request's queries to its whole length and runs an [L, L] causal
  attention, so extending 4 tokens after a 5K-token prefix costs as much as prefilling 5K tokens. The
  drafter extends once per round: on long prompts that made a speculative round 2-3 decode steps. Here
  the queries are only the new tokens, against the prefix and themselves: [n, L] work.
- `TorchNativeMultiStepDraftBackend`: one backend per draft step. Step i of branch k attends to
  the prefix and to its own draft slots `req_to_token[r, L + k*steps : L + k*steps + i + 1]`, the
  slot layout of SGLang's `generate_draft_decode_kv_indices` / `assign_draft_cache_locs`.

Installed by `sglang_tts.platform.cpu.install()` as HookRegistry AROUND hooks, only when the real
kernels are missing; on a GPU machine nothing here runs.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale,
    gqa: bool,
    causal: bool = False,
):
    """q [n, Hq, D], k/v [L, Hkv, D], mask [n, L] bool (True = visible) -> [n, Hq, Dv].

    `causal` (only without a mask) is SDPA's top-left causal mask: right for n == L.
    """
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    out = scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=None if mask is None else mask.unsqueeze(0).unsqueeze(0),
        scale=scale,
        enable_gqa=gqa,
        is_causal=causal and mask is None,
    )
    return out.squeeze(0).transpose(0, 1)


def target_verify_mask(prefix_len: int, n: int, spec_info, request_index: int, bidirectional: bool) -> torch.Tensor:
    """[n, prefix_len + n] visibility of a request's draft tokens in TARGET_VERIFY."""
    mask = torch.ones((n, prefix_len + n), dtype=torch.bool)
    if bidirectional:
        return mask
    tree_topk = getattr(spec_info, "tree_topk", 1)
    custom_mask = getattr(spec_info, "custom_mask", None)
    if tree_topk != 1 and custom_mask is not None and custom_mask.numel() > 0:
        # QLEN_ONLY layout: one [n, n] ancestor-or-self mask per request, flattened back to back.
        block = custom_mask[request_index * n * n : (request_index + 1) * n * n].view(n, n)
        mask[:, prefix_len:] = block.to(torch.bool).cpu()
    else:
        mask[:, prefix_len:] = torch.ones((n, n), dtype=torch.bool).tril()
    return mask


def verify_plan(forward_batch, req_to_token: torch.Tensor, n: int, bidirectional: bool, device) -> list:
    """Per request (query rows, KV slots as long, [n, prefix + n] mask) for TARGET_VERIFY, once per forward.

    Every layer of the target asks for the same slots and masks; rebuilding them per layer cost 7% of
    a verify on the default model. The plan is cached on the forward batch, keyed by what shapes it,
    so the next forward (a new batch, or new lengths) gets a fresh one.
    """
    seq_lens = tuple(forward_batch.seq_lens.tolist())
    pools = tuple(forward_batch.req_pool_indices.tolist())
    spec_info = forward_batch.spec_info

    def build() -> list:
        return [
            (
                slice(r * n, (r + 1) * n),
                req_to_token[pool_idx, : prefix_len + n].long(),
                target_verify_mask(prefix_len, n, spec_info, r, bidirectional).to(device),
            )
            for r, (prefix_len, pool_idx) in enumerate(zip(seq_lens, pools))
        ]

    return _cached_plan(forward_batch, (n, bidirectional, str(device), seq_lens, pools, id(spec_info)), build)


def _cached_plan(forward_batch, key: tuple, build) -> list:
    """`build()` once per forward batch and key (the plans live on the batch, gone with it)."""
    cache = getattr(forward_batch, "_tts_verify_plans", None)
    if cache is None:
        cache = {}
        forward_batch._tts_verify_plans = cache
    plan = cache.get(key)
    if plan is None:
        plan = cache[key] = build()
    return plan


def _attend_by_plan(backend, q, k, v, layer, forward_batch, save_kv_cache: bool, plan_for, causal: bool = False):
    """Write the new KV at `out_cache_loc`, then one SDPA per request of `plan_for(device)`.

    q [tokens, Hq * D] -> [tokens, Hq * Dv]. The plan holds per request (query rows, KV slots, mask or
    None); `causal` applies SDPA's own causal mask where a request has no mask.
    """
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    pool = backend.token_to_kv_pool
    if save_kv_cache and k is not None and v is not None:
        pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v)
    o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
    q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
    o_ = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
    k_cache = pool.get_key_buffer(layer.layer_id)
    v_cache = pool.get_value_buffer(layer.layer_id)
    gqa = layer.tp_q_head_num != layer.tp_k_head_num
    for rows, slots, mask in plan_for(q.device):
        if rows.start == rows.stop:
            continue
        o_[rows] = _sdpa(q_[rows], k_cache[slots], v_cache[slots], mask, layer.scaling, gqa, causal=causal)
    return o


def forward_target_verify(backend, q, k, v, layer, forward_batch, save_kv_cache: bool = True) -> torch.Tensor:
    """TARGET_VERIFY attention for `TorchNativeAttnBackend` (see module docstring)."""
    from sglang.srt.layers.radix_attention import AttentionType

    n = int(forward_batch.spec_info.draft_token_num)
    bidirectional = layer.attn_type == AttentionType.ENCODER_ONLY
    req_to_token = backend.req_to_token_pool.req_to_token

    def plan_for(device) -> list:
        return verify_plan(forward_batch, req_to_token, n, bidirectional, device)

    return _attend_by_plan(backend, q, k, v, layer, forward_batch, save_kv_cache, plan_for)


def extend_mask(prefix_len: int, n: int, sliding_window: int | None) -> torch.Tensor | None:
    """[n, prefix_len + n] visibility of n extended tokens after a prefix (None: plain causal).

    Token i sits at position prefix_len + i and sees every key at or before it (and, with a sliding
    window w, none more than w positions back: SGLang's `_make_sliding_window_mask` rule).
    """
    if prefix_len == 0 and sliding_window is None:
        return None
    q_pos = torch.arange(prefix_len, prefix_len + n).unsqueeze(1)
    k_pos = torch.arange(prefix_len + n).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos >= q_pos - sliding_window
    return mask


def extend_plan(forward_batch, req_to_token: torch.Tensor, causal: bool, window: int | None, device) -> list:
    """Per request (query rows, KV slots as long, mask or None) for EXTEND, built once per forward.

    Cached on the forward batch like `verify_plan`: every layer of a model asks for the same plan.
    """
    seq_lens = tuple(forward_batch.seq_lens.tolist())
    prefix_lens = tuple(forward_batch.extend_prefix_lens.tolist())
    pools = tuple(forward_batch.req_pool_indices.tolist())

    def build() -> list:
        plan, start = [], 0
        for seq_len, prefix_len, pool_idx in zip(seq_lens, prefix_lens, pools):
            n = seq_len - prefix_len
            mask = extend_mask(prefix_len, n, window) if causal else None
            plan.append(
                (
                    slice(start, start + n),
                    req_to_token[pool_idx, :seq_len].long(),
                    None if mask is None else mask.to(device),
                )
            )
            start += n
        return plan

    return _cached_plan(forward_batch, ("extend", causal, window, str(device), seq_lens, prefix_lens, pools), build)


def forward_extend_prefix_aware(backend, q, k, v, layer, forward_batch, save_kv_cache: bool = True) -> torch.Tensor:
    """EXTEND / DRAFT_EXTEND attention for `TorchNativeAttnBackend`: queries are the new tokens only.

    Same contract as SGLang's `TorchNativeAttnBackend.forward_extend` for self-attention (KV written
    at `out_cache_loc`; causal unless the layer is ENCODER_ONLY; SGLang's sliding-window rule).
    """
    from sglang.srt.layers.radix_attention import AttentionType

    causal = layer.attn_type != AttentionType.ENCODER_ONLY
    window = layer.sliding_window_size
    window = window if causal and window is not None and window > -1 else None
    req_to_token = backend.req_to_token_pool.req_to_token

    def plan_for(device) -> list:
        return extend_plan(forward_batch, req_to_token, causal, window, device)

    return _attend_by_plan(backend, q, k, v, layer, forward_batch, save_kv_cache, plan_for, causal=causal)


class TorchNativeDraftStepBackend:
    """Attention for draft step `step` of a multi-step EAGLE draft (decode mode, bs*topk tokens)."""

    def __init__(self, model_runner, topk: int, speculative_num_steps: int, step: int):
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        self.inner = TorchNativeAttnBackend(model_runner)
        self.topk = topk
        self.num_steps = speculative_num_steps
        self.step = step

    def __getattr__(self, name):
        # Everything we do not override behaves like SGLang's own torch_native backend.
        return getattr(self.inner, name)

    def init_forward_metadata(self, forward_batch) -> None:
        self.inner.init_forward_metadata(forward_batch)

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        inner = self.inner
        pool = inner.token_to_kv_pool
        if save_kv_cache and k is not None and v is not None:
            pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
        q = q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim)
        o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o_ = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        k_cache = pool.get_key_buffer(layer.layer_id)
        v_cache = pool.get_value_buffer(layer.layer_id)
        req_to_token = inner.req_to_token_pool.req_to_token
        gqa = layer.tp_q_head_num != layer.tp_k_head_num
        seq_lens = forward_batch.seq_lens.tolist()
        pools = forward_batch.req_pool_indices.tolist()
        for r, (prefix_len, pool_idx) in enumerate(zip(seq_lens, pools)):
            row = req_to_token[pool_idx]
            prefix = row[:prefix_len]
            for branch in range(self.topk):
                start = prefix_len + branch * self.num_steps
                slots = torch.cat([prefix, row[start : start + self.step + 1]]).long()
                t = r * self.topk + branch
                o_[t : t + 1] = _sdpa(q_[t : t + 1], k_cache[slots], v_cache[slots], None, layer.scaling, gqa)
        return o


class TorchNativeMultiStepDraftBackend:
    """Per-step torch-native backends for EAGLE's multi-step draft (steps 0 .. num_steps-2)."""

    def __init__(self, model_runner, topk: int, speculative_num_steps: int):
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.attn_backends = [
            TorchNativeDraftStepBackend(model_runner, topk, speculative_num_steps, step)
            for step in range(speculative_num_steps - 1)
        ]

    def init_forward_metadata(self, forward_batch) -> None:
        for backend in self.attn_backends:
            backend.init_forward_metadata(forward_batch)

    # CUDA graphs are never captured on CPU; these exist because SGLang probes for them.
    def init_cuda_graph_state(self, *args, **kwargs) -> None:
        return None


def _draft_backend_is_torch_native(factory) -> bool:
    from sglang.srt.runtime_context import attention_backends

    prefill_backend, decode_backend = attention_backends()
    return (factory.draft_attn_backend or decode_backend) == "torch_native" or (
        factory.draft_attn_backend is None and prefill_backend == "torch_native" and decode_backend is None
    )


def create_decode_backend_hook(original, factory, *args, **kwargs):
    """AROUND hook on DraftBackendFactory.create_decode_backend."""
    if factory.speculative_num_steps > 1 and _draft_backend_is_torch_native(factory):
        backend = TorchNativeMultiStepDraftBackend(
            factory.draft_model_runner, factory.topk, factory.speculative_num_steps
        )
        for b in [backend, *backend.attn_backends]:
            b.prefill_attention_backend_str = "torch_native"
            b.decode_attention_backend_str = "torch_native"
        return backend
    return original(factory, *args, **kwargs)


def create_draft_extend_backend_hook(original, factory, *args, **kwargs):
    """AROUND hook on DraftBackendFactory.create_draft_extend_backend."""
    if _draft_backend_is_torch_native(factory):
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        backend = TorchNativeAttnBackend(factory.draft_model_runner)
        backend.prefill_attention_backend_str = "torch_native"
        backend.decode_attention_backend_str = "torch_native"
        return backend
    return original(factory, *args, **kwargs)


def forward_extend_hook(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, *args, **kwargs):
    """AROUND hook on TorchNativeAttnBackend.forward_extend: adds TARGET_VERIFY, drops the padding.

    Cross-attention and encoder-decoder batches keep SGLang's own path.
    """
    if forward_batch.forward_mode.is_target_verify():
        return forward_target_verify(backend, q, k, v, layer, forward_batch, save_kv_cache)
    if not args and not kwargs and not layer.is_cross_attention and forward_batch.encoder_lens is None:
        return forward_extend_prefix_aware(backend, q, k, v, layer, forward_batch, save_kv_cache)
    return original(backend, q, k, v, layer, forward_batch, save_kv_cache, *args, **kwargs)
