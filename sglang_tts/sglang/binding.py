"""Where the TTS drafter meets SGLang's models: the borrowed target embedding, and the binding
of SGLang's draft-model parameters (fused qkv / gate_up, `model.` prefix, padded vocab rows) to
the trained drafter's, through which updates are published in place."""

from __future__ import annotations

from collections.abc import Callable

import torch

from sglang_tts.core.publish import WeightPublisher, stacked_name_map


def target_embedding(target_worker) -> torch.Tensor:
    model = target_worker.model_runner.model
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.model.embed_tokens
    return embed.weight


def bind_draft_publisher(drafter, draft_model) -> WeightPublisher:
    """Bind SGLang's draft-model parameters (fused qkv / gate_up, `model.` prefix) to ours."""
    trained = dict(drafter.trainable_named_parameters())
    publisher, unbound = _bind(trained, draft_model)
    if unbound:
        raise RuntimeError(f"TTS cannot publish trained drafter weights {unbound}: no SGLang parameter matches")
    return publisher


def bind_draft_reader(drafter, draft_model) -> tuple[WeightPublisher, list[str]]:
    """The same binding over every parameter of a differentiable drafter (frozen ones too), read
    backwards (`WeightPublisher.read`) when SGLang loaded new drafter weights itself
    (sglang/weight_sync.py); and the parameters SGLang's draft model has no home for."""
    return _bind(dict(drafter.named_parameters()), draft_model)


def _bind(trained: dict[str, torch.Tensor], draft_model) -> tuple[WeightPublisher, list[str]]:
    serving = {}
    for name, param in draft_model.named_parameters():
        name = name.removeprefix("model.")
        tensor = param.data
        if name in trained and tensor.shape[0] > trained[name].shape[0] and tensor.shape[1:] == trained[name].shape[1:]:
            # SGLang pads vocab-parallel heads to a multiple of 64 rows: publish into the real rows only.
            tensor = tensor[: trained[name].shape[0]]
        serving[name] = tensor
    name_map = stacked_name_map(serving, trained)
    bound = {s for srcs in name_map.values() for s in srcs}
    unbound = sorted(set(trained) - bound)
    return WeightPublisher.from_name_map(serving, {n: t for n, t in trained.items() if n in bound}, name_map), unbound


def draft_kv_reader(req_to_token, pool, draft_layers, pool_indices: list[int], ends: list[int]):
    """read(r): the drafter K/V SGLang materialised in its draft KV pool for positions [0, ends[r])
    of batch row r, per draft layer as (k, v) [H_kv, L, D] (detached views of the pool)."""

    def read(r: int):
        slots = req_to_token[pool_indices[r], : ends[r]].long()
        layers = []
        for attn in draft_layers:
            k = pool.get_key_buffer(attn.layer_id)[slots]
            v = pool.get_value_buffer(attn.layer_id)[slots]
            layers.append((k.transpose(0, 1), v.transpose(0, 1)))
        return layers

    return read


def make_runtime(drafter, config, draft_model, device, pool_size: Callable[[], int]):
    """The TTSRuntime of a worker: full-parameter updates published into SGLang's draft model
    (scopes batch / global), or per-request adapters hooked into it (scopes request / group).
    pool_size: rows of SGLang's req_to_token pool (every req_pool_idx a request can hold), asked
    when the first batch is mapped (SGLang creates the pool after the workers)."""
    from dataclasses import replace

    from sglang_tts.config import ADAPTER_SCOPES, FULL_RANK
    from sglang_tts.sglang.adapters import ServingAdapters, adapters_from_config
    from sglang_tts.sglang.runtime import TTSRuntime

    if config.scope not in ADAPTER_SCOPES:
        return TTSRuntime(drafter, config, bind_draft_publisher(drafter, draft_model), device)
    adapted = adapters_from_config(drafter, config).to(device)
    serving = ServingAdapters(draft_model, adapted, device, pool_size)
    # Low-rank adapters train at their own (LoRA-sized) rate; a dense delta is a per-request copy of
    # the adapted layers and trains at the full-parameter rate.
    lr = config.lr if config.adapter_rank == FULL_RANK else config.adapter_lr
    return TTSRuntime(adapted, replace(config, lr=lr), serving.publisher, device, serving)
