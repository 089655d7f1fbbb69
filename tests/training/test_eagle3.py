"""EAGLE-3 recipe: the TTT unroll is SGLang's chain drafting, the teacher, the vocabulary, the loss."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sglang_tts.core.canvas import Canvas
from sglang_tts.drafters.loading import check_compatible
from sglang_tts.kernels import gather_draft_probs
from sglang_tts.training import eagle3 as eagle3_module
from sglang_tts.training.eagle3 import (
    Eagle3Objective,
    Eagle3TrainConfig,
    build_eagle3,
    eagle3_aux_layer_ids,
    evaluate_eagle3,
    first_labelled_row,
    frequency_draft_vocab,
    sglang_default_aux_layer_ids,
    unroll,
)
from sglang_tts.training.target import collate

CFG = Eagle3TrainConfig(draft_vocab_size=256, ttt_steps=4, batch_size=3)


@pytest.fixture
def drafter_and_config(tiny_target, sequences):
    used = frequency_draft_vocab(sequences, tiny_target.weights.vocab_size, CFG.draft_vocab_size)
    return build_eagle3(tiny_target.weights, replace(CFG, init_std=0.2), used, seed=0)


def test_aux_layers_are_sglangs_default_where_it_works():
    # SmolLM2-135M (30 layers): SGLang captures the inputs of layers 2, 15, 27.
    assert sglang_default_aux_layer_ids(30) == [1, 14, 26]
    assert eagle3_aux_layer_ids(30) == [1, 14, 26]
    # Too shallow for SGLang's default (it would collapse): three distinct capturable layers.
    ids = eagle3_aux_layer_ids(4)
    assert ids == sorted(set(ids)) and len(ids) == 3 and all(-1 <= i <= 2 for i in ids)


def test_built_config_is_what_sglang_accepts(drafter_and_config, tiny_target):
    drafter, config = drafter_and_config
    check_compatible(config, tiny_target.weights.config)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == drafter.cfg.aux_layer_ids
    assert config["draft_vocab_size"] == CFG.draft_vocab_size
    # Warm start: the draft head is the target head's rows of the draft vocabulary.
    assert torch.equal(drafter.lm_head.weight, tiny_target.weights.lm_head[drafter.draft_to_target_ids()])


def test_draft_vocab_is_the_most_frequent_answer_tokens(sequences, drafter_and_config):
    vocab = 1024
    used = frequency_draft_vocab(sequences, vocab, 256)
    assert used.numel() == 256 and torch.equal(used, used.sort().values)
    counts = torch.bincount(torch.cat(list(sequences.answer_ids())), minlength=vocab)
    assert counts[used].min() >= counts[~torch.isin(torch.arange(vocab), used)].max()
    seen = set(torch.nonzero(counts).flatten().tolist())
    assert len(seen) <= 256 and seen <= set(used.tolist())  # small set: every answer token is in
    # Maps: every draft id lands in t2d, and t2d has exactly draft_vocab_size entries.
    drafter, _ = drafter_and_config
    assert bool(drafter.t2d[drafter.draft_to_target_ids()].all())
    assert int(drafter.t2d.sum()) == drafter.cfg.draft_vocab_size
    assert torch.equal(drafter.draft_to_target_ids().sort().values, drafter.draft_to_target_ids())


def test_ttt_unroll_is_sglang_chain_drafting(drafter_and_config):
    """Row t of TTT step j == canvas position j of the chain anchored at row t, with the step-0 rows
    before t as past K/V: what the SGLang-checked `canvas_hidden` computes (padding included)."""
    drafter, _ = drafter_and_config
    gen = torch.Generator().manual_seed(0)
    b, length, steps = 2, 9, 4
    ids = torch.randint(0, 1024, (b, length), generator=gen)
    feats = torch.randn(b, length, drafter.fc.in_features, generator=gen)
    positions = (torch.arange(length) + 1).expand(b, length)
    rows = torch.ones(b, length, dtype=torch.bool)
    rows[1, 6:] = False  # second sequence is padded after 6 rows
    with torch.no_grad():
        hidden = drafter.ttt_hidden(ids, feats, positions, rows, steps)
        for row, t in [(0, 0), (0, 3), (0, 5), (1, 2)]:
            chain = min(steps, length - t)
            past = (
                drafter.kv_for_context(ids[row : row + 1, :t], feats[row : row + 1, :t], positions[row : row + 1, :t])
                if t
                else None
            )
            canvas = Canvas(
                input_ids=ids[row : row + 1, t : t + chain],
                positions=positions[row : row + 1, t : t + chain],
                target_logits=torch.zeros(1, chain, 1024),
                valid=torch.ones(1, chain, dtype=torch.bool),
                features=feats[row : row + 1, t],
                past_kv=past,
            )
            expected = drafter.canvas_hidden(canvas)
            for j in range(chain):
                assert torch.allclose(hidden[j][row, t], expected[0, j], atol=1e-5), (row, t, j)


def test_later_steps_from_first_row_equal_the_full_unroll(drafter_and_config):
    drafter, _ = drafter_and_config
    gen = torch.Generator().manual_seed(1)
    b, length, steps, first = 2, 11, 4, 6
    ids = torch.randint(0, 1024, (b, length), generator=gen)
    feats = torch.randn(b, length, drafter.fc.in_features, generator=gen)
    positions = (torch.arange(length) + 1).expand(b, length)
    rows = torch.ones(b, length, dtype=torch.bool)
    rows[1, 8:] = False
    with torch.no_grad():
        full = drafter.ttt_hidden(ids, feats, positions, rows, steps)
        part = drafter.ttt_hidden(ids, feats, positions, rows, steps, first_row=first)
    assert len(part) == steps
    for j in range(steps):
        assert part[j].shape == (b, length - first, drafter.cfg.hidden_size)
        assert torch.allclose(part[j], full[j][:, first:], atol=1e-5), j
    with pytest.raises(ValueError, match="first_row"):
        drafter.ttt_hidden(ids, feats, positions, rows, steps, first_row=length)


def test_an_unroll_after_past_kv_equals_the_rows_of_the_full_unroll(drafter_and_config):
    """Earlier rows given as detached K/V (a prompt in SGLang's draft cache) change nothing: the later
    rows of every step are those of one unroll over the whole sequence."""
    drafter, _ = drafter_and_config
    gen = torch.Generator().manual_seed(2)
    b, length, steps, split = 2, 12, 3, 7
    ids = torch.randint(0, 1024, (b, length), generator=gen)
    feats = torch.randn(b, length, drafter.fc.in_features, generator=gen)
    positions = (torch.arange(length) + 1).expand(b, length)
    with torch.no_grad():
        full = drafter.ttt_hidden(ids, feats, positions, steps=steps)
        past = drafter.kv_for_context(ids[:, :split], feats[:, :split], positions[:, :split])
        rest = drafter.ttt_hidden(ids[:, split:], feats[:, split:], positions[:, split:], steps=steps, past_kv=past)
        masked = torch.ones(b, split, dtype=torch.bool)
        masked[:, :2] = False  # masked past entries are not seen
        partial = drafter.ttt_hidden(
            ids[:, split:], feats[:, split:], positions[:, split:], steps=steps, past_kv=past, past_mask=masked
        )
    for j in range(steps):
        assert torch.allclose(rest[j], full[j][:, split:], atol=1e-5), j
    assert not torch.allclose(partial[0], rest[0], atol=1e-5)


def test_loss_and_eval_skip_only_unlabelled_rows(drafter_and_config, tiny_target, sequences, features, monkeypatch):
    """The unroll skips rows before the first labelled one; loss, gradients and held-out metrics are those of
    the full unroll."""
    drafter, _ = drafter_and_config
    objective = Eagle3Objective(drafter, CFG, sequences, features, tiny_target.weights, seed=0)
    batch = objective.batch(0)
    first = first_labelled_row(batch, CFG.ttt_steps)
    assert first > 0  # the prompts are longer than the unroll: rows are skipped
    answer_starts = batch.answer.int().argmax(1)
    assert first == int(answer_starts.min()) - CFG.ttt_steps - 1

    def loss_and_grads():
        drafter.zero_grad()
        loss, metrics = objective.loss(batch)
        loss.backward()
        return loss.detach(), metrics, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}

    loss, metrics, grads = loss_and_grads()
    held = evaluate_eagle3(objective, sequences.subset([0, 1]), features.subset([0, 1]))
    monkeypatch.setattr(eagle3_module, "first_labelled_row", lambda batch, steps: 0)
    full_loss, full_metrics, full_grads = loss_and_grads()
    full_held = evaluate_eagle3(objective, sequences.subset([0, 1]), features.subset([0, 1]))
    assert torch.allclose(loss, full_loss, atol=1e-5)
    assert metrics == pytest.approx(full_metrics, abs=1e-5)
    assert grads.keys() == full_grads.keys() and grads
    for name, grad in grads.items():
        assert torch.allclose(grad, full_grads[name], atol=1e-5), name
    assert held["acc"] == full_held["acc"] and held["accept_len"] == full_held["accept_len"]
    assert held["loss"] == pytest.approx(full_held["loss"], abs=1e-5)


def test_teacher_is_the_target_restricted_to_the_draft_vocab(drafter_and_config, tiny_target, sequences, features):
    drafter, _ = drafter_and_config
    objective = Eagle3Objective(drafter, CFG, sequences, features, tiny_target.weights, seed=0)
    batch = collate(sequences, features, [0])
    with torch.no_grad():
        out = unroll(drafter, batch, objective.aux_index, objective.teacher_head, 1)
        full_logits = batch.final[0] @ tiny_target.weights.lm_head.T
    probs, mask = gather_draft_probs(full_logits, drafter.d2t, drafter.t2d, backend="torch")
    assert torch.allclose(out.teacher_logp[0].exp(), probs, atol=1e-5)
    assert torch.equal(mask, drafter.t2d[batch.top1[0]])


def test_training_lowers_the_loss(drafter_and_config, tiny_target, sequences, features):
    drafter, _ = drafter_and_config
    objective = Eagle3Objective(drafter, CFG, sequences, features, tiny_target.weights, seed=0)
    batch = objective.batch(0)
    with torch.no_grad():
        before, metrics = objective.loss(batch)
    assert set(metrics) == {f"{m}_{j}" for m in ("ce", "acc") for j in range(CFG.ttt_steps)}
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(15):
        loss, _ = objective.loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        after, _ = objective.loss(batch)
    assert float(after) < 0.7 * float(before)
    # The embedding stays the target's (a buffer, never trained).
    assert torch.equal(drafter.embed_weight, tiny_target.weights.embedding)
