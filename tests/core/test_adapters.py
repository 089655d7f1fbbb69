"""Per-request adapters (low-rank and dense "full"): isolation, divergence, slot lifecycle, serving/training
agreement."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from core_testing import TinyDrafter, TinyTeacher, random_canvas

from sglang_tts.config import TTSConfig
from sglang_tts.core.adapters import (
    FULL_RANK,
    LM_HEAD,
    NO_SLOT,
    AdaptedDrafter,
    ServingBank,
    SlotTable,
    dense_delta,
)
from sglang_tts.core.distiller import Distiller
from sglang_tts.core.executor import SyncExecutor
from sglang_tts.core.loss import compute_loss, tts_loss
from sglang_tts.core.publish import WeightPublisher

LAYERS = ("inp", "qkv", "attn_out")
WITH_HEAD = (*LAYERS, LM_HEAD)  # the LM head is read by weight, not called: its delta takes another path


@dataclass(frozen=True)
class Spec:
    rank: int | str
    layers: tuple[str, ...] = LAYERS


def _config(**overrides: Any) -> TTSConfig:
    base = {"update_stride": 1, "lr": 3e-2, "reg_lambda": 0.0, "log_interval": 0}
    return TTSConfig(**{**base, **overrides})


@pytest.fixture(
    params=[Spec(4), Spec(FULL_RANK), Spec(4, WITH_HEAD), Spec(FULL_RANK, WITH_HEAD)],
    ids=["rank4", "full", "rank4-head", "full-head"],
)
def spec(request) -> Spec:
    return request.param


def _adapted(spec: Spec, num_slots: int = 4) -> AdaptedDrafter:
    return AdaptedDrafter(TinyDrafter(seed=0), num_slots=num_slots, rank=spec.rank, layers=spec.layers)


def _with_slots(canvas, slots):
    canvas.slots = torch.tensor(slots, dtype=torch.int64)
    return canvas


def _teacher_canvas(teachers, generator, slots):
    """One row per request; row i is labelled by teachers[i]."""
    rows = [t.canvas(generator, batch=1) for t in teachers]
    canvas = rows[0]
    for name in ("input_ids", "positions", "target_logits", "valid", "features"):
        setattr(canvas, name, torch.cat([getattr(r, name) for r in rows]))
    return _with_slots(canvas, slots)


def test_a_fresh_slot_drafts_exactly_like_the_base_drafter(generator, spec):
    drafter = _adapted(spec)
    canvas = random_canvas(generator, batch=3)
    base = drafter.base.canvas_logits(canvas)
    assert torch.equal(drafter.canvas_logits(_with_slots(canvas, [0, NO_SLOT, 2])), base)


def test_one_backward_gives_each_request_only_its_own_gradient(generator, spec):
    """The batched loss's gradient on slot 0 equals the gradient of row 0's loss alone."""
    drafter = _adapted(spec)
    teacher_a, teacher_b = TinyTeacher(seed=11), TinyTeacher(seed=12)
    canvas = _teacher_canvas([teacher_a, teacher_b], generator, [0, 1])
    with torch.no_grad():  # move B off zero so A's gradient is non-trivial too
        for p in drafter.bank.b:
            p.normal_(std=0.1)

    def grads(c):
        drafter.zero_grad(set_to_none=True)
        probs, _ = drafter.teacher_probs(c)
        logp = torch.log_softmax(drafter.canvas_logits(c), -1)
        (-(probs * logp).sum()).backward()
        return {n: (p.grad.clone() if p.grad is not None else None) for n, p in drafter.trainable_named_parameters()}

    both = grads(canvas)
    only_a = grads(_row(canvas, 0))
    slot0 = set(drafter.bank.slot_parameter_names(0))
    slot1 = set(drafter.bank.slot_parameter_names(1))
    # Equal up to float summation order, which a batch of two and a batch of one reduce in different
    # orders (seen on CI: 1.7e-7 absolute with the LM head adapted, 1.6e-7 with the full-rank
    # attention adapters). Row 1's gradient leaking into slot 0 would differ by the size of a
    # gradient entry (their mean |value| is 9e-3 to 1e-2 here), far above this bound.
    tol = {"rtol": 1e-4, "atol": 1e-6}
    for name in slot0:
        torch.testing.assert_close(both[name], only_a[name], **tol)
        assert only_a[name].abs().sum() > 0
    for name in slot1:
        assert only_a[name] is None  # row 0 never touches slot 1
        assert both[name].abs().sum() > 0


def _row(canvas, i):
    out = canvas.detach_clone()
    for name in ("input_ids", "positions", "target_logits", "valid", "features", "slots"):
        setattr(out, name, getattr(out, name)[i : i + 1])
    return out


def test_updates_for_one_request_do_not_change_anothers_drafts_and_adapters_diverge(generator, spec):
    drafter = _adapted(spec)
    distiller = Distiller(drafter, _config(), executor=SyncExecutor())
    serving = distiller.serving_drafter
    teacher_a, teacher_b = TinyTeacher(seed=11), TinyTeacher(seed=12)
    probe_b = _with_slots(random_canvas(generator, batch=1), [1])
    before_b = serving.canvas_logits(probe_b)
    for _ in range(5):  # only request A (slot 0) is running and updating
        distiller.barrier()
        distiller.observe(_teacher_canvas([teacher_a], generator, [0]))
    distiller.barrier(force=True)
    assert distiller.stats.num_updates == 5
    assert torch.equal(serving.canvas_logits(probe_b), before_b), "A's updates changed B's drafts"
    probe_a = _with_slots(random_canvas(generator, batch=1), [0])
    assert not torch.equal(serving.canvas_logits(probe_a), drafter.base.canvas_logits(probe_a))

    # Now both run in one batch, each on its own sequence (a few fixed canvases per request, as a
    # request revisits its own context): one backward per update covers both.
    canvases = [_teacher_canvas([teacher_a, teacher_b], generator, [0, 1]) for _ in range(3)]
    for step in range(30):
        distiller.barrier()
        distiller.observe(canvases[step % 3])
    distiller.barrier(force=True)

    def agreement(slot: int, row: int) -> float:
        hits = []
        for c in canvases:
            c = _row(c, row)
            c.slots = torch.tensor([slot])
            hits.append((serving.canvas_logits(c).argmax(-1) == c.target_logits.argmax(-1)).float().mean())
        return float(torch.stack(hits).mean())

    # Each adapter fits its own request better than the other request's adapter or the base does.
    assert agreement(0, 0) > agreement(1, 0) + 0.2
    assert agreement(1, 1) > agreement(0, 1) + 0.2
    assert agreement(0, 0) > agreement(NO_SLOT, 0) + 0.2


def test_a_request_not_due_an_update_keeps_its_weights_despite_adam_momentum(generator, spec):
    drafter = _adapted(spec)
    distiller = Distiller(drafter, _config(), executor=SyncExecutor())
    teacher = TinyTeacher(seed=11)
    distiller.observe(_teacher_canvas([teacher, teacher], generator, [0, 1]))
    distiller.barrier(force=True)
    slot1 = {n: p.detach().clone() for n, p in distiller.trained_drafter.trainable_named_parameters()}
    distiller.observe(_teacher_canvas([teacher], generator, [0]))
    distiller.barrier(force=True)
    after = dict(distiller.trained_drafter.trainable_named_parameters())
    for name in distiller.trained_drafter.bank.slot_parameter_names(1):
        assert torch.equal(after[name], slot1[name])
    assert any(not torch.equal(after[n], slot1[n]) for n in distiller.trained_drafter.bank.slot_parameter_names(0))


def test_releasing_a_slot_restores_it_bitwise_and_drops_its_optimiser_state(generator, spec):
    drafter = _adapted(spec, num_slots=2)
    distiller = Distiller(drafter, _config(), executor=SyncExecutor())
    initial = {n: p.detach().clone() for n, p in distiller.trained_drafter.trainable_named_parameters()}
    teacher = TinyTeacher(seed=11)
    for _ in range(3):
        distiller.observe(_teacher_canvas([teacher, teacher], generator, [0, 1]))
        distiller.barrier()
    assert len(distiller.optimizer.state) > 0
    for slot in (0, 1):
        distiller.reset_parameters(distiller.trained_drafter.bank.slot_parameter_names(slot))
    distiller.barrier()
    assert len(distiller.optimizer.state) == 0  # nothing of the requests is left
    for name, p in distiller.trained_drafter.trainable_named_parameters():
        assert torch.equal(p, initial[name])
    probe = _with_slots(random_canvas(generator, batch=2), [0, 1])
    assert torch.equal(distiller.serving_drafter.canvas_logits(probe), drafter.base.canvas_logits(probe))


def test_a_guard_reset_backs_off_only_that_slots_rate_until_the_slot_is_freed(generator):
    drafter = _adapted(Spec(4), num_slots=2)
    distiller = Distiller(drafter, _config(guard_backoff=0.1), executor=SyncExecutor())
    teacher = TinyTeacher(seed=11)
    distiller.observe(_teacher_canvas([teacher, teacher], generator, [0, 1]))
    distiller.barrier()

    def rates() -> dict[int, float]:
        names = distiller.train_names
        return {
            slot: distiller.optimizer.param_groups[distiller._group_of[names.index(n)]]["lr"]
            for slot in (0, 1)
            for n in drafter.slot_parameter_names(slot)
        }

    assert len(distiller.optimizer.param_groups) == 2 and rates() == {0: 3e-2, 1: 3e-2}
    for strikes in (1, 2):
        distiller._guard_resets = {1}
        distiller.barrier()
        assert distiller.last_guard_resets == [1]
        assert rates() == pytest.approx({0: 3e-2, 1: 3e-2 * 0.1**strikes})
    # The request left: its slot is freed (as the runtime does) and the next request trains at the full rate.
    distiller.reset_parameters(drafter.slot_parameter_names(1), unit=1)
    assert rates() == {0: 3e-2, 1: 3e-2}


def test_slot_table_caps_counts_and_reuses_slots():
    table = SlotTable(2)
    assert table.acquire("a") == 0 and table.acquire("b") == 1
    assert table.acquire("c") is None and table.acquire("c") is None
    assert table.num_capped == 1
    assert table.slots(["b", "c", "a"]).tolist() == [1, NO_SLOT, 0]
    assert table.release("a") == 0 and table.release("c") is None
    assert table.acquire("d") == 0
    assert sorted(table.live()) == ["b", "d"]
    with pytest.raises(ValueError):
        SlotTable(0)


def test_slot_table_forgets_every_request_that_left_capped_ones_included():
    table = SlotTable(2)
    freed = []
    for i in range(1000):  # three requests running, two slots: one is always capped
        batch = [f"r{i}", f"r{i + 1}", f"r{i + 2}"]
        freed += table.retain(batch)
        for rid in batch:
            table.acquire(rid)
        assert len(table.slot_of) == 2 and len(table._capped) <= 1
    assert table.num_capped > 300 and sorted(set(freed)) == [0, 1]


def test_a_group_shares_one_slot_freed_when_its_last_request_leaves():
    table = SlotTable(1)
    assert table.acquire("a1", "g") == 0
    assert table.acquire("a2", "g") == 0  # joins the group's slot: no free slot needed
    assert table.acquire("b", "h") is None and table.num_capped == 1  # another group: capped
    assert table.num_groups() == 1 and sorted(table.holders(0)) == ["a1", "a2"]
    assert table.release("a1") is None  # a2 still adapts the slot: it is not reset
    assert table.acquire("a3", "g") == 0  # a late sibling joins the adapted slot
    assert table.retain(["b"]) == [0]  # the group's last request left: the slot is free again
    assert table.num_groups() == 0 and table.acquire("c", "h") == 0
    assert table.known("c") and table.known("b") and not table.known("a2")
    # join (at a prefill): the group's slot if it holds one, else nothing taken and nothing capped
    assert table.join("c2", "h") == 0 and table.holders(0) == ["c", "c2"]
    capped = table.num_capped
    assert table.join("d", "new-group") is None and not table.known("d") and table.num_capped == capped


def test_group_state_stays_bounded_by_the_running_requests():
    table = SlotTable(2)
    for i in range(1000):  # rolling siblings of ever new prompts, three groups live, two slots
        batch = [f"p{j}-{k}" for j in range(i, i + 3) for k in range(2)]
        table.retain(batch)
        for rid in batch:
            table.acquire(rid, rid.split("-")[0])
        assert len(table.slot_of) <= 4 and table.num_groups() <= 2
        assert len(table._group_of) == len(table.slot_of) and sum(table._members.values()) == len(table.slot_of)
    table.retain([])
    assert not (table.slot_of or table._group_of or table._group_slot or table._members or table._capped)
    assert sorted(table._free) == [0, 1]


def test_the_serving_bank_applies_exactly_what_the_training_copy_learnt(generator, spec):
    """Per-token gathered deltas on the published stacks == the training path's per-row deltas."""
    drafter = _adapted(spec, num_slots=3)
    with torch.no_grad():
        for p in (*drafter.bank.a, *drafter.bank.b):
            p.normal_()
    serving = ServingBank(drafter.bank)
    WeightPublisher.from_name_map(
        serving.destinations(drafter.bank), dict(drafter.trainable_named_parameters())
    ).publish(dict(drafter.trainable_named_parameters()))
    x = torch.randn(4, 5, drafter.bank.layers[1].in_features, generator=generator)
    row_slots = torch.tensor([2, NO_SLOT, 0, 1])
    expected = drafter.bank.row_delta(1, x, row_slots)
    tokens = x.reshape(-1, x.shape[-1])
    token_rows = ServingBank.stack_rows(row_slots.repeat_interleave(5))
    got = serving.delta("qkv", tokens, token_rows).reshape(4, 5, -1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[1], torch.zeros_like(got[1]))  # "no adapter" row
    assert serving.nbytes() == sum(4 * (t.numel()) for t in (*serving.a, *serving.b))


def test_dense_delta_matches_the_per_row_formula_and_full_slots_cost_out_times_in(generator):
    d = torch.randn(3, 5, 6, generator=generator)
    x = torch.randn(7, 6, generator=generator)
    slots = torch.tensor([0, 2, 1, 1, 0, 2, 2])
    expected = torch.stack([d[s] @ x[n] for n, s in enumerate(slots.tolist())])
    torch.testing.assert_close(dense_delta(x, d, slots), expected)
    full, low = _adapted(Spec(FULL_RANK)).bank, _adapted(Spec(4)).bank
    assert full.slot_nbytes() == 4 * sum(x.out_features * x.in_features for x in full.layers)
    assert low.slot_nbytes() == 4 * sum(4 * (x.out_features + x.in_features) for x in low.layers)
    with pytest.raises(ValueError, match="full"):
        _adapted(Spec("half"))


def test_an_adapted_lm_head_takes_the_unfused_loss_and_trains_its_own_delta(generator):
    """The head is read by weight (the fused loss's shared W), so a per-row head delta needs the
    logits path: at zero deltas both give the same loss; after updates the head delta has moved
    and a fresh slot still drafts like the base drafter."""
    drafter = _adapted(Spec(4, WITH_HEAD))
    assert drafter.lm_head_per_row and not _adapted(Spec(4)).lm_head_per_row
    canvas = _teacher_canvas([TinyTeacher(seed=11)], generator, [0])
    probs, mask = drafter.teacher_probs(canvas)
    weights = torch.ones(canvas.length)
    hidden, head = drafter.canvas_hidden(canvas), drafter.lm_head_weight()
    fused = compute_loss(hidden, head, probs, weights, mask, backend="chunked")
    unfused = tts_loss(drafter.canvas_logits(canvas), probs, weights, mask)
    torch.testing.assert_close(fused.loss, unfused.loss, rtol=1e-5, atol=1e-6)

    distiller = Distiller(drafter, _config(), executor=SyncExecutor())
    slot0 = drafter.bank.slot_parameter_names(0)
    head_b = [n for n in slot0 if ".b." in n and drafter.bank.layer_of_parameter(n) == drafter.head_layer]
    for _ in range(3):
        distiller.barrier()
        distiller.observe(canvas)
    distiller.barrier(force=True)
    assert distiller.stats.num_updates == 3
    trained = dict(drafter.trainable_named_parameters())
    assert head_b and all(trained[n].abs().sum() > 0 for n in head_b)  # B starts at zero
    probe = _with_slots(random_canvas(generator, batch=1), [1])
    assert torch.equal(distiller.serving_drafter.canvas_logits(probe), drafter.base.canvas_logits(probe))


@pytest.mark.parametrize("fault", ["nan", "raise", "inf_grad", "nan_weights"])
def test_faulty_adapter_updates_roll_every_slot_back(generator, spec, fault):
    """--tts-scope request: a failed update leaves every adapter and its optimiser state as before."""
    drafter = _adapted(spec)
    faults = {1: fault}
    distiller = Distiller(drafter, _config(), executor=SyncExecutor(), fault_injector=faults.get)
    teacher = TinyTeacher(seed=11)
    distiller.observe(_teacher_canvas([teacher, teacher], generator, [0, 1]))
    assert distiller.barrier()
    trained = {n: p.detach().clone() for n, p in distiller.trained_drafter.trainable_named_parameters()}
    serving = {n: p.detach().clone() for n, p in drafter.trainable_named_parameters()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in distiller.optimizer.state.items()}
    distiller.observe(_teacher_canvas([teacher, teacher], generator, [0, 1]))
    assert not distiller.barrier() and distiller.stats.num_skipped_updates == 1
    for name, p in distiller.trained_drafter.trainable_named_parameters():
        assert torch.equal(p, trained[name]), name
    for name, p in drafter.trainable_named_parameters():
        assert torch.equal(p, serving[name]), name
    assert {id(p) for p in distiller.optimizer.state} == set(state)
    for p, s in distiller.optimizer.state.items():
        assert all(torch.equal(v, state[id(p)][k]) for k, v in s.items())
