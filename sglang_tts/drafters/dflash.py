"""Differentiable DFlash (block-diffusion) drafter, numerically the model SGLang 0.5.23 serves
for DFLASH.

Matches `sglang/srt/models/dflash.py` (DFlashDraftModel, DFlashDecoderLayer, DFlashAttention,
DFlashMLP) and the worker that drives it, `sglang/srt/speculative/dflash_worker_v2.py`:

- Context injection (dflash_worker_v2.py:_append_target_hidden_to_draft_kv_by_loc): the target
  features of committed tokens (concat of the target layers in `dflash_config.target_layer_ids`,
  each the output of that layer) become `ctx = hidden_norm(fc(features))`
  (DFlashDraftModel.project_target_hidden); every layer turns ctx straight into K/V with its own
  k/v projections -- no input_layernorm -- then `k_norm` per head and RoPE at the context token's
  own position (DFlashAttention.kv_proj_only, apply_k_norm, apply_k_rope). V is scaled by
  `attention_value_scale` when set.
- Block (dflash_worker_v2.py, draft block prepare): ids `[anchor, MASK, ..., MASK]` of length
  `block_size` at positions `anchor_pos + 0..block_size-1`, embedded with the target embedding
  (the mask row replaced by `mask_embedding.pt` when the checkpoint ships one,
  _maybe_merge_trained_mask_embedding).
- Layers (DFlashDecoderLayer.forward, Qwen3-style pre-norm with SGLang's fused residual): q/k/v
  from `input_layernorm(h)`, `q_norm`/`k_norm` per head (RMSNorm over head_dim) then RoPE,
  bias iff `attention_bias`; attention is ENCODER_ONLY (non-causal): every block slot sees all
  context K/V and every slot of the block. Final `norm(h + residual)`.
- Output (dflash_worker_v2.py, greedy/selector samplers: `hidden[:, 1:]`): block slot j >= 1 is
  projected by the target LM head and proposes the token at position `anchor_pos + j`.

Canvas convention and the shift it needs: canvas position k must give the logits of the token
after `input_ids[:, k]`, i.e. at position anchor_pos + k + 1, which is block slot k + 1. So
`canvas_hidden[:, k] = block_hidden[:, k + 1]` for k < block_size - 1. Canvas positions
k >= block_size - 1 have no block slot (the round drafted only block_size - 1 tokens): their
hidden is zero and `teacher_probs` masks them out. DFlash never reads the drafted tokens:
`canvas.input_ids[:, 1:]` are ignored and the mask token is fed instead, exactly as at inference.

Context in a canvas: `features` [B, L, F] at `context_positions` [B, L] (valid where
`context_mask`), plus optional detached `past_kv`/`past_mask` for older context (from
`kv_for_context`). Context rows at or after the anchor position are ignored: SGLang's draft cache
holds only committed tokens (positions < anchor) when the block runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sglang_tts.core.canvas import Canvas
from sglang_tts.core.prompt import PromptBatch, PromptTerms, RowsHook
from sglang_tts.drafters.common import (
    CheckpointTensorError,
    KVCache,
    RMSNorm,
    RopeSpec,
    Rotary,
    SwiGLUMLP,
    UnsupportedDrafterConfigError,
    check_past,
    check_tensor_shape,
    detach_kv,
    head_dim_of,
    masked_attention,
    split_heads,
    text_config,
)
from sglang_tts.drafters.wgrad import Linear

DFLASH_ARCHITECTURES = ("DFlashDraftModel",)
# SpecForge DFlash recipe for block 16 (loss_decay_gamma: 7.0): w_k = exp(-(k - 1) / gamma).
DFLASH_LOSS_DECAY_GAMMA = 7.0
# Prompt-time adaptation: at most this many blocks per prompt window, evenly spaced (each block's
# slots run over the window's context; more blocks cost memory linear in blocks x window length).
PROMPT_BLOCKS = 64


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default target layers when the config lists none (speculative/dflash_utils.py:build_target_layer_ids)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(f"DFlash default layer selection needs >= 4 target layers, got {num_target_layers}")
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    rms_norm_eps: float
    vocab_size: int
    block_size: int
    mask_token_id: int | None
    target_layer_ids: list[int]
    num_target_layers: int | None
    attention_bias: bool
    value_scale: float | None
    rope: RopeSpec

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], target_num_layers: int | None = None) -> DFlashConfig:
        """Read what `models/dflash.py` and `dflash_utils.py:parse_dflash_draft_config` read.

        `target_num_layers` (the runtime target's depth) resolves default target_layer_ids as
        SGLang does; without it the config's num_target_layers is used.
        """
        dflash = cfg.get("dflash_config") or {}
        text = text_config(cfg)
        unsupported = {
            "use_gemma_norm": bool(cfg.get("use_gemma_norm", False)),
            "dflash_config.conv_kernel_size (DFlash 2 convolutions)": bool(dflash.get("conv_kernel_size", 0)),
            "dflash_config.selector_rank (DFlash 2 candidate selector)": bool(dflash.get("selector_rank", 0)),
            "projector_type": dflash.get("projector_type", cfg.get("projector_type")) is not None,
            "dflash_config.attention_sink_bias": bool(dflash.get("attention_sink_bias", False)),
            "has_embed_tokens (draft-owned embedding)": bool(cfg.get("has_embed_tokens", False)),
            "is_causal=true": bool(text.get("is_causal", False)),
            "output_multiplier / final_logit_softcapping": float(dflash.get("output_multiplier", 1.0)) != 1.0
            or bool(dflash.get("final_logit_softcapping")),
        }
        for what, present in unsupported.items():
            if present:
                raise UnsupportedDrafterConfigError(f"DFlash option {what} is not supported by the TTS drafter")
        layer_types = text.get("layer_types")
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            raise UnsupportedDrafterConfigError(f"DFlash layer_types {layer_types}: only full_attention is supported")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedDrafterConfigError(f"DFlash hidden_act {act!r}: only silu is supported")
        num_layers = int(text["num_hidden_layers"])
        block_size = int(dflash.get("block_size", cfg.get("block_size")) or 16)
        mask_token_id = dflash.get("mask_token_id", cfg.get("mask_token_id"))
        num_target_layers = dflash.get("num_target_layers", cfg.get("num_target_layers"))
        layer_ids = dflash.get("target_layer_ids", cfg.get("target_layer_ids"))
        if layer_ids is None:
            depth = target_num_layers or num_target_layers
            if depth is None:
                raise ValueError("DFlash config has no target_layer_ids and no num_target_layers to derive them")
            layer_ids = build_target_layer_ids(int(depth), num_layers)
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise UnsupportedDrafterConfigError(f"num_attention_heads {heads} not a multiple of kv heads {kv_heads}")
        value_scale = dflash.get("attention_value_scale")
        return cls(
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim_of(text),
            num_hidden_layers=num_layers,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            vocab_size=int(text["vocab_size"]),
            block_size=block_size,
            mask_token_id=int(mask_token_id) if mask_token_id is not None else None,
            target_layer_ids=[int(i) for i in layer_ids],
            num_target_layers=int(num_target_layers) if num_target_layers is not None else None,
            attention_bias=bool(text.get("attention_bias", False)),
            value_scale=float(value_scale) if value_scale is not None else None,
            rope=RopeSpec.from_config(text, default_max_position=32768),
        )


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.value_scale = cfg.value_scale
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def key_value(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated) and V (scaled), [B, H_kv, T, D], for the rows of x [B, T, H]."""
        k = rotary(self.k_norm(split_heads(self.k_proj(x), self.num_kv_heads, self.head_dim)), positions)
        v = split_heads(self.v_proj(x), self.num_kv_heads, self.head_dim)
        if self.value_scale is not None:
            v = v * self.value_scale
        return k, v

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: Rotary,
        prefix: Sequence[tuple[torch.Tensor, torch.Tensor]],
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """`prefix`: this layer's K/V before the block as segments in key order (the detached past,
        the context rows), attended without joining them; the block's keys come last in `visible`."""
        q = rotary(self.q_norm(split_heads(self.q_proj(x), self.num_heads, self.head_dim)), positions)
        k, v = self.key_value(x, positions, rotary)
        keys, values = [pk for pk, _ in prefix] + [k], [pv for _, pv in prefix] + [v]
        return self.o_proj(masked_attention(q, keys, values, visible, self.scale))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: Rotary,
        prefix: Sequence[tuple[torch.Tensor, torch.Tensor]],
        visible: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            x = self.input_layernorm(hidden)
        else:
            x, residual = self.input_layernorm(hidden, residual)
        attn_out = self.self_attn(x, positions, rotary, prefix, visible)
        x, residual = self.post_attention_layernorm(attn_out, residual)
        return self.mlp(x), residual


class DFlashDrafter(nn.Module):
    """Trainable DFlash drafter (DifferentiableDrafter). Module names are the checkpoint's, so
    `state_dict()` is a loadable DFlash checkpoint; embedding and LM head are the target's."""

    kind = "dflash"

    def __init__(
        self,
        cfg: DFlashConfig,
        target_embedding: torch.Tensor | None = None,
        target_lm_head: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.block_size = cfg.block_size
        self.mask_token_id = cfg.mask_token_id
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.rope)
        # Borrowed, frozen: buffers so no optimiser sees them; non-persistent so state_dict() is
        # exactly the drafter checkpoint.
        self.register_buffer("embed_weight", None, persistent=False)
        self.register_buffer("borrowed_lm_head", None, persistent=False)
        self.register_buffer("mask_embedding", None, persistent=False)
        self.attach_target(target_embedding, target_lm_head)

    # ------------------------------------------------------------------ set-up

    def attach_target(self, embedding: torch.Tensor | None, lm_head: torch.Tensor | None) -> None:
        h = self.cfg.hidden_size
        if embedding is not None:
            if embedding.shape[-1] != h:
                raise ValueError(f"target embedding width {embedding.shape[-1]} != DFlash hidden_size {h}")
            self.embed_weight = embedding.detach()
        if lm_head is not None:
            if lm_head.shape[-1] != h:
                raise ValueError(f"target lm_head width {lm_head.shape[-1]} != DFlash hidden_size {h}")
            self.borrowed_lm_head = lm_head.detach()

    def set_mask_embedding(self, embedding: torch.Tensor, mask_token_id: int) -> None:
        """A trained mask-token embedding (mask_embedding.pt), used in place of the target's row."""
        if self.mask_token_id is not None and mask_token_id != self.mask_token_id:
            raise ValueError(
                f"mask_embedding.pt was trained for mask id {mask_token_id}, config says {self.mask_token_id}"
            )
        self.mask_embedding = embedding.detach().reshape(self.cfg.hidden_size)

    def checkpoint_plan(
        self, shapes: dict[str, tuple[int, ...]], partial: bool = False
    ) -> tuple[dict[str, str], list[str]]:
        """What `load_checkpoint_weights` makes of tensors of these names and shapes, values unread:
        {stored name: own name} and the ignored names; raises CheckpointTensorError naming a tensor
        whose shape does not fit, or the tensors the checkpoint lacks (none with `partial`: some of a
        drafter's tensors, a weight update). Names: `layers.*`, `fc`,
        `hidden_norm`, `norm` (optional `model.` prefix; the native export's `encoder.fc.weight` /
        `encoder.output_norm_enc.weight` aliases), as models/dflash.py:DFlashDraftModel.load_weights."""
        aliases = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}
        own = {name: tuple(t.shape) for name, t in self.state_dict().items()}
        plan: dict[str, str] = {}
        ignored: list[str] = []
        for raw_name, shape in shapes.items():
            name = aliases.get(raw_name, raw_name.removeprefix("model."))
            if name not in own:
                ignored.append(raw_name)
                continue
            check_tensor_shape(raw_name, shape, own[name])
            plan[raw_name] = name
        missing = [] if partial else sorted(set(own) - set(plan.values()))
        if missing:
            raise CheckpointTensorError(f"DFlash checkpoint is missing {missing}")
        return plan, ignored

    def load_checkpoint_weights(self, weights: dict[str, torch.Tensor]) -> list[str]:
        """Load a DFlash checkpoint's tensors (names and checks: `checkpoint_plan`, which runs before
        anything is copied). Returns the ignored names."""
        plan, ignored = self.checkpoint_plan({raw: tuple(t.shape) for raw, t in weights.items()})
        own = self.state_dict()
        with torch.no_grad():
            for raw_name, name in plan.items():
                own[name].copy_(weights[raw_name])
        return ignored

    # ------------------------------------------------------------------ pieces

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_weight is None:
            raise RuntimeError("DFlashDrafter has no embedding: pass the target's (attach_target)")
        emb = F.embedding(input_ids, self.embed_weight).to(self.fc.weight.dtype)
        if self.mask_embedding is not None:
            is_mask = (input_ids == self.mask_token_id)[..., None]
            emb = torch.where(is_mask, self.mask_embedding.to(emb.dtype), emb)
        return emb

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """hidden_norm(fc(features)) (DFlashDraftModel.project_target_hidden)."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> KVCache:
        """Per-layer context K/V [B, H_kv, L, D] for features [B, L, F] at positions [B, L]."""
        ctx = self.project_context(features)
        return [layer.self_attn.key_value(ctx, positions, self.rotary) for layer in self.layers]

    @torch.no_grad()
    def kv_for_context(self, features: torch.Tensor, positions: torch.Tensor) -> KVCache:
        """Detached context K/V, the `past_kv` a canvas carries for older context."""
        return detach_kv(self.context_kv(features, positions))

    def block_hidden(
        self,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        features: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
        past_kv: KVCache | None = None,
        past_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Normed hidden [B, S, H] of one block forward over explicit block ids [B, S].

        The block attends (non-causally) to `past_kv`, to the context rows of `features` that
        are valid and lie before the block's first position, and to all of its own slots.
        """
        b, s = block_ids.shape
        device = block_ids.device
        past_mask = check_past(past_kv, past_mask, len(self.layers), b)
        prefix: list[KVCache] = [detach_kv(past_kv)] if past_kv is not None else []
        key_mask = [past_mask] if past_mask is not None else []
        if features is not None and features.shape[1] > 0:
            if context_positions is None:
                raise ValueError("DFlash context features need context_positions")
            valid = context_positions < block_positions[:, :1]
            if context_mask is not None:
                valid = valid & context_mask.bool()
            prefix.append(self.context_kv(features, context_positions))
            key_mask.append(valid)
        key_mask.append(torch.ones(b, s, dtype=torch.bool, device=device))
        visible = torch.cat(key_mask, dim=1)[:, None, :].expand(b, s, -1)
        return self._run_block(block_ids, block_positions, prefix, visible)

    def _run_block(
        self,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        prefix: list[KVCache],
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """Blocks [B, S] through all layers over prefix K/V (caches in key order, never joined);
        `visible` [B, S, L + S]."""
        hidden, residual = self.embed(block_ids), None
        for i, layer in enumerate(self.layers):
            layer_prefix = [cache[i] for cache in prefix]
            hidden, residual = layer(hidden, residual, block_positions, self.rotary, layer_prefix, visible)
        normed, _ = self.norm(hidden, residual)
        return normed

    def anchored_block_hidden(
        self,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        features: torch.Tensor,
        context_positions: torch.Tensor,
        context_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Training forward of A blocks per sequence: normed hidden [B, A, S, H].

        block_ids / block_positions [B, A, S]; features [B, L, F] at context_positions [B, L]
        (valid where context_mask). Each block sees what `block_hidden` would give it -- the valid
        context rows before its first position and all its own slots -- but the context K/V is
        computed once per sequence and shared by its A blocks, with gradients (SpecForge's
        parallel-blocks training, without flex attention).
        """
        b, a, s = block_ids.shape
        ctx_kv = self.context_kv(features, context_positions)
        prefix = [
            tuple(x[:, None].expand(b, a, *x.shape[1:]).reshape(b * a, *x.shape[1:]) for x in kv) for kv in ctx_kv
        ]
        before = context_positions[:, None, :] < block_positions[:, :, :1]  # [B, A, L]
        ctx_visible = (before & context_mask.bool()[:, None, :]).reshape(b * a, -1)
        own = torch.ones(b * a, s, dtype=torch.bool, device=block_ids.device)
        visible = torch.cat((ctx_visible, own), dim=1)[:, None, :].expand(b * a, s, -1)
        hidden = self._run_block(block_ids.reshape(b * a, s), block_positions.reshape(b * a, s), [prefix], visible)
        return hidden.reshape(b, a, s, -1)

    def block_ids_for(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """[anchor, MASK * (block_size - 1)] for anchors [B]."""
        if self.mask_token_id is None:
            raise RuntimeError("DFlash config has no mask_token_id; set dflash_config.mask_token_id")
        block = torch.full(
            (anchor_ids.shape[0], self.block_size), self.mask_token_id, dtype=torch.long, device=anchor_ids.device
        )
        block[:, 0] = anchor_ids
        return block

    def prompt_terms(self, batch: PromptBatch, depth: int, on_rows: RowsHook | None = None) -> PromptTerms:
        """Blocks over prompt windows (core/prompt.py): at most PROMPT_BLOCKS anchors per window, evenly
        spaced over window indices 1 .. n - 1; block [token a, MASK, ...] at a's position sees the
        window's features of tokens before a, and slot k (1 .. min(depth, block_size - 1)) predicts
        token a + k, weight exp(-(k - 1) / 7) (the update's weights). Slots past the window are dropped."""
        b, t1 = batch.token_ids.shape
        s = self.block_size
        slots = max(1, min(depth, s - 1))
        device = batch.token_ids.device
        lengths = batch.real.sum(1) - 1  # real feature rows per window
        a = int(min(PROMPT_BLOCKS, max(int(lengths.max()) - 1, 1)))
        # anchor i of a window with n rows: 1 + floor(i * (n - 1) / a), i < min(a, n - 1)
        steps = torch.arange(a, device=device)
        anchors = 1 + (steps[None] * (lengths[:, None] - 1).clamp(min=0)) // a
        keep = steps[None] < (lengths[:, None] - 1).clamp(min=0)
        anchors = anchors.clamp(max=t1 - 1)
        blocks = self.block_ids_for(batch.token_ids.gather(1, anchors).flatten()).view(b, a, s)
        positions = batch.positions.gather(1, anchors)[..., None] + torch.arange(s, device=device)
        if on_rows is not None:
            on_rows(torch.arange(b, device=device).repeat_interleave(a))
        hidden = self.anchored_block_hidden(
            blocks, positions, batch.features, batch.positions[:, :-1], batch.feature_mask
        )  # [B, A, S, H]
        label_at = anchors[..., None] + torch.arange(1, slots + 1, device=device)  # [B, A, slots]
        clamped = label_at.clamp(max=t1 - 1)
        labels = batch.token_ids.gather(1, clamped.flatten(1)).view_as(label_at)
        real = batch.real.gather(1, clamped.flatten(1)).view_as(label_at)
        labelled = keep[..., None] & (label_at < t1) & real
        weights = torch.exp(-torch.arange(slots, dtype=torch.float32, device=device) / DFLASH_LOSS_DECAY_GAMMA)
        rows = torch.arange(b, device=device)[:, None, None].expand_as(label_at)
        return PromptTerms(
            hidden[:, :, 1 : slots + 1][labelled],
            labels[labelled],
            weights.expand_as(label_at)[labelled],
            rows[labelled],
        )

    # ------------------------------------------------------------------ DifferentiableDrafter

    def canvas_hidden(self, canvas: Canvas) -> torch.Tensor:
        """Hidden [B, C, H]: canvas position k is block slot k + 1 (module docstring); positions
        k >= block_size - 1 are zero. `canvas.input_ids[:, 1:]` is ignored (MASK is fed)."""
        b, c = canvas.input_ids.shape
        if canvas.context_rows is not None:
            raise ValueError("DFlash canvases carry their context per row (context_rows is EAGLE-3 stacking)")
        if canvas.features.dim() != 3 or canvas.features.shape[-1] != self.fc.in_features:
            expected = f"[B, L, {self.fc.in_features}]"
            raise ValueError(f"DFlash canvas.features must be {expected}, got {tuple(canvas.features.shape)}")
        offsets = torch.arange(self.block_size, device=canvas.positions.device)
        block_positions = canvas.positions[:, :1] + offsets
        hidden = self.block_hidden(
            self.block_ids_for(canvas.input_ids[:, 0]),
            block_positions,
            canvas.features,
            canvas.context_positions,
            canvas.context_mask,
            canvas.past_kv,
            canvas.past_mask,
        )
        drafted = hidden[:, 1 : 1 + c]
        if drafted.shape[1] < c:
            drafted = torch.cat((drafted, drafted.new_zeros(b, c - drafted.shape[1], drafted.shape[-1])), dim=1)
        return drafted

    def lm_head_weight(self) -> torch.Tensor:
        if self.borrowed_lm_head is None:
            raise RuntimeError("DFlashDrafter has no LM head: pass the target's (attach_target)")
        return self.borrowed_lm_head.to(self.fc.weight.dtype)

    def canvas_logits(self, canvas: Canvas) -> torch.Tensor:
        return self.canvas_hidden(canvas) @ self.lm_head_weight().T

    def teacher_probs(self, canvas: Canvas) -> tuple[torch.Tensor, torch.Tensor]:
        """softmax(target_logits) over the full vocabulary (DFlash drafts in the target's), and a
        mask that drops canvas positions without a block slot (k >= block_size - 1)."""
        probs = torch.softmax(canvas.target_logits.float(), dim=-1)
        b, c = canvas.input_ids.shape
        has_slot = torch.arange(c, device=probs.device) < self.block_size - 1
        return probs, has_slot[None].expand(b, c)

    def default_position_weights(self, length: int) -> torch.Tensor:
        """w_k = exp(-(k - 1) / 7), k = 1..length (SpecForge DFlash loss_decay_gamma = 7)."""
        return torch.exp(-torch.arange(length, dtype=torch.float32) / DFLASH_LOSS_DECAY_GAMMA)

    def trainable_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]
