"""Building blocks shared by the differentiable EAGLE-3 and DFlash drafters.

Everything here reproduces the math of SGLang 0.5.23's inference layers in plain, differentiable
PyTorch (no fused kernels, no KV pool), so a trained copy can be published into SGLang's draft
runner weight for weight:

- `RMSNorm` matches `sglang/srt/layers/layernorm.py:RMSNorm.forward_native`, including the fused
  residual add (`norm(x, residual)` returns `(norm(x + residual), x + residual)`).
- `Rotary` matches `sglang/srt/layers/rotary_embedding/factory.py:get_rope` for the rope types
  "default", "linear" and "llama3" (`base.py:RotaryEmbedding`, `base.py:LinearScalingRotaryEmbedding`,
  `rope_variant.py:Llama3RotaryEmbedding`), neox (split halves) or GPT-J (interleaved) style,
  with an optional partial rotary dimension.
- `SwiGLUMLP` matches `LlamaMLP` / `DFlashMLP` (`SiluAndMul` over `[gate; up]`).
- `masked_attention` is what RadixAttention computes for one request: softmax(q k^T * scale) v with
  grouped-query heads (query head h reads KV head h // (H_q / H_kv)).

K/V caches handed between calls are lists with one `(k, v)` per drafter layer, each
`[B, H_kv, L, head_dim]`, keys already rotary-embedded (what SGLang stores in its KV pool).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sglang_tts.drafters.wgrad import Linear

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class UnsupportedDrafterConfigError(ValueError):
    """The checkpoint asks for a feature this differentiable copy does not implement."""


class IncompatibleDrafterError(ValueError):
    """The drafter checkpoint cannot run against the given target (or is not a known drafter)."""


class CheckpointTensorError(ValueError):
    """A checkpoint tensor is missing or does not fit the drafter; `tensor` names the stored tensor
    at fault (None when tensors are missing: they are named in the message)."""

    def __init__(self, message: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


def check_tensor_shape(raw_name: str, stored: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(stored) != tuple(expected):
        raise CheckpointTensorError(
            f"{raw_name}: checkpoint shape {tuple(stored)} != model {tuple(expected)}", raw_name
        )


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of an HF config dict (VLM configs nest it under text_config)."""
    nested = cfg.get("text_config")
    return nested if isinstance(nested, dict) else cfg


def head_dim_of(cfg: dict[str, Any]) -> int:
    """`head_dim` if the config sets it, else hidden_size // num_attention_heads (as SGLang)."""
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        return int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    return int(head_dim)


# ----------------------------------------------------------------------------- normalisation


class RMSNorm(nn.Module):
    """RMSNorm with SGLang's fused residual add (layernorm.py:RMSNorm.forward_native).

    `norm(x)` returns the normed x; `norm(x, residual)` first forms s = x + residual and returns
    `(norm(s), s)`, which is how SGLang's decoder layers carry the residual stream.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = float(eps)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        summed = x + residual
        return self._norm(summed), summed


# ----------------------------------------------------------------------------- rotary embedding


@dataclass(frozen=True)
class RopeSpec:
    """What `sglang/srt/layers/rotary_embedding/factory.py:get_rope` needs, read from a config."""

    head_dim: int
    rotary_dim: int
    theta: float
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    neox_style: bool = True

    @classmethod
    def from_config(cls, cfg: dict[str, Any], *, default_max_position: int) -> RopeSpec:
        """Parse `rope_parameters` (transformers v5) or `rope_theta` + `rope_scaling` (v4).

        Mirrors `models/llama.py:LlamaDecoderLayer.__init__` / `utils/hf_transformers/common.py:
        get_rope_config`: with `rope_parameters` present, theta comes from it and the whole dict is
        the scaling spec; a top-level `original_max_position_embeddings` overrides the one in the
        scaling dict (llama.py); `max_position_embeddings` is the llama3 fallback for it.
        """
        params = cfg.get("rope_parameters")
        if params is not None:
            theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
            scaling = dict(params)
        else:
            theta = float(cfg.get("rope_theta", 10000.0))
            scaling = dict(cfg["rope_scaling"]) if cfg.get("rope_scaling") else None
        head_dim = head_dim_of(cfg)
        rotary_dim = int(float(cfg.get("partial_rotary_factor", 1.0)) * head_dim)
        neox = bool(cfg.get("rope_is_neox_style", cfg.get("is_neox_style", True)))
        max_position = int(cfg.get("max_position_embeddings", default_max_position))
        if scaling is None:
            return cls(head_dim, rotary_dim, theta, neox_style=neox, original_max_position=max_position)
        if cfg.get("original_max_position_embeddings"):
            scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type is None:
            raise UnsupportedDrafterConfigError(f"unknown RoPE scaling spec {scaling}")
        for key in ("mrope_section", "rope_dim", "use_fope"):
            if scaling.get(key):
                raise UnsupportedDrafterConfigError(f"RoPE option {key!r} is not supported by the TTS drafters")
        if rope_type not in ("default", "linear", "llama3"):
            raise UnsupportedDrafterConfigError(
                f"RoPE type {rope_type!r} is not supported by the TTS drafters (default, linear, llama3 are)"
            )
        return cls(
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            theta=theta,
            rope_type=rope_type,
            factor=float(scaling.get("factor", 1.0)),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position=int(scaling.get("original_max_position_embeddings", max_position)),
            neox_style=neox,
        )

    def inv_freq(self) -> torch.Tensor:
        """Inverse frequencies [rotary_dim / 2], fp32 (base.py:_compute_inv_freq, llama3 variant)."""
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))
        if self.rope_type != "llama3":
            return inv_freq
        # rope_variant.py:Llama3RotaryEmbedding._compute_inv_freq: long wavelengths are divided by
        # `factor`, short ones kept, and the band between is blended linearly.
        low_freq_wavelen = self.original_max_position / self.low_freq_factor
        high_freq_wavelen = self.original_max_position / self.high_freq_factor
        wave_len = 2 * math.pi / inv_freq
        if self.low_freq_factor != self.high_freq_factor:
            smooth = (self.original_max_position / wave_len - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
        else:
            smooth = torch.zeros_like(inv_freq)
        blended = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        return torch.where(
            wave_len < high_freq_wavelen,
            inv_freq,
            torch.where(wave_len > low_freq_wavelen, inv_freq / self.factor, blended),
        )


class Rotary(nn.Module):
    """Applies RoPE to [B, heads, T, head_dim] at integer positions [B, T]."""

    def __init__(self, spec: RopeSpec) -> None:
        super().__init__()
        self.spec = spec
        self.register_buffer("inv_freq", spec.inv_freq(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        pos = positions.to(torch.float32)
        if self.spec.rope_type == "linear":
            pos = pos / self.spec.factor  # base.py:LinearScalingRotaryEmbedding: t = t / scaling_factor
        angles = pos[..., None] * self.inv_freq.float()  # [B, T, rotary_dim / 2]
        cos = angles.cos()[:, None].to(x.dtype)  # [B, 1, T, rotary_dim / 2]
        sin = angles.sin()[:, None].to(x.dtype)
        rot, passthrough = x[..., : self.spec.rotary_dim], x[..., self.spec.rotary_dim :]
        if self.spec.neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., ::2], rot[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        if self.spec.neox_style:
            rot = torch.cat((o1, o2), dim=-1)
        else:
            rot = torch.stack((o1, o2), dim=-1).flatten(-2)
        return torch.cat((rot, passthrough), dim=-1)


# ----------------------------------------------------------------------------- MLP and attention


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases (models/llama.py:LlamaMLP, models/dflash.py:DFlashMLP)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass(frozen=True)
class RowGroups:
    """Which query rows read which entry of a segment that holds one entry per request
    ([R, H_kv, L, D]: the context K/V of an update window's rows at several requests,
    core/canvas.py stack_rounds), so that each entry is read once by its rows together instead of
    being copied to every row. Built on the host from host ints (`of`); no device read."""

    entries: tuple[int, ...]  # the entries read, ascending
    sizes: tuple[int, ...]  # how many rows read each of them
    order: torch.Tensor | None  # [B] int64: the rows, grouped by entry (None: already grouped)
    inverse: torch.Tensor | None  # [B] int64: where each row lies in `order` (None with `order`)

    @classmethod
    def of(cls, entry_of_row: Sequence[int], device: torch.device | str) -> RowGroups:
        """`entry_of_row[i]`: the entry row i reads."""
        by_entry: dict[int, list[int]] = {}
        for row, entry in enumerate(entry_of_row):
            by_entry.setdefault(int(entry), []).append(row)
        entries = tuple(sorted(by_entry))
        order = [row for entry in entries for row in by_entry[entry]]
        if order == list(range(len(order))):
            return cls(entries, tuple(len(by_entry[e]) for e in entries), None, None)
        inverse = [0] * len(order)
        for at, row in enumerate(order):
            inverse[row] = at
        order_t, inverse_t = (torch.tensor(x, dtype=torch.long).to(device, non_blocking=True) for x in (order, inverse))
        return cls(entries, tuple(len(by_entry[e]) for e in entries), order_t, inverse_t)

    def matmul(self, x: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
        """x [B, H, M, N] @ segment[entry of each row] ([R, H, N, P]) -> [B, H, M, P]: each entry
        multiplied once with its rows folded together (`_rows_matmul` of a batch-1 segment)."""
        if self.order is None and len(self.entries) == x.shape[0] and self.entries[-1] == x.shape[0] - 1:
            return torch.matmul(x, segment[: x.shape[0]])  # row i reads entry i: one batched product
        grouped = x if self.order is None else x.index_select(0, self.order)
        parts = [
            _rows_matmul(rows, segment[entry : entry + 1])
            for entry, rows in zip(self.entries, grouped.split(list(self.sizes)))
        ]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out if self.inverse is None else out.index_select(0, self.inverse)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor | Sequence[torch.Tensor],
    v: torch.Tensor | Sequence[torch.Tensor],
    visible: torch.Tensor,
    scale: float,
    first_rows: RowGroups | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v over the visible keys, with grouped-query KV heads.

    q: [B, H_q, T, D]; k, v: [B, H_kv, S, D], or segments [B, H_kv, S_i, D] that are the keys in
    that order (sum S_i = S); a segment of batch 1 is every row's (one request's context read by
    the rows of several of its rounds: core/canvas.py stack_rounds); with `first_rows`, the first
    segment holds one entry per request ([R, H_kv, S_0, D], the context of rounds of several
    requests) and row i reads the entry `first_rows` gives it; visible: [B, T, S] bool.
    Returns [B, T, H_q * D]. Every query row must see at least one key (callers always let a row
    see itself).

    Grouped-query heads share their KV head by folding the group into the query rows (query head
    h reads KV head h // G, as repeat_interleave would pair them) instead of repeating K and V
    G times. Segments are scored one by one and only the [.., T, S] scores are joined for the
    softmax: an update's past K/V (the whole context, thousands of rows) is read, never copied,
    and a detached segment gets no K/V gradient. A shared segment (batch 1) is multiplied once
    with every row's queries folded together (`_rows_matmul`), never broadcast to B copies, and a
    segment of one entry per request once per entry with its rows' queries (`RowGroups.matmul`).
    Segments may differ in dtype (a past read from a pool kept in another dtype): each segment's
    probabilities are cast to its values' dtype, never the values, and the output has the last
    segment's dtype (the new rows').
    """
    ks = [k] if isinstance(k, torch.Tensor) else list(k)
    vs = [v] if isinstance(v, torch.Tensor) else list(v)
    b, h_q, t, d = q.shape
    h_kv = ks[0].shape[1]
    groups = h_q // h_kv
    qf = q.reshape(b, h_kv, groups * t, d).float()  # [B, H_kv, G*T, D]
    mm = [_rows_matmul] * len(ks)
    if first_rows is not None:
        mm[0] = first_rows.matmul
    parts = [f(qf, key.float().transpose(-1, -2)) for f, key in zip(mm, ks)]  # [B, H_kv, G*T, S_i]
    scores = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)) * scale  # [B, H_kv, G*T, S]
    scores = scores.view(b, h_kv, groups, t, -1).masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(b, h_kv, groups * t, -1)
    out_dtype = vs[-1].dtype
    out = None
    for f, p, value in zip(mm, probs.split([value.shape[2] for value in vs], dim=-1), vs):
        part = f(p.to(value.dtype), value).to(out_dtype)  # [B, H_kv, G*T, D]
        out = part if out is None else out + part
    return out.view(b, h_q, t, d).transpose(1, 2).flatten(2)


def _rows_matmul(x: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """x [B, H, M, N] @ segment [B or 1, H, N, P] -> [B, H, M, P]. A segment of batch 1 is
    multiplied once with the B rows folded into M (one [H, B*M, N] x [H, N, P] product), where
    matmul's broadcast would copy it B times."""
    b, h, m, n = x.shape
    if segment.shape[0] == b:
        return torch.matmul(x, segment)
    folded = x.transpose(0, 1).reshape(1, h, b * m, n)
    return torch.matmul(folded, segment).view(h, b, m, -1).transpose(0, 1).contiguous()


def split_heads(x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """[B, T, num_heads * head_dim] -> [B, num_heads, T, head_dim]."""
    b, t, _ = x.shape
    return x.view(b, t, num_heads, head_dim).transpose(1, 2)


def check_past(
    past_kv: KVCache | None, past_mask: torch.Tensor | None, num_layers: int, batch: int
) -> torch.Tensor | None:
    """Validate a past K/V cache and return its [B, L] mask (all True when none was given)."""
    if past_kv is None:
        return None
    if len(past_kv) != num_layers:
        raise ValueError(f"past_kv has {len(past_kv)} layers, the drafter has {num_layers}")
    length = past_kv[0][0].shape[2]
    if past_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=past_kv[0][0].device)
    if past_mask.shape != (batch, length):
        raise ValueError(f"past_mask {tuple(past_mask.shape)} does not match past_kv length {(batch, length)}")
    return past_mask.bool()


def append_kv(cache: KVCache | None, new: KVCache) -> KVCache:
    """Concatenate per-layer K/V along the sequence axis (cache first)."""
    if cache is None:
        return list(new)
    return [(torch.cat((pk, nk), dim=2), torch.cat((pv, nv), dim=2)) for (pk, pv), (nk, nv) in zip(cache, new)]


def detach_kv(cache: KVCache) -> KVCache:
    return [(k.detach(), v.detach()) for k, v in cache]
