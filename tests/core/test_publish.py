"""Publishing trained weights into fused and TP-sharded inference tensors, in place."""

from __future__ import annotations

import pytest
import torch

from sglang_tts.core.publish import (
    ParamBinding,
    PublishError,
    ShardSpec,
    WeightPublisher,
    stacked_name_map,
)


def _trained_attention(generator: torch.Generator, hidden: int = 8, kv: int = 4) -> dict[str, torch.Tensor]:
    return {
        "attn.q_proj.weight": torch.randn(hidden, hidden, generator=generator),
        "attn.k_proj.weight": torch.randn(kv, hidden, generator=generator),
        "attn.v_proj.weight": torch.randn(kv, hidden, generator=generator),
        "attn.o_proj.weight": torch.randn(hidden, hidden, generator=generator),
    }


def test_stacked_qkv_written_in_place_with_cast(generator):
    trained = _trained_attention(generator)
    fused = torch.zeros(16, 8, dtype=torch.bfloat16)
    pointer = fused.data_ptr()
    publisher = WeightPublisher(
        [ParamBinding(fused, ["attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"], name="qkv")],
        source_shapes=trained,
    )
    publisher.publish(trained)
    expected = torch.cat([trained["attn.q_proj.weight"], trained["attn.k_proj.weight"], trained["attn.v_proj.weight"]])
    assert fused.data_ptr() == pointer and fused.dtype == torch.bfloat16
    assert torch.equal(fused, expected.to(torch.bfloat16))

    trained["attn.k_proj.weight"].add_(1.0)  # a later publish sees the new values, same storage
    publisher.publish(trained)
    assert fused.data_ptr() == pointer
    assert torch.equal(fused[8:12], trained["attn.k_proj.weight"].to(torch.bfloat16))


def test_tensor_parallel_halves_reassemble_the_full_weight(generator):
    trained = _trained_attention(generator)
    qkv_names = ["attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"]
    # Column-parallel fused qkv: q, k and v are each split over the ranks, then stacked per rank.
    qkv_shards = [torch.empty(8, 8) for _ in range(2)]
    # Row-parallel o_proj: the input dimension is split.
    o_shards = [torch.empty(8, 4) for _ in range(2)]
    for rank in range(2):
        WeightPublisher(
            [
                ParamBinding(qkv_shards[rank], qkv_names, shard=ShardSpec(0, rank, 2)),
                ParamBinding(o_shards[rank], ["attn.o_proj.weight"], shard=ShardSpec(1, rank, 2)),
            ],
            source_shapes=trained,
        ).publish(trained)

    assert torch.equal(torch.cat(o_shards, dim=1), trained["attn.o_proj.weight"])
    for i, (name, width) in enumerate(zip(qkv_names, (4, 2, 2))):
        offset = sum((4, 2, 2)[:i])
        halves = [shard[offset : offset + width] for shard in qkv_shards]
        assert torch.equal(torch.cat(halves), trained[name]), name
    # Rank 0's fused tensor is not simply the top half of the full stacked weight.
    full = torch.cat([trained[n] for n in qkv_names])
    assert not torch.equal(qkv_shards[0], full[:8])


def test_bad_bindings_fail_at_bind_time(generator):
    trained = _trained_attention(generator)
    with pytest.raises(PublishError, match=r"give shape \(16, 8\), destination is \(12, 8\)"):
        WeightPublisher(
            [ParamBinding(torch.zeros(12, 8), ["attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"])],
            source_shapes=trained,
        )
    with pytest.raises(PublishError, match="lack"):
        WeightPublisher([ParamBinding(torch.zeros(8, 8), ["attn.nope.weight"])], source_shapes=trained)
    with pytest.raises(PublishError, match="does not split"):
        WeightPublisher(
            [ParamBinding(torch.zeros(4, 8), ["attn.k_proj.weight"], shard=ShardSpec(0, 0, 3))], source_shapes=trained
        )
    with pytest.raises(PublishError, match="rank"):
        ShardSpec(0, 2, 2)


def test_from_name_map_and_stacked_names(generator):
    trained = _trained_attention(generator)
    trained["mlp.gate_proj.weight"] = torch.randn(6, 8, generator=generator)
    trained["mlp.up_proj.weight"] = torch.randn(6, 8, generator=generator)
    serving = {
        "attn.qkv_proj.weight": torch.zeros(16, 8),
        "attn.o_proj.weight": torch.zeros(8, 8),
        "mlp.gate_up_proj.weight": torch.zeros(12, 8),
        "rotary.cache": torch.zeros(3),
    }
    name_map = stacked_name_map(serving, trained)
    assert name_map == {
        "attn.qkv_proj.weight": ["attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"],
        "attn.o_proj.weight": ["attn.o_proj.weight"],
        "mlp.gate_up_proj.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    }
    WeightPublisher.from_name_map(serving, trained, name_map).publish(trained)
    assert torch.equal(serving["mlp.gate_up_proj.weight"][6:], trained["mlp.up_proj.weight"])
    assert torch.equal(serving["attn.o_proj.weight"], trained["attn.o_proj.weight"])

    identity = {"attn.o_proj.weight": torch.zeros(8, 8)}
    WeightPublisher.from_name_map(identity, trained).publish(trained)
    assert torch.equal(identity["attn.o_proj.weight"], trained["attn.o_proj.weight"])
    with pytest.raises(PublishError, match="no serving tensor"):
        WeightPublisher.from_name_map(serving, trained, {"missing": "attn.o_proj.weight"})


def test_restricted_to_keeps_the_bindings_that_read_a_trained_weight(generator):
    trained = _trained_attention(generator)
    serving = {"attn.qkv_proj.weight": torch.zeros(16, 8), "attn.o_proj.weight": torch.zeros(8, 8)}
    publisher = WeightPublisher.from_name_map(serving, trained, stacked_name_map(serving, trained))
    only_q = publisher.restricted_to(["attn.q_proj.weight"])
    assert [b.name for b in only_q.bindings] == ["attn.qkv_proj.weight"]
    only_q.publish(trained)  # the fused destination whole: its k and v parts rewritten with their values
    assert torch.equal(serving["attn.qkv_proj.weight"][8:12], trained["attn.k_proj.weight"])
    assert torch.equal(serving["attn.o_proj.weight"], torch.zeros(8, 8))  # not bound any more: untouched
    assert publisher.restricted_to(["mlp.up_proj.weight"]).bindings == []
