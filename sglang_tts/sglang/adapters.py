"""Per-request adapters inside SGLang's draft model (`--tts-scope request`).

SGLang's draft model stays untouched: forward hooks on its linear layers add each token's request
adapter delta (`ServingBank.delta`), and a pre-hook on each decoder layer reads the ForwardBatch it
is called with to say which request every token belongs to. Fused layers (qkv_proj = [q | k | v], gate_up_proj =
[gate | up]) get the delta of each adapted part added to its slice of the output.

Token -> request: SGLang lays a forward's tokens out request by request, either with per-request
lengths (`extend_seq_lens`, prefill / draft-extend) or a fixed number per request (draft steps:
top-k rows; verify and DFlash blocks: draft tokens). A table indexed by `req_pool_idx` gives each
request's bank row (0: no adapter), so the gathers only read tensors SGLang already holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from sglang_tts.core.adapters import LM_HEAD, AdaptedDrafter, ServingBank, SlotTable
from sglang_tts.core.publish import STACKED_PARAMS, WeightPublisher
from sglang_tts.sglang.failures import FailureLog

logger = logging.getLogger(__name__)


def _find_module(model: nn.Module, name: str) -> nn.Module | None:
    for candidate in (name, f"model.{name}"):
        try:
            return model.get_submodule(candidate)
        except AttributeError:
            continue
    return None


def _serving_segments(draft_model: nn.Module, adapted: AdaptedDrafter) -> dict[str, list[tuple[str, int, int]]]:
    """SGLang module name -> [(adapted layer name, output offset, width)]; raises if a layer has no home."""
    layers = {layer.name: layer for layer in adapted.bank.layers}
    fused_of = {part: fused for fused, parts in STACKED_PARAMS.items() for part in parts}
    segments: dict[str, list[tuple[str, int, int]]] = {}
    for name, layer in layers.items():
        if name == LM_HEAD:  # SGLang reads the head's weight in its LogitsProcessor: see _LogitsDelta
            continue
        parent, _, leaf = name.rpartition(".")
        if _find_module(draft_model, name) is not None:
            segments.setdefault(name, []).append((name, 0, layer.out_features))
            continue
        fused = fused_of.get(leaf)
        fused_name = f"{parent}.{fused}" if parent else str(fused)
        if fused is None or _find_module(draft_model, fused_name) is None:
            raise RuntimeError(f"per-request adapters: SGLang's draft model has no layer for {name}")
        offset = 0
        for part in STACKED_PARAMS[fused]:
            part_name = f"{parent}.{part}" if parent else part
            width = adapted.base.get_submodule(part_name).out_features
            if part_name == name:
                segments.setdefault(fused_name, []).append((name, offset, width))
            offset += width
    return segments


def _pool_index(req) -> int | None:
    """The request's row in SGLang's req_to_token pool (0.5.23 keeps it in `req.kv`)."""
    kv = getattr(req, "kv", None)
    index = getattr(kv, "req_pool_idx", None) if kv is not None else getattr(req, "req_pool_idx", None)
    return int(index) if index is not None else None


def _decoder_layer_of(module_name: str) -> str | None:
    """'layers.0.self_attn.qkv_proj' -> 'layers.0' (the decoder layer that owns a projection); None
    for a projection outside the decoder layers (EAGLE-3's `fc`), which the model body's pre-hook maps.
    A pre-hook on such a module itself would see no ForwardBatch and clear the mapping."""
    parts = module_name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        return ".".join(parts[: i + 2])
    return None


class TokenRows:
    """Which bank row (0: no adapter) each token of a draft-model forward uses.

    `row_of_pool[req_pool_idx]` is allocated once, for every row of SGLang's req_to_token pool (its
    size is asked at first use: SGLang creates the pool after the workers), and only written in place
    after that, so a captured CUDA graph keeps reading the same storage. Per
    forward, `rows_for` reads no device value on the host: token counts come from the ForwardBatch's
    host-side fields, and repeat_interleave gets its output size, so it needs no sync either."""

    def __init__(self, pool_size: Callable[[], int], device) -> None:
        self._pool_size = pool_size
        self._device = device
        self._table: torch.Tensor | None = None

    @property
    def row_of_pool(self) -> torch.Tensor:  # [pool_size] int64
        if self._table is None:
            self._table = torch.zeros(int(self._pool_size()), dtype=torch.int64, device=self._device)
        return self._table

    def set_batch(self, pool_indices: list[int], rows: list[int]) -> None:
        """pool_indices[i] -> rows[i] for this batch's requests; every other request: row 0."""
        size = self.row_of_pool.shape[0]
        if pool_indices and max(pool_indices) >= size:
            raise IndexError(f"req_pool_idx {max(pool_indices)} outside SGLang's pool of {size}")
        self.row_of_pool.zero_()
        if pool_indices:
            index = torch.tensor(pool_indices, dtype=torch.int64).to(self.row_of_pool.device, non_blocking=True)
            value = torch.tensor(rows, dtype=torch.int64).to(self.row_of_pool.device, non_blocking=True)
            self.row_of_pool.index_copy_(0, index, value)

    def rows_for(self, forward_batch, num_tokens: int) -> torch.Tensor | None:
        """[num_tokens] bank rows of a forward laid out request by request: per-request lengths
        (`extend_seq_lens`: prefill, draft-extend) or a fixed number per request (draft steps,
        verify, DFlash blocks); None when the layout is not one of these (the base drafter)."""
        req_rows = self.row_of_pool[forward_batch.req_pool_indices.long()]  # [bs]
        bs = req_rows.shape[0]
        if bs == 0:
            return None
        lens = getattr(forward_batch, "extend_seq_lens", None)  # [bs] on the device
        if forward_batch.forward_mode.is_extend() and lens is not None:
            total = _extend_total(forward_batch, lens)
            if total == num_tokens:
                return torch.repeat_interleave(req_rows, lens.long(), output_size=num_tokens)
        if num_tokens % bs:
            return None
        return req_rows.repeat_interleave(num_tokens // bs)


def _extend_total(forward_batch, lens: torch.Tensor) -> int | None:
    """Tokens of an extend forward, from the ForwardBatch's host-side fields; on CPU (no device to
    wait for) from the lengths themselves when SGLang filled neither."""
    lens_cpu = getattr(forward_batch, "extend_seq_lens_cpu", None)
    if lens_cpu is not None:
        return int(sum(lens_cpu))
    total = getattr(forward_batch, "extend_num_tokens", None)
    if total is not None:
        return int(total)
    return int(lens.sum()) if lens.device.type == "cpu" else None


class ServingAdapters:
    """The published adapters and the hooks that apply them in SGLang's draft model."""

    def __init__(self, draft_model: nn.Module, adapted: AdaptedDrafter, device, pool_size: Callable[[], int]) -> None:
        dtype = next(draft_model.parameters()).dtype
        self.bank = ServingBank(adapted.bank, device=device, dtype=dtype)
        trained = dict(adapted.trainable_named_parameters())
        self.publisher = WeightPublisher.from_name_map(self.bank.destinations(adapted.bank), trained)
        # bank row per req_pool_idx (0: no adapter), one entry per row of SGLang's req_to_token pool
        self.token_map = TokenRows(pool_size, device)
        self._token_rows: torch.Tensor | None = None
        self._active = False
        self._warned = False
        self._logged = False
        # A hook that fails maps no token for the rest of that forward (the base drafter drafts);
        # the runtime replaces this log with its own, which counts failures per request.
        self.failures = FailureLog()
        # CUDA graphs are captured before any request holds a slot: there the hooks must always
        # run (a zero row is a zero delta) so the captured graph contains them. CPU skips idle work.
        self._always = torch.device(device).type == "cuda"
        self.handles = []
        segments = _serving_segments(draft_model, adapted)
        # SGLang's model runner calls the model's forward() directly (no module hooks there), but the
        # decoder layers are called as modules, with the ForwardBatch: map tokens to requests there.
        # `model` (the body, called as a module by the CausalLM's forward) maps them before `fc`.
        owners = {_decoder_layer_of(name) for name in segments}
        if isinstance(getattr(draft_model, "model", None), nn.Module):
            owners.add("model")
        elif None in owners:
            raise RuntimeError("per-request adapters: SGLang's draft model has no body to map tokens before `fc`")
        owners.discard(None)
        for owner_name in sorted(owners):
            owner = draft_model.model if owner_name == "model" else _find_module(draft_model, owner_name)
            self.handles.append(owner.register_forward_pre_hook(self._before_layer, with_kwargs=True))
        for module_name, parts in segments.items():
            module = _find_module(draft_model, module_name)
            self.handles.append(module.register_forward_hook(self._delta_hook(parts)))
        if LM_HEAD in self.bank.index:
            processor = getattr(draft_model, "logits_processor", None)
            if processor is None:
                raise RuntimeError("per-request adapters: SGLang's draft model has no LogitsProcessor for lm_head")
            self.handles.append(_LogitsDelta(self, processor))

    # --- per batch (scheduler thread) ---------------------------------------------------------------

    def set_batch(self, reqs, slots: SlotTable) -> None:
        """Bank rows of this batch's requests (call before its draft model forwards)."""
        pairs = [(_pool_index(r), slots.slot_of.get(r.rid, -1) + 1) for r in reqs]
        pool = [p for p, _ in pairs if p is not None]
        rows = [row for p, row in pairs if p is not None]
        self.token_map.set_batch(pool, rows)
        self._active = any(row > 0 for row in rows)
        if self._active and not self._logged:
            logger.info("sglang-tts: per-request adapters applied in SGLang's draft model (first use)")
            self._logged = True

    # --- hooks ---------------------------------------------------------------------------------------

    def _before_layer(self, module, args, kwargs):
        self._token_rows = None
        with self.failures.absorb("adapter_hook"):
            self._map_tokens(args, kwargs)
        return None

    def _map_tokens(self, args, kwargs) -> None:
        if not (self._active or self._always):
            return None
        values = [*args, *kwargs.values()]
        forward_batch = next((v for v in values if hasattr(v, "forward_mode")), None)
        first = next((v for v in values if isinstance(v, torch.Tensor)), None)  # positions [N]
        if forward_batch is None or first is None:
            return
        num_tokens, bs = int(first.shape[0]), int(forward_batch.req_pool_indices.shape[0])
        self._token_rows = self.token_map.rows_for(forward_batch, num_tokens)
        if self._token_rows is None and bs > 0 and not self._warned:  # base drafter: slower, never failed
            logger.warning("sglang-tts: %d draft tokens do not map onto %d requests; no adapters", num_tokens, bs)
            self._warned = True

    def _delta_hook(self, parts: list[tuple[str, int, int]]):
        def add_delta(inputs, output):
            rows = self._token_rows
            if rows is None:
                return None
            out, rest = (output[0], output[1:]) if isinstance(output, tuple) else (output, None)
            x = inputs[0]
            if x.shape[0] != rows.shape[0]:
                return None  # a forward we did not map (e.g. a warmup with another layout): base drafter
            out = out.clone()
            for name, offset, width in parts:
                out[:, offset : offset + width] += self.bank.delta(name, x, rows).to(out.dtype)
            return (out, *rest) if rest is not None else out

        def hook(module, inputs, output):
            failed, new_output = True, None
            with self.failures.absorb("adapter_hook"):
                new_output = add_delta(inputs, output)
                failed = False
            if failed:
                self._token_rows = None  # the rest of this forward drafts with the base drafter
            return new_output

        return hook


class _LogitsDelta:
    """The LM head's per-request delta in SGLang's draft logits.

    SGLang's LogitsProcessor computes logits from the LM head's weight (`_compute_lm_head`), after
    choosing which token rows get logits (`_get_pruned_states`: all rows when drafting, selected
    or last rows in an extend); neither is a module call. Both methods are wrapped on this one
    instance: the pruning is replayed on a column of the tokens' bank rows, so every logits row
    knows its request, and the delta is added to the logits. `remove()` restores the methods."""

    def __init__(self, owner: ServingAdapters, processor: nn.Module) -> None:
        self.processor = processor
        self.rows: torch.Tensor | None = None
        prune, compute = processor._get_pruned_states, processor._compute_lm_head

        def get_pruned_states(hidden_states, hidden_states_before_norm, aux_hidden_states, logits_metadata):
            out = prune(hidden_states, hidden_states_before_norm, aux_hidden_states, logits_metadata)
            token_rows, self.rows = owner._token_rows, None
            if token_rows is not None and token_rows.shape[0] == hidden_states.shape[0]:
                with owner.failures.absorb("adapter_hook"):
                    column = token_rows.to(torch.float32)[:, None]  # small integers: exact in fp32
                    self.rows = prune(column, None, None, logits_metadata)[0][:, 0].long()
            return out

        def compute_lm_head(hidden_states, lm_head, embedding_bias=None, *, out=None):
            logits = compute(hidden_states, lm_head, embedding_bias, out=out)
            rows, self.rows = self.rows, None
            if rows is None or rows.shape[0] != hidden_states.shape[0]:
                return logits  # rows we could not map: the base LM head
            with owner.failures.absorb("adapter_hook"):
                return logits + owner.bank.delta(LM_HEAD, hidden_states, rows).to(logits.dtype)
            return logits  # the delta failed: the base LM head

        processor._get_pruned_states = get_pruned_states
        processor._compute_lm_head = compute_lm_head

    def remove(self) -> None:
        for name in ("_get_pruned_states", "_compute_lm_head"):
            self.processor.__dict__.pop(name, None)


# Adapted layers per drafter kind. EAGLE-3: every linear layer but those that write the context's
# K/V (fc feeds the layer input, k_proj / v_proj the keys and values), and its own LM head if it has
# one (a head borrowed from the target is left alone). The context K/V in SGLang's draft KV pool, which
# the canvas reads back as `past_kv`, then stay the base drafter's, so the do-no-harm guard scores the
# base drafter on its own context; --tts-adapter-kv on adds the K/V writers (KV_WRITERS: drafted K/V go
# to the pool, so both sides still see the same cached context). DFlash: never K/V or fc, whose weights
# SGLang's context-K/V writer uses outside any module call (dflash_worker.py), where no hook can add a
# delta.
ADAPTED_LAYERS = {
    "eagle3": ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj", LM_HEAD),
    "dflash": ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
KV_WRITERS = ("fc", "k_proj", "v_proj")


def adapted_layers(drafter: nn.Module, config) -> tuple[str, ...]:
    """The layers per-request adapters adapt in `drafter` under `config` (adapter_kv): name suffixes,
    or whole module names where a suffix would say too much. An EAGLE-3 drafter of several decoder
    layers (SGLang's have one) feeds each layer's output into the next one's K/V, so without
    adapter_kv only its last layer is adapted, and its LM head."""
    layers = ADAPTED_LAYERS[drafter.kind]
    if drafter.kind != "eagle3":
        return layers
    if config.adapter_kv:
        return KV_WRITERS + layers
    decoder = getattr(drafter, "layers", ())
    if len(decoder) <= 1:
        return layers
    last = f"layers.{len(decoder) - 1}."
    return tuple(
        name
        for name, m in drafter.named_modules()
        if isinstance(m, nn.Linear) and name.startswith(last) and name.rsplit(".", 1)[-1] in layers
    ) + ((LM_HEAD,) if LM_HEAD in layers else ())


def adapters_from_config(drafter: nn.Module, config) -> AdaptedDrafter:
    return AdaptedDrafter(
        drafter,
        num_slots=config.max_adapted_requests,
        rank=config.adapter_rank,
        alpha=config.adapter_alpha,
        layers=adapted_layers(drafter, config),
    )
