"""DFlash drafter: round trips, gradients, bidirectional block, context handling, canvas shift."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from sglang_tts.core.drafter_api import DifferentiableDrafter
from sglang_tts.drafters import DFlashConfig, UnsupportedDrafterConfigError, load_drafter
from sglang_tts.drafters.checkpoints import write_tiny_dflash
from sglang_tts.drafters.loading import load_checkpoint_tensors, read_config


def _block(drafter, canvas):
    return drafter.block_ids_for(canvas.input_ids[:, 0]), canvas.positions[:, :1] + torch.arange(drafter.block_size)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_checkpoint_round_trip(tmp_path, qwen3_target, make_target_tensors, fmt):
    path = write_tiny_dflash(tmp_path / "d", qwen3_target, block_size=5, num_layers=2, fmt=fmt, seed=4)
    cfg = read_config(path)
    # What SGLang's DFLASH worker and parse_dflash_draft_config read.
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == 5 and cfg["num_target_layers"] == 3
    assert cfg["dflash_config"] == {"mask_token_id": 159, "target_layer_ids": [0, 1]}
    assert cfg["layer_types"] == ["full_attention", "full_attention"]

    raw = load_checkpoint_tensors(path)
    embedding, lm_head = make_target_tensors(qwen3_target)
    drafter = load_drafter(path, target_embedding=embedding, target_lm_head=lm_head, target_config=qwen3_target)
    state = drafter.state_dict()
    assert set(state) == set(raw)
    for name, tensor in raw.items():
        assert torch.equal(state[name], tensor), name
    assert drafter.block_size == 5 and drafter.mask_token_id == 159
    assert drafter.fc.weight.shape == (64, 2 * 64)
    assert drafter.layers[0].self_attn.q_norm.weight.shape == (32,)  # per-head norm over head_dim
    assert drafter.lm_head_weight().shape == (160, 64)


def test_gradients_reach_every_trainable_param_not_borrowed(dflash, make_dflash_canvas):
    assert isinstance(dflash, DifferentiableDrafter) and dflash.kind == "dflash"
    canvas = make_dflash_canvas(dflash)
    dflash.zero_grad(set_to_none=True)
    logits = dflash.canvas_logits(canvas)
    assert logits.shape == (2, 4, 160)
    (logits * torch.randn_like(logits)).sum().backward()
    names = {n for n, _ in dflash.trainable_named_parameters()}
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)
    for name, param in dflash.trainable_named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    assert dflash.embed_weight.grad is None and dflash.borrowed_lm_head.grad is None


def test_block_is_bidirectional_and_context_reaches_every_slot(dflash, make_dflash_canvas):
    canvas = make_dflash_canvas(dflash)
    ids, positions = _block(dflash, canvas)
    args = (canvas.features, canvas.context_positions, canvas.context_mask)
    with torch.no_grad():
        base = dflash.block_hidden(ids, positions, *args)
        later = ids.clone()
        later[:, -1] = 7  # change the last block slot only
        changed_later = dflash.block_hidden(later, positions, *args)
        features = canvas.features.clone()
        features[:, 0] += 1.0  # the oldest context row only
        changed_context = dflash.block_hidden(ids, positions, features, *args[1:])
    per_slot_later = (changed_later - base).abs().amax(-1)
    per_slot_context = (changed_context - base).abs().amax(-1)
    assert bool((per_slot_later[:, 0] > 1e-5).all())  # slot 0 sees slot B-1: not causal
    assert bool((per_slot_context > 1e-5).all())


def test_canvas_is_block_slots_shifted_by_one_and_ignores_drafted_tokens(dflash, make_dflash_canvas):
    canvas = make_dflash_canvas(dflash, length=6)  # longer than block_size - 1 = 3 drafted slots
    ids, positions = _block(dflash, canvas)
    assert ids[:, 0].tolist() == canvas.input_ids[:, 0].tolist() and bool((ids[:, 1:] == 159).all())
    with torch.no_grad():
        hidden = dflash.canvas_hidden(canvas)
        block = dflash.block_hidden(ids, positions, canvas.features, canvas.context_positions, canvas.context_mask)
        other_drafts = canvas.input_ids.clone()
        other_drafts[:, 1:] = (other_drafts[:, 1:] + 1) % 150
        redrafted = dflash.canvas_hidden(replace(canvas, input_ids=other_drafts))
        other_anchor = canvas.input_ids.clone()
        other_anchor[:, 0] = (other_anchor[:, 0] + 1) % 150
        reanchored = dflash.canvas_hidden(replace(canvas, input_ids=other_anchor))
    torch.testing.assert_close(hidden[:, :3], block[:, 1:])
    assert bool((hidden[:, 3:] == 0).all())
    torch.testing.assert_close(redrafted, hidden, rtol=0, atol=0)
    assert not torch.allclose(reanchored[:, :3], hidden[:, :3], atol=1e-5)
    _, mask = dflash.teacher_probs(canvas)
    assert mask.tolist() == [[True, True, True, False, False, False]] * 2


def test_context_at_or_after_the_anchor_and_masked_rows_are_ignored(dflash, make_dflash_canvas):
    canvas = make_dflash_canvas(dflash, context=6)
    junk = torch.randn(2, 2, dflash.fc.in_features)
    with torch.no_grad():
        base = dflash.canvas_hidden(canvas)
        # Two extra rows: one at the anchor position, one masked out.
        extra_positions = torch.tensor([[6, 2]]).expand(2, 2)
        padded = replace(
            canvas,
            features=torch.cat((canvas.features, junk), dim=1),
            context_positions=torch.cat((canvas.context_positions, extra_positions), dim=1),
            context_mask=torch.cat((canvas.context_mask, torch.tensor([[True, False]]).expand(2, 2)), dim=1),
        )
        torch.testing.assert_close(dflash.canvas_hidden(padded), base)
        dropped = replace(canvas, context_mask=torch.tensor([[False] + [True] * 5]).expand(2, 6))
        assert not torch.allclose(dflash.canvas_hidden(dropped), base, atol=1e-5)


def test_older_context_as_past_kv_equals_features(dflash, make_dflash_canvas):
    canvas = make_dflash_canvas(dflash, context=6)
    old, new = slice(0, 4), slice(4, 6)
    past = dflash.kv_for_context(canvas.features[:, old], canvas.context_positions[:, old])
    split = replace(
        canvas,
        features=canvas.features[:, new],
        context_positions=canvas.context_positions[:, new],
        context_mask=canvas.context_mask[:, new],
        past_kv=past,
        past_mask=torch.ones(2, 4, dtype=torch.bool),
    )
    with torch.no_grad():
        torch.testing.assert_close(dflash.canvas_hidden(split), dflash.canvas_hidden(canvas))


def test_only_relative_positions_matter(dflash, make_dflash_canvas):
    canvas = make_dflash_canvas(dflash)
    with torch.no_grad():
        base = dflash.canvas_hidden(canvas)
        shifted = dflash.canvas_hidden(
            replace(canvas, positions=canvas.positions + 11, context_positions=canvas.context_positions + 11)
        )
        closer = dflash.canvas_hidden(replace(canvas, context_positions=canvas.context_positions - 5))
    torch.testing.assert_close(shifted, base, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(closer, base, atol=1e-5)


def test_trained_mask_embedding_replaces_the_target_row(
    tmp_path, qwen3_target, make_target_tensors, make_dflash_canvas
):
    path = write_tiny_dflash(tmp_path / "d", qwen3_target)
    embedding, lm_head = make_target_tensors(qwen3_target)
    plain = load_drafter(path, target_embedding=embedding, target_lm_head=lm_head)
    vector = torch.randn(64)
    torch.save({"embedding": vector, "mask_token_id": 159}, path / "mask_embedding.pt")
    trained = load_drafter(path, target_embedding=embedding, target_lm_head=lm_head)
    ids = torch.tensor([[3, 159]])
    torch.testing.assert_close(trained.embed(ids)[0, 1], vector)
    torch.testing.assert_close(trained.embed(ids)[0, 0], embedding[3])
    canvas = make_dflash_canvas(plain)
    with torch.no_grad():
        assert not torch.allclose(trained.canvas_hidden(canvas), plain.canvas_hidden(canvas), atol=1e-5)
    torch.save({"embedding": vector, "mask_token_id": 7}, path / "mask_embedding.pt")
    with pytest.raises(ValueError, match="mask id"):
        load_drafter(path, target_embedding=embedding, target_lm_head=lm_head)


def test_teacher_probs_and_weights(dflash, make_dflash_canvas):
    canvas = make_dflash_canvas(dflash)
    probs, mask = dflash.teacher_probs(canvas)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4))
    torch.testing.assert_close(probs, torch.softmax(canvas.target_logits, -1))
    assert mask.tolist() == [[True, True, True, False]] * 2
    weights = dflash.default_position_weights(3)
    torch.testing.assert_close(weights, torch.exp(-torch.tensor([0.0, 1.0, 2.0]) / 7.0))


def test_default_target_layer_ids_follow_sglang():
    base = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 5,
        "vocab_size": 160,
        "dflash_config": {"mask_token_id": 1},
    }
    # z-lab Qwen3-8B-DFlash-b16: 5 draft layers on a 36-layer target.
    assert DFlashConfig.from_dict(base, target_num_layers=36).target_layer_ids == [1, 9, 17, 25, 33]
    assert DFlashConfig.from_dict(dict(base, num_hidden_layers=1), target_num_layers=36).target_layer_ids == [18]
    assert DFlashConfig.from_dict(dict(base, block_size=8), target_num_layers=36).block_size == 8
    nested = dict(base, dflash_config={"mask_token_id": 1, "block_size": 12, "target_layer_ids": [2]})
    assert DFlashConfig.from_dict(nested).block_size == 12


@pytest.mark.parametrize(
    "override, message",
    [
        ({"layer_types": ["sliding_attention"]}, "full_attention"),
        (
            {
                "dflash_config": {
                    "mask_token_id": 159,
                    "target_layer_ids": [1],
                    "conv_kernel_size": 3,
                    "conv_group_size": 16,
                }
            },
            "conv_kernel_size",
        ),
        ({"use_gemma_norm": True}, "use_gemma_norm"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
    ],
)
def test_unsupported_flags_raise(tmp_path, qwen3_target, make_target_tensors, override, message):
    path = write_tiny_dflash(tmp_path / "d", qwen3_target)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, **override)))
    embedding, lm_head = make_target_tensors(qwen3_target)
    with pytest.raises(UnsupportedDrafterConfigError, match=message):
        load_drafter(path, target_embedding=embedding, target_lm_head=lm_head)
