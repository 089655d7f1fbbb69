"""DFlash recipe: parallel anchored blocks equal SGLang's block forward, anchors, mask token, loss."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sglang_tts.drafters.loading import check_compatible
from sglang_tts.training.data import SequenceSet
from sglang_tts.training.dflash import (
    DFlashObjective,
    DFlashTrainConfig,
    build_dflash,
    dflash_target_layer_ids,
    pick_mask_token_id,
    sample_anchors,
)
from sglang_tts.training.target import collate

CFG = DFlashTrainConfig(block_size=4, num_layers=2, num_target_features=3, num_anchors=6, batch_size=3)


@pytest.fixture
def drafter_and_config(tiny_target, sequences):
    mask_id = pick_mask_token_id(tiny_target.tokenizer, sequences, tiny_target.weights.vocab_size)
    return build_dflash(tiny_target.weights, replace(CFG, init_std=0.2), mask_id, seed=0)


def test_layer_ids_and_gamma_defaults():
    assert dflash_target_layer_ids(30, 3) == [1, 14, 27]  # SGLang / SpecForge spacing over 1 .. N - 3
    ids = dflash_target_layer_ids(4, 3)  # too shallow for that spacing: distinct capturable layers
    assert ids == sorted(set(ids)) and all(0 <= i <= 2 for i in ids)
    assert DFlashTrainConfig(block_size=16).gamma() == 7.0
    assert DFlashTrainConfig(block_size=8).gamma() == 4.0
    assert DFlashTrainConfig(block_size=8, loss_gamma=2.5).gamma() == 2.5


def test_explicit_target_layers_are_written_and_checked(tiny_target):
    weights = tiny_target.weights  # 4 layers: output-of-layer ids 0..2 are capturable
    _, config = build_dflash(weights, replace(CFG, target_layer_ids=[0, 2]), mask_token_id=5, seed=0)
    assert config["dflash_config"]["target_layer_ids"] == [0, 2]
    for bad in ([2, 0], [1, 1], [0, 3]):
        with pytest.raises(ValueError, match="DFlash target layers"):
            build_dflash(weights, replace(CFG, target_layer_ids=bad), mask_token_id=5, seed=0)


def test_mask_token_is_an_unused_special_token(tiny_target, sequences, drafter_and_config):
    tok = tiny_target.tokenizer
    system = tok.convert_tokens_to_ids("<|system|>")  # a special token the chat prompts never use
    text_only = SequenceSet([torch.tensor([3, 4, 5, 40, 41])], [2], ["a"])
    assert pick_mask_token_id(tok, text_only, 1024) == system
    # Once every free special token occurs in the data (a random target may emit them), the
    # highest id that never occurs.
    with_system = SequenceSet([torch.tensor([3, 4, 5, system, 1023])], [2], ["a"])
    assert pick_mask_token_id(tok, with_system, 1024) == 1022
    mask_id = pick_mask_token_id(tok, sequences, 1024)
    assert mask_id not in {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}
    assert not any(bool((ids == mask_id).any()) for ids in sequences.ids)
    drafter, config = drafter_and_config
    assert config["dflash_config"]["mask_token_id"] == mask_id == drafter.mask_token_id
    check_compatible(config, tiny_target.weights.config)


def test_anchored_blocks_equal_one_block_at_a_time(drafter_and_config):
    """All blocks of a sequence in one forward (shared context K/V) == `block_hidden` per anchor,
    which is what SGLang's DFlash worker runs."""
    drafter, _ = drafter_and_config
    gen = torch.Generator().manual_seed(0)
    b, length, s = 2, 12, drafter.block_size
    feats = torch.randn(b, length, drafter.fc.in_features, generator=gen)
    ctx_pos = torch.arange(length).expand(b, length)
    ctx_mask = torch.ones(b, length, dtype=torch.bool)
    ctx_mask[1, 9:] = False  # padded context rows are never visible
    anchors = torch.tensor([[1, 4, 8], [2, 5, 7]])
    blocks = drafter.block_ids_for(torch.randint(0, 1000, (b * 3,), generator=gen)).view(b, 3, s)
    positions = anchors[..., None] + torch.arange(s)
    with torch.no_grad():
        together = drafter.anchored_block_hidden(blocks, positions, feats, ctx_pos, ctx_mask)
        for row in range(b):
            for a in range(3):
                alone = drafter.block_hidden(
                    blocks[row, a][None],
                    positions[row, a][None],
                    feats[row : row + 1],
                    ctx_pos[row : row + 1],
                    ctx_mask[row : row + 1],
                )
                assert torch.allclose(together[row, a], alone[0], atol=1e-5), (row, a)


def test_anchors_lie_where_the_next_token_is_an_answer_token(sequences, features):
    batch = collate(sequences, features, [0, 1, 2])
    anchors, keep = sample_anchors(batch, 6, torch.Generator().manual_seed(0))
    again, _ = sample_anchors(batch, 6, torch.Generator().manual_seed(0))
    assert torch.equal(anchors, again)
    for row in range(3):
        chosen = anchors[row][keep[row]]
        assert chosen.numel() == 6 and chosen.unique().numel() == 6
        assert bool(batch.answer[row, chosen + 1].all()) and int(chosen.min()) >= 1


def test_training_lowers_the_loss(drafter_and_config, sequences, features):
    drafter, _ = drafter_and_config
    objective = DFlashObjective(drafter, CFG, sequences, features, seed=0)
    batch = collate(sequences, features, [0, 1, 2])
    with torch.no_grad():
        before, metrics = objective.loss(batch, torch.Generator().manual_seed(0))
    assert {f"acc_{k}" for k in range(1, CFG.block_size)} <= set(metrics)
    params = [p for p in drafter.parameters() if p.requires_grad]
    assert all(p is not drafter.borrowed_lm_head and p is not drafter.embed_weight for p in params)
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    for _ in range(15):
        loss, _ = objective.loss(batch, torch.Generator().manual_seed(0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        after, _ = objective.loss(batch, torch.Generator().manual_seed(0))
    assert float(after) < 0.7 * float(before)
