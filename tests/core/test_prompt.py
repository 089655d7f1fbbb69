"""Prompt-time adaptation: windows, the drafters' prompt forwards, and prompt updates in the Distiller."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_tts.config import TTSConfig, TTSConfigError
from sglang_tts.core.adapters import AdaptedDrafter
from sglang_tts.core.distiller import Distiller
from sglang_tts.core.prompt import PromptWindow, collate_windows, cut_window, prompt_loss
from sglang_tts.drafters import load_drafter
from sglang_tts.drafters.checkpoints import write_tiny_dflash, write_tiny_eagle3

TARGET = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


def _target_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    v, h = TARGET["vocab_size"], TARGET["hidden_size"]
    return torch.randn(v, h, generator=gen), 0.1 * torch.randn(v, h, generator=gen)


@pytest.fixture(scope="module")
def eagle3_path(tmp_path_factory):
    return write_tiny_eagle3(tmp_path_factory.mktemp("p") / "eagle3", TARGET, draft_vocab_size=48, seed=1)


@pytest.fixture(scope="module")
def dflash_path(tmp_path_factory):
    return write_tiny_dflash(tmp_path_factory.mktemp("p") / "dflash", TARGET, block_size=4, num_layers=2, seed=2)


def _eagle3(path):
    embedding, _ = _target_tensors()
    return load_drafter(path, target_embedding=embedding, target_config=TARGET)


def _dflash(path):
    embedding, head = _target_tensors()
    return load_drafter(path, target_embedding=embedding, target_lm_head=head, target_config=TARGET)


def _window(rid: str, n: int, width: int, seed: int, start: int = 10, vocab: int = 64) -> PromptWindow:
    gen = torch.Generator().manual_seed(seed)
    return PromptWindow(
        rid, torch.randint(0, vocab, (n + 1,), generator=gen), torch.randn(n, width, generator=gen), start
    )


def _config(**overrides) -> TTSConfig:
    base = {"prompt_adapt": "on", "prompt_steps": 6, "prompt_lr": 3e-3, "log_interval": 0, "update_stride": 2}
    return TTSConfig(**{**base, **overrides}).validate()


# --- windows ------------------------------------------------------------------------------------


def test_cut_keeps_the_last_positions_and_moves_the_start():
    w = _window("r", 10, 6, 0, start=5)
    cut = cut_window(w, 4)
    assert cut.num_positions == 4 and cut.start == 11
    assert torch.equal(cut.token_ids, w.token_ids[6:]) and torch.equal(cut.features, w.features[6:])
    assert cut_window(w, 50) is w


def test_chunks_of_one_prompt_concatenate_and_a_gap_starts_over():
    first = _window("r", 6, 4, 0, start=0)
    second = _window("r", 5, 4, 1, start=6)  # starts where the first chunk's features end
    joined = first.extended(second.token_ids, second.features, 6, keep=100)
    assert joined.start == 0 and joined.num_positions == 11
    # the first chunk's last token (the next prompt token) is the second chunk's first: kept once
    assert torch.equal(joined.token_ids, torch.cat((first.token_ids[:-1], second.token_ids)))
    assert torch.equal(joined.features, torch.cat((first.features, second.features)))
    cut = first.extended(second.token_ids, second.features, 6, keep=7)
    assert cut.start == 4 and cut.num_positions == 7
    gap = first.extended(second.token_ids, second.features, 9, keep=100)
    assert gap.start == 9 and torch.equal(gap.features, second.features)


def test_collate_pads_short_windows_and_marks_real_tokens():
    batch = collate_windows([_window("a", 5, 3, 0, start=2), _window("b", 3, 3, 1, start=40)], "cpu", slots=[1, -1])
    assert batch.token_ids.shape == (2, 6) and batch.features.shape == (2, 5, 3)
    assert batch.real.sum(1).tolist() == [6, 4]
    assert batch.num_positions == 5 + 3
    assert batch.positions[1].tolist() == list(range(40, 46))
    assert batch.token_ids[1, 4:].tolist() == [batch.token_ids[1, 3].item()] * 2  # padding repeats the last
    assert batch.slots.tolist() == [1, -1] and batch.request_ids == ["a", "b"]
    assert not batch.features.is_inference()


# --- the drafters' prompt forwards --------------------------------------------------------------


def test_eagle3_prompt_terms_predict_the_token_two_ahead_per_unrolled_step(eagle3_path):
    drafter = _eagle3(eagle3_path)
    width = drafter.fc.in_features
    batch = collate_windows([_window("a", 9, width, 0), _window("b", 6, width, 1)], "cpu")
    depth = 3
    terms = drafter.prompt_terms(batch, depth)
    hidden = drafter.ttt_hidden(
        batch.token_ids[:, 1:], batch.features, batch.positions[:, 1:], batch.feature_mask, depth
    )
    to_draft = drafter.target_to_draft_ids()
    expected = []
    for j in range(depth):
        for b, n in enumerate([9, 6]):
            for t in range(9):
                label_at = t + j + 2
                if label_at > n:  # past the window (or padding)
                    continue
                label = int(to_draft[batch.token_ids[b, label_at]])
                if label >= 0:
                    expected.append((b, t, j, label))
    assert terms.labels.tolist() == [e[3] for e in expected]
    assert terms.batch_rows.tolist() == [e[0] for e in expected]
    assert torch.allclose(terms.weights, torch.tensor([0.8 ** e[2] for e in expected]))
    rows = torch.stack([hidden[j][b, t] for b, t, j, _ in expected])
    assert torch.allclose(terms.hidden, rows)
    assert 0 < len(expected) < 3 * (9 + 6)  # some labels lie outside the 48-token draft vocabulary


def test_dflash_prompt_terms_equal_block_forwards_over_the_window(dflash_path):
    drafter = _dflash(dflash_path)
    width = drafter.fc.in_features
    window = _window("a", 12, width, 3)
    batch = collate_windows([window], "cpu")
    terms = drafter.prompt_terms(batch, depth=8)  # more than the block has: block_size - 1 slots
    s = drafter.block_size
    # 11 anchors (one per window index 1..11), slots 1..3, labels inside the window only
    labelled = [(a, k) for a in range(1, 12) for k in range(1, s) if a + k <= 12]
    assert terms.labels.tolist() == [int(window.token_ids[a + k]) for a, k in labelled]
    a, k = 5, 2
    block = drafter.block_ids_for(window.token_ids[a : a + 1])
    hidden = drafter.block_hidden(
        block,
        batch.positions[:, a : a + 1] + torch.arange(s),
        batch.features,
        batch.positions[:, :-1],
        batch.feature_mask,
    )
    index = labelled.index((a, k))
    assert torch.allclose(terms.hidden[index], hidden[0, k], atol=1e-5)
    assert torch.allclose(terms.weights[index], torch.tensor(math.exp(-(k - 1) / 7)))


# --- prompt updates in the Distiller --------------------------------------------------------------


def _greedy_hits(drafter, batch) -> float:
    with torch.no_grad():
        terms = drafter.prompt_terms(batch, 1)
        picks = (terms.hidden @ drafter.lm_head_weight().T).argmax(-1)
    return float((picks == terms.labels).float().mean())


def test_a_prompt_update_teaches_the_drafter_its_prompt_and_publishes_at_the_barrier(eagle3_path):
    drafter = _eagle3(eagle3_path)
    before = {n: p.detach().clone() for n, p in drafter.trainable_named_parameters()}
    distiller = Distiller(drafter, _config(prompt_steps=30, prompt_lr=1e-2, prompt_trainable=("",)))
    batch = collate_windows([_window("a", 24, drafter.fc.in_features, 4)], "cpu")
    hits_before = _greedy_hits(drafter, batch)
    assert distiller.submit_prompt(batch)
    assert distiller.barrier(force=True)
    stats = distiller.stats
    assert stats.num_prompt_updates == 1 and stats.num_updates == 0
    assert stats.prompt_positions_total == 24 and stats.prompt_steps_total == 30
    assert stats.last_prompt_loss_after < 0.5 * stats.last_prompt_loss
    assert stats.prompt_ms_total > 0 and stats.update_ms_total == 0
    changed = [n for n, p in drafter.trainable_named_parameters() if not torch.equal(p, before[n])]
    assert changed, "the serving drafter must hold the published prompt-adapted weights"
    assert _greedy_hits(drafter, batch) > hits_before + 0.3
    # verify updates keep their own learning rate and optimizer state
    assert all(group["lr"] == distiller.config.lr for group in distiller.optimizer.param_groups)
    assert not distiller.optimizer.state


def test_by_default_prompt_steps_move_only_the_feature_projection(eagle3_path):
    drafter = _eagle3(eagle3_path)
    before = {n: p.detach().clone() for n, p in drafter.trainable_named_parameters()}
    distiller = Distiller(drafter, _config(prompt_steps=5, prompt_lr=1e-2))
    assert distiller.submit_prompt(collate_windows([_window("a", 16, drafter.fc.in_features, 4)], "cpu"))
    distiller.barrier(force=True)
    stats = distiller.stats
    assert stats.last_prompt_loss_after < stats.last_prompt_loss
    changed = {n for n, p in drafter.trainable_named_parameters() if not torch.equal(p, before[n])}
    assert changed == {n for n in before if n.startswith("fc.")}
    assert all(p.requires_grad for p in distiller.train_params)  # the others train again in verify updates
    assert not distiller.optimizer.state  # prompt steps keep their Adam moments to themselves


def test_prompt_steps_default_to_three_times_the_update_rate():
    assert TTSConfig().prompt_step_lr == pytest.approx(3e-4)
    assert TTSConfig(lr=1e-3).prompt_step_lr == pytest.approx(3e-3)  # per-request adapters: the runtime's lr
    assert TTSConfig(prompt_lr=5e-5).prompt_step_lr == 5e-5


def test_prompt_trainable_that_selects_nothing_is_refused_at_start(eagle3_path):
    with pytest.raises(TTSConfigError, match="--tts-prompt-trainable"):
        Distiller(_eagle3(eagle3_path), _config(prompt_trainable=("nothing.",)))


def test_dflash_prompt_update_lowers_its_prompt_loss(dflash_path):
    drafter = _dflash(dflash_path)
    distiller = Distiller(drafter, _config(prompt_steps=20, prompt_lr=1e-2))
    assert distiller.submit_prompt(collate_windows([_window("a", 20, drafter.fc.in_features, 5)], "cpu"))
    distiller.barrier(force=True)
    assert distiller.stats.num_prompt_updates == 1
    assert distiller.stats.last_prompt_loss_after < distiller.stats.last_prompt_loss


@pytest.mark.parametrize("fault", ["nan", "raise", "inf_grad", "nan_weights"])
def test_a_failed_prompt_update_is_rolled_back_and_counted(eagle3_path, fault):
    drafter = _eagle3(eagle3_path)
    before = {n: p.detach().clone() for n, p in drafter.trainable_named_parameters()}
    distiller = Distiller(drafter, _config(), fault_injector=lambda index: fault)
    assert distiller.submit_prompt(collate_windows([_window("a", 12, drafter.fc.in_features, 6)], "cpu"))
    assert not distiller.barrier(force=True)
    assert distiller.stats.num_prompt_updates == 0
    assert distiller.stats.num_skipped_prompt_updates == 1 == distiller.stats.num_skipped_updates
    for n, p in distiller.trained_drafter.trainable_named_parameters():
        assert torch.equal(p, before[n])
    assert not distiller.optimizer.state
    assert all(group["lr"] == distiller.config.lr for group in distiller.optimizer.param_groups)


def test_prompt_updates_follow_the_modes(eagle3_path):
    drafter = _eagle3(eagle3_path)
    batch = collate_windows([_window("a", 8, drafter.fc.in_features, 7)], "cpu")
    off = Distiller(_eagle3(eagle3_path), _config(prompt_adapt="off"))
    assert not off.submit_prompt(batch)
    frozen = Distiller(_eagle3(eagle3_path), _config(freeze=True))
    assert not frozen.submit_prompt(batch)
    only = Distiller(drafter, _config(prompt_adapt="only", update_stride=1))
    assert not only.next_round_submits()  # "only": verify rounds never update
    assert only.submit_prompt(batch)


def test_a_prompt_update_is_published_on_the_update_schedule(eagle3_path):
    """Submitted before round 1's draft with S = 3, it overlaps rounds 1 and 2 and is in the
    weights of round 3, whose observe() submits the first verify update."""
    from sglang_tts.core.executor import ThreadExecutor

    drafter = _eagle3(eagle3_path)
    distiller = Distiller(drafter, _config(update_stride=3), executor=ThreadExecutor())
    try:
        distiller.barrier()  # round 1
        assert distiller.submit_prompt(collate_windows([_window("a", 8, drafter.fc.in_features, 8)], "cpu"))
        distiller.observe(None)
        assert not distiller.barrier()  # round 2: not due, nothing published
        distiller.observe(None)
        assert distiller.update_due()
        assert distiller.barrier()  # round 3: due, published
        assert distiller.stats.num_prompt_updates == 1 and distiller.weight_version == 1
    finally:
        distiller.close()


def test_per_request_adapters_learn_only_their_own_prompt(eagle3_path):
    base = _eagle3(eagle3_path)
    adapted = AdaptedDrafter(base, num_slots=3, rank=4, layers=("fc", "q_proj", "o_proj", "down_proj", "lm_head"))
    distiller = Distiller(adapted, _config(prompt_steps=3, prompt_lr=1e-2))
    bank = distiller.trained_drafter.bank
    before = {n: p.detach().clone() for n, p in distiller.trained_drafter.trainable_named_parameters()}
    width = base.fc.in_features
    batch = collate_windows([_window("a", 10, width, 9), _window("b", 7, width, 10)], "cpu", slots=[2, 0])
    assert distiller.submit_prompt(batch)
    distiller.barrier(force=True)
    changed = {
        bank.slot_of_parameter(n)
        for n, p in distiller.trained_drafter.trainable_named_parameters()
        if not torch.equal(p, before[n])
    }
    assert changed == {0, 2}  # slot 1 belongs to no window: untouched


def test_prompt_loss_weights_rows():
    hidden = torch.randn(3, 4)
    head = torch.randn(5, 4)
    labels = torch.tensor([1, 2, 3])
    from sglang_tts.core.prompt import PromptTerms

    terms = PromptTerms(hidden, labels, torch.tensor([1.0, 0.0, 1.0]), torch.zeros(3, dtype=torch.long))
    ce = torch.nn.functional.cross_entropy(hidden @ head.T, labels, reduction="none")
    assert torch.allclose(prompt_loss(terms, head, None), (ce[0] + ce[2]) / 2)


@pytest.mark.parametrize(
    "overrides, flag",
    [
        ({"prompt_adapt": "sometimes"}, "--tts-prompt-adapt"),
        ({"prompt_positions": 0}, "--tts-prompt-positions"),
        ({"prompt_steps": 0}, "--tts-prompt-steps"),
        ({"prompt_depth": 0}, "--tts-prompt-depth"),
        ({"prompt_lr": 0.0}, "--tts-prompt-lr"),
        ({"prompt_lr": float("nan")}, "--tts-prompt-lr"),
        ({"prompt_positions": 10**6}, "--tts-prompt-positions"),
    ],
)
def test_bad_prompt_settings_are_refused_naming_the_flag(overrides, flag):
    with pytest.raises(TTSConfigError, match=flag):
        TTSConfig(**overrides).validate()
