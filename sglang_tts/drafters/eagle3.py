"""Differentiable EAGLE-3 drafter, numerically the model SGLang 0.5.23 serves for EAGLE3.

Matches `sglang/srt/models/llama_eagle3.py` (LlamaModel, LlamaDecoderLayer, LlamaForCausalLMEagle3)
on top of `sglang/srt/models/llama.py` (LlamaAttention, LlamaMLP):

- Features: `fc` maps the concat of `num_aux_hidden_states` target hidden states (each
  `target_hidden_size`, default `hidden_size`) to `hidden_size`; optional `input_norm`
  (eagle_config.norm_before_fc: one RMSNorm over the concat) then `fc_norm` (per-chunk RMSNorm,
  `fc_norm`/`use_aux_norm`) come first (llama_eagle3.py:LlamaModel.forward). SGLang applies `fc`
  only when the incoming hidden is not already `hidden_size` wide; that is how a recycled draft
  hidden skips it.
- Layer 0 (llama_eagle3.py:LlamaDecoderLayer.forward, is_input_layer): residual = hidden;
  attention input = cat[input_layernorm(embed), hidden_norm(hidden)] (2H wide, embed first);
  then `post_attention_layernorm(attn + residual)`, SwiGLU MLP. Later layers (num_hidden_layers > 1)
  take `hidden_norm(h + residual)` (H wide) and never use their embedding.
- Attention (llama.py:LlamaAttention): q/k/v with no bias (the EAGLE-3 layer overrides qkv_proj
  with bias=False), o_proj with bias iff `attention_bias` or `bias`; RoPE from rope_theta /
  rope_scaling / rope_parameters, head_dim from config or H / heads, neox style unless
  `rope_is_neox_style` is false; GQA; scale head_dim ** -0.5.
- Output: `norm(h + residual)` feeds the LM head over the draft vocabulary; the hidden recycled
  into the next draft step is the pre-norm sum `h + residual` unless `norm_output` (then the
  normed one) (llama_eagle3.py:LlamaModel.forward, "aux").
- Vocabulary: `lm_head` [draft_vocab_size, H]; draft id i is target id i + d2t[i]
  (LlamaForCausalLMEagle3.load_weights: hot_token_id = d2t + arange). `draft_vocab_size` absent:
  the LM head is the target's (load_lm_head_from_target) and the vocabularies coincide.
- Embedding: always the target's (eagle_worker_v2.py:init_lm_head -> set_embed), except when
  `target_hidden_size` differs from `hidden_size` (llama.py:LlamaForCausalLM.set_embed keeps the
  draft's own `embed_tokens.weight`). Either way it is frozen here.

Positions (eagle_worker_v2.py:EagleDraftWorker.draft_forward, eagle_worker_common.py:
prepare_for_draft / prepare_for_draft_extend): a draft row that consumes the hidden of the token at
position p and the embedding of the token at p + 1 runs RoPE at position p. In canvas terms
(`positions[:, k]` = position of `input_ids[:, k]`), canvas position k uses RoPE position
`positions[:, k] - 1`. Every method here takes the positions of the *embedded* tokens and subtracts
one itself.

Chain unroll (topk = 1, what SGLang's multi-step draft computes; see `canvas_hidden`): canvas
position 0 is the last row of SGLang's draft extend (target feature of x_{t-1}, embedding of x_t);
position k > 0 is draft step k (its own recycled hidden from position k - 1, embedding of d_k).
Each position attends to `past_kv` (earlier context, the draft-extend rows already in SGLang's
draft KV cache) and to canvas positions 0..k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sglang_tts.core.canvas import Canvas, TeacherVocab
from sglang_tts.core.prompt import PromptBatch, PromptTerms, RowsHook
from sglang_tts.drafters.common import (
    CheckpointTensorError,
    KVCache,
    RMSNorm,
    RopeSpec,
    Rotary,
    RowGroups,
    SwiGLUMLP,
    UnsupportedDrafterConfigError,
    check_past,
    check_tensor_shape,
    detach_kv,
    head_dim_of,
    masked_attention,
    split_heads,
)
from sglang_tts.drafters.wgrad import Linear

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# Old checkpoint names -> module names (llama_eagle3.py:LlamaForCausalLMEagle3.load_weights).
_EMBED = "embed_tokens.weight"  # owned only when target_hidden_size != hidden_size
LEGACY_NAMES = {
    "midlayer": "layers.0",
    "aux_norm_low": "fc_norm.0",
    "aux_norm_mid": "fc_norm.1",
    "aux_norm_high": "fc_norm.2",
}
# EAGLE-3 training recipe (SafeAILab/EAGLE traineagle3/main.py, SpecForge ploss_decay).
EAGLE3_POSITION_DECAY = 0.8


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    lm_head_from_target: bool  # draft_vocab_size absent: SGLang loads the LM head from the target
    target_hidden_size: int
    num_aux_hidden_states: int
    aux_layer_ids: list[int] | None  # eagle_config.eagle_aux_hidden_state_layer_ids (output-of-layer ids)
    norm_before_fc: bool
    fc_norm: bool
    norm_output: bool
    fc_bias: bool
    o_proj_bias: bool
    rope: RopeSpec

    @property
    def own_embedding(self) -> bool:
        """SGLang keeps the draft's own embedding only when it cannot share the target's."""
        return self.target_hidden_size != self.hidden_size

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> Eagle3Config:
        """Read the fields `llama_eagle3.py` reads; refuse what this copy does not implement."""
        if cfg.get("tie_word_embeddings", False):
            raise UnsupportedDrafterConfigError(
                "EAGLE-3 with tie_word_embeddings=true (LM head = embedding) is not supported"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedDrafterConfigError(f"hidden_act {cfg.get('hidden_act')!r}: only silu is supported")
        if cfg.get("model_type") == "llama4_text":
            raise UnsupportedDrafterConfigError("llama4_text EAGLE-3 drafters are not supported")
        eagle_config = cfg.get("eagle_config") or {}
        if not eagle_config.get("use_aux_hidden_state", True):
            raise UnsupportedDrafterConfigError("eagle_config.use_aux_hidden_state=false is not supported")
        aux_ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
        num_aux = cfg.get("num_aux_hidden_states")
        if num_aux is None:
            num_aux = len(aux_ids) if aux_ids else 3
        hidden = int(cfg["hidden_size"])
        target_hidden = int(cfg.get("target_hidden_size") or hidden)
        if target_hidden * int(num_aux) == hidden:
            # llama_eagle3.py applies fc only when the feature width differs from hidden_size.
            raise UnsupportedDrafterConfigError(
                "num_aux_hidden_states * target_hidden_size == hidden_size: SGLang would skip fc on target features"
            )
        draft_vocab = cfg.get("draft_vocab_size")
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise UnsupportedDrafterConfigError(f"num_attention_heads {heads} not a multiple of kv heads {kv_heads}")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim_of(cfg),
            num_hidden_layers=int(cfg.get("num_hidden_layers", 1)),
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            vocab_size=int(cfg["vocab_size"]),
            draft_vocab_size=int(draft_vocab) if draft_vocab is not None else int(cfg["vocab_size"]),
            lm_head_from_target=draft_vocab is None,
            target_hidden_size=target_hidden,
            num_aux_hidden_states=int(num_aux),
            aux_layer_ids=[int(i) for i in aux_ids] if aux_ids else None,
            norm_before_fc=bool(eagle_config.get("norm_before_fc", cfg.get("norm_before_fc", False))),
            fc_norm=bool(cfg.get("fc_norm") or cfg.get("use_aux_norm", False)),
            norm_output=bool(cfg.get("norm_output", False)),
            fc_bias=bool(cfg.get("bias", False)),
            o_proj_bias=bool(cfg.get("attention_bias", False) or cfg.get("bias", False)),
            rope=RopeSpec.from_config(cfg, default_max_position=8192),
        )


@dataclass
class Eagle3Output:
    hidden: torch.Tensor  # [B, T, H] normed, what the LM head reads
    aux: torch.Tensor  # [B, T, H] the hidden recycled into the next draft step
    kv: KVCache  # this call's K/V per layer, [B, H_kv, T, D] (rotated keys)


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config, in_features: int) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_proj = Linear(in_features, self.num_heads * self.head_dim, bias=False)
        self.k_proj = Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_proj_bias)

    def forward(
        self,
        x: torch.Tensor,
        rope_positions: torch.Tensor,
        rotary: Rotary,
        past: Sequence[tuple[torch.Tensor, torch.Tensor]],
        visible: torch.Tensor,
        first_rows: RowGroups | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """`past`: this layer's earlier K/V as segments in key order ([B, H_kv, L_i, D] each; the first
        one entry per request, [R, H_kv, L_0, D], read through `first_rows` when given), attended
        without joining them; the new rows' keys come last in `visible` [B, T, sum L_i + T]."""
        q = rotary(split_heads(self.q_proj(x), self.num_heads, self.head_dim), rope_positions)
        k = rotary(split_heads(self.k_proj(x), self.num_kv_heads, self.head_dim), rope_positions)
        v = split_heads(self.v_proj(x), self.num_kv_heads, self.head_dim)
        keys, values = [pk for pk, _ in past] + [k], [pv for _, pv in past] + [v]
        out = masked_attention(q, keys, values, visible, self.scale, first_rows if past else None)
        return self.o_proj(out), (k, v)


class Eagle3Layer(nn.Module):
    """llama_eagle3.py:LlamaDecoderLayer; layer 0 is the 2H-wide input layer."""

    def __init__(self, cfg: Eagle3Config, layer_id: int) -> None:
        super().__init__()
        self.is_input_layer = layer_id == 0
        h = cfg.hidden_size
        self.self_attn = Eagle3Attention(cfg, 2 * h if self.is_input_layer else h)
        self.mlp = SwiGLUMLP(h, cfg.intermediate_size)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        # Layers > 0 own an input_layernorm in SGLang too, but never call it: not built here.
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps) if self.is_input_layer else None
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope_positions: torch.Tensor,
        rotary: Rotary,
        past: Sequence[tuple[torch.Tensor, torch.Tensor]],
        visible: torch.Tensor,
        first_rows: RowGroups | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if self.is_input_layer:
            residual = hidden
            x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        else:
            x, residual = self.hidden_norm(hidden, residual)
        attn_out, kv = self.self_attn(x, rope_positions, rotary, past, visible, first_rows)
        x, residual = self.post_attention_layernorm(attn_out, residual)
        return self.mlp(x), residual, kv


class Eagle3Drafter(nn.Module):
    """Trainable EAGLE-3 drafter (DifferentiableDrafter). Module names are the checkpoint's
    `layers.0.*` layout, so `state_dict()` is a loadable EAGLE-3 checkpoint (plus d2t/t2d)."""

    kind = "eagle3"

    def __init__(
        self,
        cfg: Eagle3Config,
        target_embedding: torch.Tensor | None = None,
        target_lm_head: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        feature_width = cfg.target_hidden_size * cfg.num_aux_hidden_states
        self.input_norm = RMSNorm(feature_width, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_aux_hidden_states))
            if cfg.fc_norm
            else None
        )
        self.fc = Linear(feature_width, h, bias=cfg.fc_bias)
        self.layers = nn.ModuleList(Eagle3Layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.rope)
        self.lm_head = None if cfg.lm_head_from_target else Linear(h, cfg.draft_vocab_size, bias=False)
        # d2t: draft id -> target id offset; t2d: which target ids the draft vocabulary covers.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        # Borrowed, frozen tensors: buffers (not parameters) so no optimiser can ever see them,
        # non-persistent so state_dict() stays a drafter checkpoint.
        self.register_buffer("embed_weight", None, persistent=False)
        self.register_buffer("borrowed_lm_head", None, persistent=False)
        self.attach_target(target_embedding, target_lm_head)

    # ------------------------------------------------------------------ set-up

    def attach_target(self, embedding: torch.Tensor | None, lm_head: torch.Tensor | None = None) -> None:
        """Borrow the target's embedding (and LM head when draft_vocab_size is absent)."""
        if embedding is not None:
            if tuple(embedding.shape) != (self.cfg.vocab_size, self.cfg.hidden_size):
                raise ValueError(
                    f"embedding {tuple(embedding.shape)} != (vocab_size, hidden_size) "
                    f"{(self.cfg.vocab_size, self.cfg.hidden_size)}"
                )
            self.embed_weight = embedding.detach()
        if lm_head is not None and self.cfg.lm_head_from_target:
            if tuple(lm_head.shape) != (self.cfg.vocab_size, self.cfg.hidden_size):
                raise ValueError(f"target lm_head {tuple(lm_head.shape)} does not fit the drafter")
            self.borrowed_lm_head = lm_head.detach()

    def checkpoint_plan(
        self, shapes: dict[str, tuple[int, ...]], partial: bool = False
    ) -> tuple[dict[str, str], list[str]]:
        """What `load_checkpoint_weights` makes of tensors of these names and shapes, values unread:
        {stored name: own name} and the ignored names. Raises CheckpointTensorError naming a tensor
        whose shape does not fit, or the tensors the checkpoint lacks (the launch check runs this on
        a meta-device drafter and the files' headers). `partial`: some of a drafter's tensors (a
        weight update, sglang/weight_sync.py): nothing is required.

        Name handling follows llama_eagle3.py:LlamaForCausalLMEagle3.load_weights: `midlayer` ->
        `layers.0`, `aux_norm_{low,mid,high}` -> `fc_norm.{0,1,2}`, optional `model.` prefix.
        `d2t` is required unless the draft vocabulary is the full target vocabulary.
        """
        own = {name: tuple(t.shape) for name, t in self.state_dict().items()}
        if self.cfg.own_embedding:
            own[_EMBED] = (self.cfg.vocab_size, self.cfg.hidden_size)
        plan: dict[str, str] = {}
        ignored: list[str] = []
        for raw_name, shape in shapes.items():
            name = raw_name.removeprefix("model.")
            for old, new in LEGACY_NAMES.items():
                name = name.replace(old, new)
            if name not in own:
                # e.g. unused layers.N.input_layernorm (N > 0), rotary caches, and embed_tokens
                # unless the drafter owns its embedding (SGLang replaces it with the target's)
                ignored.append(raw_name)
                continue
            check_tensor_shape(raw_name, shape, own[name])
            plan[raw_name] = name
        found = set(plan.values())
        if partial:
            return plan, ignored
        if self.cfg.own_embedding and _EMBED not in found and self.embed_weight is None:
            raise CheckpointTensorError(
                "EAGLE-3 checkpoint with target_hidden_size != hidden_size must ship embed_tokens.weight"
            )
        if "d2t" not in found and self.cfg.draft_vocab_size != self.cfg.vocab_size:
            raise CheckpointTensorError("EAGLE-3 checkpoint has a reduced draft vocabulary but no d2t tensor")
        missing = sorted(set(own) - found - {"d2t", "t2d", _EMBED})
        if missing:
            raise CheckpointTensorError(f"EAGLE-3 checkpoint is missing {missing}")
        return plan, ignored

    def load_checkpoint_weights(self, weights: dict[str, torch.Tensor]) -> list[str]:
        """Load an EAGLE-3 checkpoint's tensors (either `midlayer.*` or `layers.N.*` layout; names
        and checks: `checkpoint_plan`, which runs before anything is copied). `t2d` is rebuilt from
        `d2t` when absent. Returns the names that were ignored."""
        plan, ignored = self.checkpoint_plan({raw: tuple(t.shape) for raw, t in weights.items()})
        own = self.state_dict()
        for raw_name, name in plan.items():
            if name == _EMBED:
                self.attach_target(weights[raw_name])
                continue
            with torch.no_grad():
                own[name].copy_(weights[raw_name])
        loaded = set(plan.values())
        if "d2t" in loaded and "t2d" not in loaded:
            t2d = torch.zeros_like(self.t2d)
            t2d[self.draft_to_target_ids()] = True
            self.t2d.copy_(t2d)
        if not bool(self.t2d[self.draft_to_target_ids()].all()):
            raise ValueError("EAGLE-3 checkpoint d2t/t2d disagree: some draft ids map outside t2d")
        return ignored

    # ------------------------------------------------------------------ pieces

    def draft_to_target_ids(self) -> torch.Tensor:
        """[draft_vocab_size] target id of every draft id (SGLang's hot_token_id)."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_weight is None:
            raise RuntimeError("Eagle3Drafter has no embedding: pass the target's (attach_target)")
        return F.embedding(input_ids, self.embed_weight).to(self.fc.weight.dtype)

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target aux features [..., F] -> drafter hidden [..., H] (norm_before_fc, fc_norm, fc)."""
        x = features.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            chunks = x.chunk(self.cfg.num_aux_hidden_states, dim=-1)
            x = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(x)

    def _run_rows(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        rope_positions: torch.Tensor,
        past: list[KVCache],
        past_mask: torch.Tensor | None,
        row_mask: torch.Tensor | None = None,
        first_rows: RowGroups | None = None,
    ) -> Eagle3Output:
        """T rows [B, T, H] through all layers. Rows see the valid past (`past`: caches in key
        order, `past_mask` [B, sum L_i] over all of them; the first cache one entry per request,
        read through `first_rows`, when given) and earlier valid rows (causal in row order) and
        always themselves."""
        b, t, _ = embeds.shape
        device = embeds.device
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=device))
        if row_mask is None:
            row_mask = torch.ones(b, t, dtype=torch.bool, device=device)
        visible = (causal[None] & row_mask[:, None, :]) | torch.eye(t, dtype=torch.bool, device=device)[None]
        if past:
            visible = torch.cat((past_mask[:, None, :].expand(b, t, -1), visible), dim=-1)
        return self._forward_layers(embeds, hidden, rope_positions, past, visible, first_rows)

    def _forward_layers(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        rope_positions: torch.Tensor,
        past: list[KVCache],
        visible: torch.Tensor,
        first_rows: RowGroups | None = None,
    ) -> Eagle3Output:
        """T rows through all layers; `past` holds earlier K/V as caches in key order, never joined
        (an update's context and each unrolled step's own K/V); `visible` [B, T, L_past + T] says
        which past and new keys each row sees (new keys come last)."""
        residual = None
        new_kv: KVCache = []
        for i, layer in enumerate(self.layers):
            layer_past = [cache[i] for cache in past]
            hidden, residual, kv = layer(
                embeds, hidden, residual, rope_positions, self.rotary, layer_past, visible, first_rows
            )
            new_kv.append(kv)
        normed, summed = self.norm(hidden, residual)
        return Eagle3Output(hidden=normed, aux=normed if self.cfg.norm_output else summed, kv=new_kv)

    # ------------------------------------------------------------------ SGLang-shaped entry points

    def extend(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        past_kv: KVCache | None = None,
        past_mask: torch.Tensor | None = None,
        row_mask: torch.Tensor | None = None,
    ) -> Eagle3Output:
        """SGLang's draft extend over L context rows (eagle_worker_v2.py:_draft_extend_for_*).

        Row j consumes the target feature of the token before `input_ids[:, j]` (`features[:, j]`,
        [B, L, F]) and the embedding of `input_ids[:, j]`, at RoPE position `positions[:, j] - 1`;
        rows attend causally to each other and to `past_kv`. `row_mask` [B, L] marks real rows.
        """
        past_mask = check_past(past_kv, past_mask, len(self.layers), input_ids.shape[0])
        return self._run_rows(
            self.embed(input_ids),
            self.project_features(features),
            positions - 1,
            [] if past_kv is None else [past_kv],
            past_mask,
            row_mask,
        )

    @torch.no_grad()
    def kv_for_context(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        past_kv: KVCache | None = None,
        past_mask: torch.Tensor | None = None,
        row_mask: torch.Tensor | None = None,
    ) -> KVCache:
        """Detached K/V of context rows, the `past_kv` a canvas carries (same arguments as `extend`)."""
        return detach_kv(self.extend(input_ids, features, positions, past_kv, past_mask, row_mask).kv)

    def draft_step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        past_kv: KVCache | None = None,
        past_mask: torch.Tensor | None = None,
    ) -> Eagle3Output:
        """One chain draft step for [B] tokens at positions [B].

        `hidden` is [B, F] target features (projected through fc) or [B, H] a recycled draft
        hidden (used as is), the same width test SGLang's LlamaModel.forward makes.
        """
        past_mask = check_past(past_kv, past_mask, len(self.layers), input_ids.shape[0])
        if hidden.shape[-1] == self.fc.in_features:
            hidden = self.project_features(hidden)
        elif hidden.shape[-1] != self.cfg.hidden_size:
            raise ValueError(f"hidden width {hidden.shape[-1]} is neither features nor drafter hidden")
        return self._run_rows(
            self.embed(input_ids[:, None]),
            hidden[:, None].to(self.fc.weight.dtype),
            positions[:, None] - 1,
            [] if past_kv is None else [past_kv],
            past_mask,
        )

    def ttt_hidden(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        row_mask: torch.Tensor | None = None,
        steps: int = 7,
        first_row: int = 0,
        past_kv: KVCache | None = None,
        past_mask: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Training-time-test unroll over whole sequences (EAGLE-3 / SpecForge recipe): normed hidden
        [B, T - first_row, H] of rows first_row.. for each of `steps` draft steps.

        Same conventions as `extend`: row t of step 0 consumes `features[:, t]` (the target feature
        of the token before `input_ids[:, t]`) and the embedding of `input_ids[:, t]`. Step j > 0
        feeds row t the drafter's own recycled hidden from step j - 1 and the embedding of
        `input_ids[:, t + j]` at RoPE position `positions[:, t] + j - 1`, i.e. it is draft step j of
        a chain anchored at row t. Row t of step j attends to the step-0 rows s <= t (causal, valid
        rows only) and to its own rows of steps 1..j -- exactly what `canvas_hidden` computes for
        that chain with the step-0 rows before t as `past_kv`. Ids past the end repeat the last one
        (those rows have no label; callers mask them).

        Steps j > 0 are row-local apart from the step-0 keys, so they run only for rows first_row.. (the
        rows a caller labels): a long prompt before a short answer then costs one causal pass, not `steps`.
        Every row's result is the same as with first_row 0.

        `past_kv` (detached, [B, H_kv, L, D] per layer, valid where `past_mask`): K/V of earlier rows
        that every row of every step also sees (e.g. a prompt's, as SGLang's draft KV cache holds it).
        """
        b, t = input_ids.shape
        if not 0 <= first_row < t:
            raise ValueError(f"first_row {first_row} outside the {t} rows")
        device = input_ids.device
        if row_mask is None:
            row_mask = torch.ones(b, t, dtype=torch.bool, device=device)
        causal = (torch.tril(torch.ones(t, t, dtype=torch.bool, device=device))[None] & row_mask[:, None, :]) | (
            torch.eye(t, dtype=torch.bool, device=device)[None]
        )
        past_mask = check_past(past_kv, past_mask, len(self.layers), b)
        past: list[KVCache] = []
        if past_kv is not None:
            past = [detach_kv(past_kv)]
            causal = torch.cat((past_mask[:, None, :].expand(b, t, -1), causal), dim=-1)
        rows = t - first_row
        eye = torch.eye(rows, dtype=torch.bool, device=device)[None].expand(b, rows, rows)
        out = self._forward_layers(self.embed(input_ids), self.project_features(features), positions - 1, past, causal)
        outputs = [out.hidden[:, first_row:]]
        hidden = out.aux[:, first_row:]
        past = [*past, out.kv]  # each step's K/V is one more segment, never joined to the others
        for j in range(1, steps):
            ids = torch.cat((input_ids[:, j:], input_ids[:, -1:].expand(b, min(j, t))), 1)[:, first_row:]
            visible = torch.cat([causal[:, first_row:]] + [eye] * j, dim=-1)
            out = self._forward_layers(self.embed(ids), hidden, positions[:, first_row:] + j - 1, past, visible)
            outputs.append(out.hidden)
            hidden = out.aux
            past = [*past, out.kv]
        return outputs

    def target_to_draft_ids(self) -> torch.Tensor:
        """[vocab_size] draft id of every target id, -1 where the draft vocabulary lacks it."""
        out = torch.full((self.cfg.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        out[self.draft_to_target_ids()] = torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device)
        return out

    def prompt_terms(self, batch: PromptBatch, depth: int, on_rows: RowsHook | None = None) -> PromptTerms:
        """The training-time-test unroll over prompt windows (core/prompt.py), `depth` draft steps.

        Row t consumes the feature of window token t and embeds token t + 1 (SGLang's draft extend);
        step j of row t is draft step j of the chain anchored there and predicts token t + j + 2,
        weight 0.8 ** j. Rows whose label is past the window, padding, or outside the draft
        vocabulary are dropped."""
        b, t1 = batch.token_ids.shape
        t = t1 - 1
        if on_rows is not None:
            on_rows(torch.arange(b, device=batch.token_ids.device))
        hidden = self.ttt_hidden(
            batch.token_ids[:, 1:], batch.features, batch.positions[:, 1:], batch.feature_mask, steps=depth
        )
        to_draft = self.target_to_draft_ids()
        rows = torch.arange(t, device=batch.token_ids.device)
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for j, h in enumerate(hidden):
            label_at = rows + j + 2  # window index of the token row t predicts at step j
            inside = label_at <= t
            labels = to_draft[batch.token_ids[:, label_at.clamp(max=t)]]  # [B, T]
            keep = inside[None] & batch.real[:, label_at.clamp(max=t)] & (labels >= 0)
            r_idx, t_idx = keep.nonzero(as_tuple=True)
            weight = torch.full((r_idx.numel(),), EAGLE3_POSITION_DECAY**j, device=h.device)
            parts.append((h[r_idx, t_idx], labels[r_idx, t_idx], weight, r_idx))
        return PromptTerms(*(torch.cat(x) for x in zip(*parts)))

    # ------------------------------------------------------------------ DifferentiableDrafter

    def canvas_hidden(self, canvas: Canvas) -> torch.Tensor:
        """Normed hidden [B, C, H] of the chain unroll over the canvas (module docstring).

        Gradients flow through the whole unroll: the recycled hidden and the canvas positions'
        own K/V keep their graph (as in EAGLE-3's training-time test); `past_kv` is detached.

        Positions after a row's last valid one are not computed (zeros there): they enter no loss and
        feed no earlier position, and a stride's stacked rounds are mostly such padding (a chain of 3
        verifies 4 positions, about 2 of them valid one at a time on the testbed). Step k runs only the
        rows with a valid position at k or later (`_rows_by_need`); every computed position is what the
        full unroll gives. Not trimmed: rows with per-request adapter slots (their hooks read one slot
        per canvas row). A context of one entry per request (`canvas.context_rows`, stack_rounds at
        several requests) is read by each request's rows together (`RowGroups`), never gathered per row.
        """
        b, c = canvas.input_ids.shape
        if canvas.features.shape != (b, self.fc.in_features):
            expected = f"[B, {self.fc.in_features}]"
            raise ValueError(f"EAGLE-3 canvas.features must be {expected}, got {tuple(canvas.features.shape)}")
        cache_mask = check_past(canvas.past_kv, canvas.past_mask, len(self.layers), b)
        # The context K/V and each step's own K/V stay separate segments: the context (thousands of
        # rows per canvas row) is read by every step, never copied, and gets no K/V gradient.
        context: list[KVCache] = [] if canvas.past_kv is None else [detach_kv(canvas.past_kv)]
        entries = canvas.context_entries()  # the context entry each row reads (None: one shared, or none)
        input_ids, positions, features = canvas.input_ids, canvas.positions, canvas.features
        order, alive = self._rows_by_need(canvas)
        if order is not None:
            index = torch.tensor(order, dtype=torch.long).to(input_ids.device, non_blocking=True)
            input_ids, positions, features = (t.index_select(0, index) for t in (input_ids, positions, features))
            cache_mask = None if cache_mask is None else cache_mask.index_select(0, index)
            entries = None if entries is None else [entries[i] for i in order]
        embeds = self.embed(input_ids)
        rope_positions = positions - 1
        hidden = self.project_features(features)[:, None]
        own: list[KVCache] = []  # each step's K/V, rows in step order (alive rows come first)
        outputs = []
        groups: RowGroups | None = None
        for k in range(c):
            n = alive[k]
            if n == 0:
                break
            if n < hidden.shape[0]:
                hidden = hidden[:n]
                own = [[(key[:n], value[:n]) for key, value in kv] for kv in own]
                cache_mask = None if cache_mask is None else cache_mask[:n]
            if entries is not None and (groups is None or n != sum(groups.sizes)):
                groups = RowGroups.of(entries[:n], embeds.device)
            step = self._run_rows(
                embeds[:n, k : k + 1], hidden, rope_positions[:n, k : k + 1], [*context, *own], cache_mask, None, groups
            )
            outputs.append(F.pad(step.hidden, (0, 0, 0, 0, 0, b - n)) if n < b else step.hidden)
            hidden = step.aux
            own.append(step.kv)
            mine = torch.ones(n, 1, dtype=torch.bool, device=embeds.device)
            cache_mask = mine if cache_mask is None else torch.cat((cache_mask, mine), dim=1)
        out = torch.cat(outputs, dim=1)
        if out.shape[1] < c:
            out = F.pad(out, (0, 0, 0, c - out.shape[1]))
        if order is not None:
            back = [0] * b
            for at, row in enumerate(order):
                back[row] = at
            out = out.index_select(0, torch.tensor(back, dtype=torch.long).to(out.device, non_blocking=True))
        return out

    def _rows_by_need(self, canvas: Canvas) -> tuple[list[int] | None, list[int]]:
        """Rows sorted by how many canvas positions they need (their last valid position + 1), most
        first, and how many rows step k runs: (order, host ints, or None when nothing is trimmed; [C]
        counts). One host read of B counts, on the update's thread (the loss reads its mask there too)."""
        b, c = canvas.input_ids.shape
        if canvas.slots is not None or b == 1:
            return None, [b] * c
        valid = canvas.valid.to(canvas.input_ids.device)
        need = (valid * torch.arange(1, c + 1, device=valid.device)).amax(dim=1).tolist()  # [B]
        alive = [sum(n > k for n in need) for k in range(c)]
        if alive[-1] == b:
            return None, alive
        return sorted(range(b), key=lambda row: -need[row]), alive

    def lm_head_weight(self) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head.weight
        if self.borrowed_lm_head is None:
            raise RuntimeError("this EAGLE-3 drafter uses the target's LM head: pass it (attach_target)")
        return self.borrowed_lm_head.to(self.fc.weight.dtype)

    def canvas_logits(self, canvas: Canvas) -> torch.Tensor:
        """Logits [B, C, draft_vocab_size]; draft id i means target id `draft_to_target_ids()[i]`."""
        return self.canvas_hidden(canvas) @ self.lm_head_weight().T

    def teacher_vocab(self, device: torch.device | str) -> TeacherVocab | None:
        """The draft vocabulary as target ids, for capture to keep only those logits (core/canvas.py);
        None when it is the whole target vocabulary (nothing to reduce). Made once, on `device`."""
        if self.cfg.draft_vocab_size == self.cfg.vocab_size:
            return None
        with torch.inference_mode(False):
            vocab = TeacherVocab(ids=self.draft_to_target_ids().to(device), covered=self.t2d.to(device))
        self._issued_teacher_ids = vocab.ids  # teacher_probs knows these without comparing (a device sync)
        return vocab

    def teacher_probs(self, canvas: Canvas) -> tuple[torch.Tensor, torch.Tensor]:
        """Target distribution restricted to the draft vocabulary and renormalised, [B, C, V_draft],
        and the mask t2d[argmax target] (EAGLE-3 traineagle3/cnets.py: positions whose target top-1
        lies outside the draft vocabulary are dropped). softmax over the gathered logits equals
        the full softmax gathered and renormalised. A canvas captured at `teacher_vocab()` holds
        the gathered logits already, with those positions out of `valid`: its mask is all True."""
        from sglang_tts.kernels import gather_draft_probs  # fused Triton gather on CUDA, PyTorch elsewhere

        logits = canvas.target_logits
        batch, length, vocab = logits.shape
        if canvas.teacher_ids is None:
            if vocab != self.cfg.vocab_size:
                raise ValueError(f"target_logits vocab {vocab} != drafter target vocab {self.cfg.vocab_size}")
            d2t, t2d = self.d2t, self.t2d
        else:
            self._check_captured_vocab(canvas.teacher_ids)
            d2t, t2d = torch.zeros(vocab, dtype=torch.long, device=logits.device), None  # at the draft ids: identity
        probs, mask = gather_draft_probs(logits.reshape(batch * length, vocab), d2t, t2d)
        return probs.reshape(batch, length, -1), mask.reshape(batch, length)

    def _check_captured_vocab(self, ids: torch.Tensor) -> None:
        """A canvas's teacher_ids must be this drafter's draft vocabulary: the ids `teacher_vocab()` issued
        (known without a comparison, which would sync the device), or equal to them."""
        if ids is getattr(self, "_issued_teacher_ids", None):
            return
        own = self.draft_to_target_ids().to(ids.device)
        if ids.shape != own.shape or not torch.equal(ids, own):
            raise ValueError("the canvas was captured at another vocabulary than this drafter's (teacher_ids)")

    def default_position_weights(self, length: int) -> torch.Tensor:
        """w_k = 0.8 ** (k - 1), k = 1..length (EAGLE-3 ploss_weight)."""
        return EAGLE3_POSITION_DECAY ** torch.arange(length, dtype=torch.float32)

    def trainable_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]
