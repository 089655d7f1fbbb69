"""Loader: drafter kinds, compatibility errors, sharded checkpoints, weights taken from the target."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_tts.drafters import (
    DFlashDrafter,
    Eagle3Drafter,
    IncompatibleDrafterError,
    check_compatible,
    drafter_kind,
    load_drafter,
)
from sglang_tts.drafters.checkpoints import write_tiny_dflash, write_tiny_eagle3
from sglang_tts.drafters.loading import read_config


def test_drafter_kind(tmp_path, llama_target, qwen3_target):
    assert drafter_kind(write_tiny_eagle3(tmp_path / "e", llama_target)) == "eagle3"
    assert drafter_kind(write_tiny_dflash(tmp_path / "d", qwen3_target)) == "dflash"
    # AngelSlim's architecture name, and a DFlash config recognised by its dflash_config alone.
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps({"architectures": ["Eagle3LlamaForCausalLM"]}))
    assert drafter_kind(tmp_path / "a") == "eagle3"
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text(json.dumps({"dflash_config": {"mask_token_id": 3}}))
    assert drafter_kind(tmp_path / "b") == "dflash"
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text(json.dumps({"architectures": ["MedusaModel"]}))
    with pytest.raises(IncompatibleDrafterError, match="unknown drafter architecture.*MedusaModel"):
        drafter_kind(tmp_path / "c")


def _eagle3_config(tmp_path, target, **eagle_config):
    cfg = read_config(write_tiny_eagle3(tmp_path / "e", target))
    cfg["eagle_config"].update(eagle_config)
    return cfg


def test_compatible_pairs_pass(tmp_path, llama_target, qwen3_target):
    check_compatible(read_config(write_tiny_eagle3(tmp_path / "e", llama_target)), llama_target)
    check_compatible(read_config(write_tiny_eagle3(tmp_path / "q", qwen3_target)), qwen3_target)
    check_compatible(read_config(write_tiny_dflash(tmp_path / "d", qwen3_target)), qwen3_target)
    check_compatible(read_config(write_tiny_dflash(tmp_path / "l", llama_target, num_layers=3)), llama_target)


def test_eagle3_incompatibilities(tmp_path, llama_target):
    cfg = _eagle3_config(tmp_path, llama_target)
    with pytest.raises(IncompatibleDrafterError, match="hidden size mismatch"):
        check_compatible(cfg, dict(llama_target, hidden_size=96))
    with pytest.raises(IncompatibleDrafterError, match="vocab mismatch"):
        check_compatible(cfg, dict(llama_target, vocab_size=300))
    with pytest.raises(IncompatibleDrafterError, match=r"out of range.*\[3\]"):
        check_compatible(
            _eagle3_config(tmp_path, llama_target, eagle_aux_hidden_state_layer_ids=[0, 1, 3]), llama_target
        )
    with pytest.raises(IncompatibleDrafterError, match="strictly increasing"):
        check_compatible(
            _eagle3_config(tmp_path, llama_target, eagle_aux_hidden_state_layer_ids=[2, 1, 0]), llama_target
        )
    # No explicit ids: SGLang's default capture (inputs of 2, N//2, N-3) collapses on 4 layers.
    no_ids = dict(cfg)
    no_ids.pop("eagle_config")
    with pytest.raises(IncompatibleDrafterError, match="default EAGLE-3 capture"):
        check_compatible(no_ids, llama_target)
    check_compatible(no_ids, dict(llama_target, num_hidden_layers=32))


def test_dflash_incompatibilities(tmp_path, qwen3_target):
    cfg = read_config(write_tiny_dflash(tmp_path / "d", qwen3_target))
    with pytest.raises(IncompatibleDrafterError, match="hidden size mismatch"):
        check_compatible(cfg, dict(qwen3_target, hidden_size=128))
    with pytest.raises(IncompatibleDrafterError, match="vocab mismatch"):
        check_compatible(cfg, dict(qwen3_target, vocab_size=128))
    with pytest.raises(IncompatibleDrafterError, match=r"target layer ids out of range.*\[2\]"):
        check_compatible(dict(cfg, dflash_config={"mask_token_id": 3, "target_layer_ids": [0, 2]}), qwen3_target)
    with pytest.raises(IncompatibleDrafterError, match="mask_token_id"):
        check_compatible(dict(cfg, dflash_config={"mask_token_id": 300, "target_layer_ids": [0]}), qwen3_target)


def test_load_drafter_checks_compatibility_first(tmp_path, llama_target, make_target_tensors):
    path = write_tiny_eagle3(tmp_path / "e", llama_target)
    with pytest.raises(IncompatibleDrafterError, match="hidden size mismatch"):
        load_drafter(
            path,
            target_embedding=make_target_tensors(llama_target)[0],
            target_config=dict(llama_target, hidden_size=32),
        )


def test_missing_target_embedding_is_an_error(tmp_path, llama_target):
    with pytest.raises(ValueError, match="target embedding"):
        load_drafter(write_tiny_eagle3(tmp_path / "e", llama_target))


def test_sharded_safetensors_index(tmp_path, llama_target, make_target_tensors):
    path = write_tiny_eagle3(tmp_path / "e", llama_target, layout="layers.0")
    embedding = make_target_tensors(llama_target)[0]
    single = load_drafter(path, target_embedding=embedding)
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(path / shard))
        weight_map.update({n: shard for n in shard_names})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    sharded = load_drafter(path, target_embedding=embedding)
    for (name, a), (_, b) in zip(single.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), name


def test_borrowed_weights_from_target_checkpoint(tmp_path, qwen3_target, make_target_tensors):
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    (target_dir / "config.json").write_text(json.dumps(qwen3_target))
    embedding, lm_head = make_target_tensors(qwen3_target, seed=5)
    save_file(
        {"model.embed_tokens.weight": embedding, "lm_head.weight": lm_head, "model.norm.weight": torch.ones(64)},
        str(target_dir / "model.safetensors"),
    )
    dflash = load_drafter(write_tiny_dflash(tmp_path / "d", qwen3_target), target_path=target_dir)
    assert isinstance(dflash, DFlashDrafter)
    assert torch.equal(dflash.embed_weight, embedding) and torch.equal(dflash.lm_head_weight(), lm_head)
    eagle3 = load_drafter(write_tiny_eagle3(tmp_path / "e", qwen3_target), target_path=target_dir)
    assert isinstance(eagle3, Eagle3Drafter) and torch.equal(eagle3.embed_weight, embedding)


def test_eagle3_without_draft_vocab_borrows_the_target_lm_head(
    tmp_path, llama_target, make_target_tensors, make_eagle3_inputs
):
    path = write_tiny_eagle3(tmp_path / "e", llama_target, draft_vocab_size=llama_target["vocab_size"])
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("draft_vocab_size")
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(path / "model.safetensors"))
    save_file(
        {k: v for k, v in tensors.items() if k not in ("lm_head.weight", "d2t", "t2d")}, str(path / "model.safetensors")
    )
    embedding, lm_head = make_target_tensors(llama_target)
    drafter = load_drafter(path, target_embedding=embedding, target_lm_head=lm_head)
    assert drafter.lm_head is None and torch.equal(drafter.lm_head_weight(), lm_head)
    assert torch.equal(drafter.draft_to_target_ids(), torch.arange(llama_target["vocab_size"]))
    names = {n for n, _ in drafter.trainable_named_parameters()}
    assert "fc.weight" in names and not any("lm_head" in n for n in names)
    canvas = make_eagle3_inputs(drafter)["canvas"]
    assert drafter.canvas_logits(canvas).shape == (2, 4, llama_target["vocab_size"])


def test_state_dict_is_a_loadable_checkpoint(tmp_path, llama_target, make_target_tensors, make_eagle3_inputs):
    """What a trained copy saves (layers.0 layout + d2t/t2d) loads back to the same drafter."""
    embedding = make_target_tensors(llama_target)[0]
    path = write_tiny_eagle3(tmp_path / "e", llama_target)
    drafter = load_drafter(path, target_embedding=embedding)
    with torch.no_grad():
        drafter.fc.weight.add_(0.01)
    out = tmp_path / "saved"
    out.mkdir()
    (out / "config.json").write_text((path / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, str(out / "model.safetensors"))
    again = load_drafter(out, target_embedding=embedding)
    canvas = make_eagle3_inputs(drafter)["canvas"]
    with torch.no_grad():
        torch.testing.assert_close(again.canvas_hidden(canvas), drafter.canvas_hidden(canvas), rtol=0, atol=0)


@pytest.mark.parametrize(
    "shard", ["../outside.safetensors", "sub/../../outside.safetensors", "/tmp/outside.safetensors"]
)
def test_index_shards_outside_the_checkpoint_are_refused(tmp_path, llama_target, make_target_tensors, shard):
    path = write_tiny_eagle3(tmp_path / "e", llama_target, layout="layers.0")
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    save_file(tensors, str(tmp_path / "outside.safetensors"))  # a readable file the name would reach
    weight_map = dict.fromkeys(tensors, shard.replace("/tmp/", f"{tmp_path}/"))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    embedding = make_target_tensors(llama_target)[0]
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: shard .*outside the checkpoint"):
        load_drafter(path, target_embedding=embedding)
