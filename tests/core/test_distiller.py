"""The Distiller: learning, stride schedule, barrier consistency, reset, rollback, freeze."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from core_testing import TinyDrafter, TinyTeacher, agreement, random_canvas

from sglang_tts.config import DEFAULT_UPDATE_WINDOW, DEFAULT_WINDOW_ROWS, TTSConfig, TTSConfigError
from sglang_tts.core.canvas import Canvas
from sglang_tts.core.distiller import Distiller
from sglang_tts.core.executor import (
    SyncExecutor,
    ThreadExecutor,
    UpdateExecutor,
    UpdateResult,
    UpdateTiming,
)
from sglang_tts.core.loss import tts_loss
from sglang_tts.core.publish import WeightPublisher


def _config(**overrides: Any) -> TTSConfig:
    base = {"update_stride": 1, "lr": 1e-3, "reg_lambda": 0.0, "log_interval": 0}
    return TTSConfig(**{**base, **overrides})


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.trainable_named_parameters()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@torch.no_grad()
def _canvas_loss(drafter: TinyDrafter, canvas: Canvas) -> float:
    teacher, mask = drafter.teacher_probs(canvas)
    return tts_loss(
        drafter.canvas_logits(canvas), teacher, drafter.default_position_weights(canvas.length), mask
    ).loss.item()


class DeferredExecutor(UpdateExecutor):
    """Runs a submitted update only when wait() is called: the latest possible moment, so any
    reuse of the caller's canvas buffers after observe() would be seen by the update."""

    def __init__(self) -> None:
        super().__init__()
        self._fn: Callable[[], Any] | None = None

    @property
    def pending(self) -> bool:
        return self._fn is not None

    def submit(self, fn: Callable[[], Any]) -> None:
        if self._fn is not None:
            self.wait()
        self._fn = fn

    def wait(self) -> UpdateResult | None:
        fn, self._fn = self._fn, None
        if fn is None:
            return None
        start = time.perf_counter()
        result = UpdateResult(value=fn(), timing=UpdateTiming(start, start, time.perf_counter()))
        return self._finish(result)


def test_one_step_lowers_the_loss_on_the_same_canvas(generator):
    drafter = TinyDrafter()
    with torch.inference_mode():  # the engine's forward runs in inference mode
        canvas = TinyTeacher().canvas(generator, batch=2)
    before = _canvas_loss(drafter, canvas)
    distiller = Distiller(drafter, _config())
    assert distiller.observe(canvas)
    with torch.inference_mode():
        assert distiller.barrier()
    assert distiller.stats.num_updates == 1 and distiller.weight_version == 1
    assert distiller.stats.last_loss == pytest.approx(before, rel=1e-5)
    assert _canvas_loss(drafter, canvas) < before - 1e-4  # the serving drafter got the new weights


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_adam_is_fused_on_cpu_and_steps_like_the_per_tensor_loop(generator, optimizer):
    """The fused Adam (one kernel for all tensors; 6x faster on CPU for a 10M-weight drafter) takes
    the same step as torch's default per-tensor loop, to rounding."""
    with torch.inference_mode():
        canvas = TinyTeacher().canvas(generator, batch=2)
    results = []
    for fused in (True, None):
        drafter = TinyDrafter(seed=0)
        distiller = Distiller(drafter, _config(lr=1e-2, optimizer=optimizer))
        assert distiller.optimizer.defaults["fused"] is True
        if fused is None:  # the reference: the same optimizer with torch's per-tensor loop
            cfg = distiller.config
            distiller.optimizer = type(distiller.optimizer)(
                distiller.train_params, lr=cfg.lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay
            )
        for _ in range(3):
            assert distiller.observe(canvas)
            with torch.inference_mode():
                distiller.barrier()
        results.append(dict(drafter.named_parameters()))
    # The key bias gets no gradient (softmax ignores a shift common to all scores): only rounding noise, which
    # Adam's normalisation turns into steps of up to lr whose sign depends on the summation order of each
    # machine's kernels. It is excluded; every other weight must agree to rounding.
    hidden = results[0]["qkv.bias"].numel() // 3
    results[0]["qkv.bias"], results[1]["qkv.bias"] = (
        r["qkv.bias"][[*range(hidden), *range(2 * hidden, 3 * hidden)]] for r in results
    )
    for name, fused_p in results[0].items():
        torch.testing.assert_close(fused_p, results[1][name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_updates_raise_agreement_with_a_fixed_teacher(generator):
    teacher = TinyTeacher()
    held_out = [teacher.canvas(generator, batch=8) for _ in range(4)]
    drafter = TinyDrafter(seed=0)
    before = agreement(drafter, held_out)
    distiller = Distiller(drafter, _config(lr=1e-2), executor=ThreadExecutor())
    for round_index in range(120):
        distiller.barrier()
        distiller.observe(teacher.canvas(generator, batch=4, round_index=round_index))
    distiller.barrier(force=True)
    distiller.close()
    after = agreement(drafter, held_out)
    assert distiller.stats.num_updates == 120 and distiller.stats.num_skipped_updates == 0
    assert after > before + 0.2, (before, after)


class RecordingDrafter(TinyDrafter):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int]] = []

    def canvas_hidden(self, canvas: Canvas) -> torch.Tensor:
        self.seen.append((canvas.round_index, int(canvas.positions[0, 0])))
        return super().canvas_hidden(canvas)


def test_stride_updates_on_the_latest_canvas_only(generator):
    drafter = RecordingDrafter()
    distiller = Distiller(drafter, _config(update_stride=5), publisher=WeightPublisher([]), executor=DeferredExecutor())
    submitted_at = []
    for round_number in range(1, 51):
        distiller.barrier()
        canvas = random_canvas(generator, round_index=round_number)
        canvas.positions[0, 0] = round_number  # a stamp of this round's canvas content
        if distiller.observe(canvas):
            submitted_at.append(round_number)
        canvas.positions.fill_(-1)  # the engine reuses its buffers right after observe()
        canvas.input_ids.fill_(-1)
    distiller.barrier(force=True)
    assert submitted_at == list(range(5, 51, 5))
    assert distiller.stats.num_updates == 10 and distiller.stats.rounds == 50
    assert drafter.seen == [(r, r) for r in range(5, 51, 5)]
    assert distiller.stats.last_update_round == 50


def test_changing_the_stride_restarts_the_windows(generator):
    """An adaptive-stride controller changes S between rounds: the pending update is collected
    first, and the next update comes S rounds after the change."""
    distiller = Distiller(
        RecordingDrafter(), _config(update_stride=2), publisher=WeightPublisher([]), executor=DeferredExecutor()
    )
    submitted_at = []
    for round_number in range(1, 21):
        if round_number == 7:
            assert distiller.executor.pending  # submitted at round 6, not collected yet
            distiller.set_update_stride(5)
            assert not distiller.executor.pending and distiller.stats.num_updates == 3
        distiller.barrier()
        if distiller.observe(random_canvas(generator, round_index=round_number)):
            submitted_at.append(round_number)
    assert submitted_at == [2, 4, 6, 11, 16]
    with pytest.raises(ValueError, match="stride"):
        distiller.set_update_stride(0)


def test_engine_builds_canvases_only_for_update_rounds(generator):
    """next_round_submits() names the stride rounds; the other rounds pass None and still count."""
    drafter = RecordingDrafter()
    distiller = Distiller(drafter, _config(update_stride=3), publisher=WeightPublisher([]), executor=DeferredExecutor())
    built = []
    for round_number in range(1, 13):
        distiller.barrier()
        canvas = None
        if distiller.next_round_submits():
            built.append(round_number)
            canvas = random_canvas(generator, round_index=round_number)
            canvas.positions[0, 0] = round_number
        assert distiller.observe(canvas) == (canvas is not None)
    distiller.barrier(force=True)
    assert built == [3, 6, 9, 12]
    assert distiller.stats.rounds == 12 and distiller.stats.num_updates == 4
    assert drafter.seen == [(r, r) for r in (3, 6, 9, 12)]


@pytest.mark.parametrize(
    ("executor_class", "expected"),
    [
        # Async: the updates submitted after rounds 4 and 8 overlap rounds 5-7 and 9-11 and land
        # before rounds 8 and 12 (paper C.1: barrier after S-1 rounds).
        (ThreadExecutor, [8, 12]),
        # Inline: the update ran on the serving path, so the very next round drafts with it.
        (SyncExecutor, [5, 9]),
    ],
)
def test_when_updates_reach_the_serving_weights(generator, executor_class, expected):
    distiller = Distiller(TinyDrafter(), _config(update_stride=4), executor=executor_class())
    published_before_round = []
    for round_number in range(1, 13):
        if distiller.barrier():
            published_before_round.append(round_number)
        distiller.observe(random_canvas(generator, round_index=round_number))
    assert published_before_round == expected
    assert distiller.barrier(force=True)  # the update submitted after round 12
    distiller.close()


def _slow_stamping_step(distiller: Distiller, per_param_sleep_s: float) -> list[int]:
    """Replace the optimizer step by one that writes a stamp into every trained parameter, one
    parameter at a time with a sleep in between: a torn read would see mixed stamps."""
    stamps = [0]

    @torch.no_grad()
    def step(closure=None):
        stamps[0] += 1
        for p in distiller.train_params:
            p.fill_(float(stamps[0]))
            time.sleep(per_param_sleep_s)

    distiller.optimizer.step = step
    return stamps


@pytest.mark.parametrize("with_publisher", [False, True])
def test_barrier_gives_drafts_all_old_or_all_new_weights(generator, with_publisher):
    drafter = TinyDrafter()
    if with_publisher:
        serving = {n: torch.zeros_like(p) for n, p in drafter.trainable_named_parameters()}
        publisher = WeightPublisher.from_name_map(serving, dict(drafter.trainable_named_parameters()))
        # No guard: stamped weights draft far worse than base, and the guard would reset them.
        distiller = Distiller(drafter, _config(update_stride=3, guard=False), ThreadExecutor(), publisher)
        serving_tensors = list(serving.values())
    else:
        distiller = Distiller(drafter, _config(update_stride=3, guard=False), ThreadExecutor())
        serving_tensors = [p for _, p in drafter.trainable_named_parameters()]
    pointers = [t.data_ptr() for t in serving_tensors]
    _slow_stamping_step(distiller, per_param_sleep_s=0.002)

    def read_stamps() -> set[float]:
        return {float(v) for t in serving_tensors for v in t.detach().flatten().tolist()}

    drafts_with_update_in_flight = 0
    for round_number in range(1, 31):
        distiller.barrier()
        first_read = read_stamps()
        if distiller.weight_version > 0:
            assert first_read == {float(distiller.weight_version)}  # one version, every element
        drafts_with_update_in_flight += distiller.executor.pending
        time.sleep(0.004)  # "draft and verify" while the update may be running
        assert read_stamps() == first_read  # serving weights only change inside barrier()
        distiller.observe(random_canvas(generator, round_index=round_number))
        assert read_stamps() == first_read
    distiller.barrier(force=True)
    distiller.close()
    assert distiller.stats.num_updates == 10 and distiller.weight_version == 10
    assert read_stamps() == {10.0}
    # Each update was in flight during the 2 drafts after its submission, and part of its run
    # time was really hidden behind them.
    assert drafts_with_update_in_flight == 18
    assert distiller.stats.hidden_ms_total > 0
    assert [t.data_ptr() for t in serving_tensors] == pointers


def test_reset_restores_base_weights_and_clears_optimizer_state(generator):
    drafter = TinyDrafter()
    base = _params(drafter)
    teacher = TinyTeacher()
    distiller = Distiller(drafter, _config(lr=1e-2))
    for round_index in range(3):
        distiller.barrier()
        distiller.observe(teacher.canvas(generator, round_index=round_index))
    distiller.barrier()
    assert not _equal(_params(drafter), base) and len(distiller.optimizer.state) > 0
    version = distiller.weight_version

    distiller.reset()
    assert _equal(_params(drafter), base)  # serving copy, bitwise
    assert _equal(_params(distiller.trained_drafter), base)
    assert len(distiller.optimizer.state) == 0
    assert distiller.weight_version == version + 1
    stats = distiller.stats
    assert (stats.num_resets, stats.scope_rounds, stats.scope_updates) == (1, 0, 0)
    assert (stats.rounds, stats.num_updates) == (3, 3)  # global totals survive

    distiller.observe(teacher.canvas(generator))
    distiller.barrier()
    first_state = next(iter(distiller.optimizer.state.values()))
    assert int(first_state["step"]) == 1  # Adam starts afresh
    assert not _equal(_params(drafter), base)


def test_faulty_updates_are_skipped_rolled_back_and_counted(generator, caplog):
    faults = {1: "nan", 3: "raise", 5: "inf_grad", 6: "nan_weights"}
    drafter = TinyDrafter()
    distiller = Distiller(
        drafter, _config(lr=1e-2, steps_per_update=2, reg_lambda=0.1), fault_injector=lambda i: faults.get(i)
    )
    teacher = TinyTeacher()
    for update_index in range(8):
        trained_before = _params(distiller.trained_drafter)
        serving_before = _params(drafter)
        state_before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in distiller.optimizer.state.items()}
        version = distiller.weight_version
        distiller.observe(teacher.canvas(generator))
        published = distiller.barrier()
        if update_index in faults:
            assert not published and distiller.weight_version == version
            assert _equal(_params(distiller.trained_drafter), trained_before)
            assert _equal(_params(drafter), serving_before)
            state_after = {id(p): s for p, s in distiller.optimizer.state.items()}
            assert state_after.keys() == state_before.keys()
            for key, saved in state_before.items():
                assert all(torch.equal(saved[k], state_after[key][k]) for k in saved)
        else:
            assert published and not _equal(_params(drafter), serving_before)
    assert distiller.stats.num_updates == 4 and distiller.stats.num_skipped_updates == 4
    skipped = [r.message for r in caplog.records if "skipped and rolled back" in r.message]
    assert len(skipped) == 4
    assert "non-finite gradient at step 0" in skipped[2]  # an Inf gradient with a finite loss
    assert "non-finite weights after the step" in skipped[3]
    assert all(torch.isfinite(p).all() for _, p in drafter.trainable_named_parameters())


def test_freeze_counts_rounds_and_never_updates(generator):
    drafter = TinyDrafter()
    base = _params(drafter)
    distiller = Distiller(drafter, _config(freeze=True), executor=SyncExecutor())
    submitted = [distiller.observe(random_canvas(generator)) for _ in range(20)]
    published = [distiller.barrier() for _ in range(3)]
    assert not any(submitted) and not any(published)
    assert distiller.stats.rounds == 20 and distiller.stats.num_updates == 0
    assert distiller.executor.totals.num_completed == 0
    assert _equal(_params(drafter), base) and distiller.weight_version == 0


def test_trainable_prefixes_select_what_moves(generator):
    drafter = TinyDrafter()
    base = _params(drafter)
    distiller = Distiller(drafter, _config(lr=1e-2, trainable=("mlp.",)))
    distiller.observe(TinyTeacher().canvas(generator))
    distiller.barrier()
    after = _params(drafter)
    changed = {n for n in base if not torch.equal(base[n], after[n])}
    assert changed and all(n.startswith("mlp.") for n in changed)
    # The frozen LM head is shared with the training copy, not duplicated.
    assert distiller.trained_drafter.lm_head.weight is drafter.lm_head.weight
    with pytest.raises(TTSConfigError, match="selects none"):
        Distiller(TinyDrafter(), _config(trainable=("nope.",)))


def test_a_trainable_subset_is_published_into_the_serving_copy(generator):
    """--tts-trainable with an engine's copy (a publisher over every trainable weight, as SGLang's binding
    builds it): the trained subset reaches the serving tensors, nothing else is written, no publish fails.
    (Publishing read the untrained weights through trainable_named_parameters(), which stops listing them
    once the Distiller turns their gradients off: every publish failed, and served drafts never changed.)"""
    drafter = TinyDrafter()
    serving = {n: p.detach().clone() for n, p in drafter.trainable_named_parameters()}
    publisher = WeightPublisher.from_name_map(serving, dict(drafter.trainable_named_parameters()))
    before = {n: t.clone() for n, t in serving.items()}
    distiller = Distiller(drafter, _config(lr=1e-2, trainable=("mlp.",), guard=False), publisher=publisher)
    for _ in range(3):
        distiller.observe(TinyTeacher().canvas(generator))
        distiller.barrier()
    changed = {n for n in serving if not torch.equal(serving[n], before[n])}
    assert changed and all(n.startswith("mlp.") for n in changed)
    assert distiller.stats.num_failed_publishes == 0 and distiller.weight_version == 3
    assert all(b.name.startswith("mlp.") for b in distiller.publisher.bindings)  # only what can change is written
    for name, p in drafter.trainable_named_parameters():
        assert torch.equal(serving[name], p.detach())


def test_canvas_without_valid_positions_is_not_an_update(generator):
    drafter = TinyDrafter()
    base = _params(drafter)
    distiller = Distiller(drafter, _config())
    canvas = random_canvas(generator)
    canvas.valid[:] = False
    distiller.observe(canvas)
    assert not distiller.barrier()
    assert distiller.stats.num_empty_updates == 1 and distiller.stats.num_updates == 0
    assert _equal(_params(drafter), base)
    assert set(distiller.stats.snapshot()) >= {"rounds", "num_updates", "wait_ms_total", "weight_version"}


def test_a_failing_rollback_goes_back_to_the_published_weights(generator, caplog):
    drafter = TinyDrafter()
    config = _config(lr=1e-2, steps_per_update=2)  # two steps: the update takes a rollback copy
    distiller = Distiller(drafter, config, fault_injector=lambda i: "raise" if i == 1 else None)
    teacher = TinyTeacher()
    distiller.observe(teacher.canvas(generator))
    assert distiller.barrier()
    published = _params(drafter)

    def broken_restore(optimizer):
        raise RuntimeError("restore failed")

    distiller._rollback.restore = broken_restore
    distiller.observe(teacher.canvas(generator))  # steps, raises, and its rollback fails too
    assert not distiller.barrier()
    assert _equal(_params(drafter), published)
    assert _equal(_params(distiller.trained_drafter), published)  # not the half-stepped weights
    assert len(distiller.optimizer.state) == 0 and distiller.stats.num_skipped_updates == 1
    assert any("failed outside its rollback" in r.message for r in caplog.records)
    distiller.observe(teacher.canvas(generator))  # and training goes on from there
    assert distiller.barrier() and distiller.stats.num_updates == 2


@pytest.mark.parametrize("fault", ["nan", "inf_grad", "raise", "nan_weights"])
def test_one_step_updates_take_no_rollback_copy_and_still_fail_safely(generator, fault):
    """One step of a shared drafter from the published weights copies nothing before it runs: a
    failure before the step changes nothing (loss and gradients are checked first), one after it
    goes back to the published weights (those before the update) with a fresh optimizer state."""
    drafter = TinyDrafter()
    distiller = Distiller(drafter, _config(lr=1e-2), fault_injector=lambda i: fault if i == 1 else None)
    saves = []
    save = distiller._rollback.save
    distiller._rollback.save = lambda optimizer: (saves.append(1), save(optimizer))
    teacher = TinyTeacher()
    distiller.observe(teacher.canvas(generator))
    assert distiller.barrier()
    published = _params(drafter)
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in distiller.optimizer.state.items()}
    distiller.observe(teacher.canvas(generator))
    assert not distiller.barrier() and distiller.stats.num_skipped_updates == 1
    assert saves == []
    assert _equal(_params(distiller.trained_drafter), published) and _equal(_params(drafter), published)
    if fault in ("nan", "inf_grad"):  # before the step: the optimizer state is untouched
        assert {id(p) for p in distiller.optimizer.state} == set(state)
        for p, s in distiller.optimizer.state.items():
            assert all(torch.equal(v, state[id(p)][k]) for k, v in s.items())
    else:
        assert len(distiller.optimizer.state) == 0
    assert all(p.grad is None for p in distiller.train_params)
    distiller.observe(teacher.canvas(generator))  # and training goes on from there
    assert distiller.barrier() and distiller.stats.num_updates == 2


def test_a_failed_publish_leaves_all_old_weights_and_the_next_barrier_publishes(generator, caplog):
    drafter = TinyDrafter()
    serving = {n: torch.zeros_like(p) for n, p in drafter.trainable_named_parameters()}
    publisher = WeightPublisher.from_name_map(serving, dict(drafter.trainable_named_parameters()))
    distiller = Distiller(drafter, _config(lr=1e-2), SyncExecutor(), publisher)
    for dst, (_, src) in zip(serving.values(), drafter.trainable_named_parameters()):
        dst.copy_(src.detach())  # the serving copy starts at the drafter's weights
    old = {n: t.clone() for n, t in serving.items()}
    faulty = publisher.bindings[len(publisher.bindings) // 2]
    write = faulty.write
    calls = [0]

    def failing_once(trained):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("injected publish fault")
        write(trained)

    faulty.write = failing_once
    distiller.observe(TinyTeacher().canvas(generator))
    assert not distiller.barrier()  # the first half of the bindings was written, then it failed
    assert _equal(serving, old)  # ... and was written back: all old
    assert distiller.stats.num_failed_publishes == 1 and distiller.weight_version == 0
    assert any("publish failed" in r.message for r in caplog.records)
    assert distiller.barrier()  # the next barrier publishes again: all new
    assert _equal(serving, _params(distiller.trained_drafter)) and not _equal(serving, old)
    assert distiller.weight_version == 1


def test_a_barrier_never_publishes_while_an_update_is_running(generator):
    drafter = TinyDrafter()
    distiller = Distiller(drafter, _config(lr=1e-2, update_stride=3), ThreadExecutor())
    release = threading.Event()
    steps = [0]

    @torch.no_grad()
    def half_step_then_block(closure=None):
        steps[0] += 1
        distiller.train_params[0].fill_(float(steps[0]))
        if steps[0] == 2:
            release.wait(10)
        for p in distiller.train_params[1:]:
            p.fill_(float(steps[0]))

    distiller.optimizer.step = half_step_then_block
    serving = [p for _, p in drafter.trainable_named_parameters()]
    for round_number in range(1, 7):  # updates submitted after rounds 3 and 6; every barrier skipped
        distiller.observe(random_canvas(generator, round_index=round_number))
    # observe() collected update 1 before submitting update 2, which gets half-way through its step.
    deadline = time.monotonic() + 10
    while steps[0] < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert distiller.executor.pending and steps[0] == 2
    before = [t.clone() for t in serving]
    assert not distiller.update_due() and not distiller.barrier()  # round 7's barrier publishes nothing
    assert all(torch.equal(a, b) for a, b in zip(serving, before))
    release.set()
    assert distiller.barrier(force=True)
    assert {float(v) for t in serving for v in t.flatten().tolist()} == {2.0}  # all new
    distiller.close()


class BatchRecorder(TinyDrafter):
    """Records the (round stamp, request) of every row an update trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[tuple[int, str]]] = []

    def canvas_hidden(self, canvas: Canvas) -> torch.Tensor:
        if torch.is_grad_enabled():  # the update's forward (the guard's scoring runs without grad)
            stamps = canvas.positions[:, 0].tolist()
            self.batches.append(list(zip(stamps, canvas.request_ids)))
        return super().canvas_hidden(canvas)


def test_an_update_window_trains_on_the_last_rounds_of_its_stride_in_one_step(generator):
    """--tts-update-window 3 at S = 4: the engine builds canvases for rounds 2-4 of each stride
    (next_round_keeps: 2, 3; next_round_submits: 4) and the update takes all three in one batch,
    after the engine reused its buffers; a request that left before the update is dropped."""
    drafter = BatchRecorder()
    distiller = Distiller(
        drafter, _config(update_stride=4, update_window=3), publisher=WeightPublisher([]), executor=DeferredExecutor()
    )
    built = []
    for round_number in range(1, 13):
        distiller.barrier()
        canvas = None
        if distiller.next_round_submits() or distiller.next_round_keeps():
            built.append(round_number)
            rids = ["a", "b"] if round_number != 7 else ["a", "b", "c"]  # c drafts one round, then finishes
            canvas = random_canvas(generator, batch=len(rids), round_index=round_number)
            canvas.positions[:, 0] = round_number
            canvas.request_ids = rids
        assert distiller.observe(canvas) == (round_number % 4 == 0)
        if canvas is not None:
            canvas.positions.fill_(-1)  # the engine reuses its buffers right after observe()
    distiller.barrier(force=True)
    assert built == [2, 3, 4, 6, 7, 8, 10, 11, 12]
    assert drafter.batches == [
        [(r, rid) for r in stride for rid in ("a", "b")] for stride in ([2, 3, 4], [6, 7, 8], [10, 11, 12])
    ]
    assert distiller.stats.num_updates == 3 and distiller.stats.update_rows_total == 18
    # A stride change or a reset drops what was kept (the next update is S rounds away).
    distiller.observe(random_canvas(generator))  # round 13 keeps nothing (first of its stride)
    assert distiller.next_round_keeps()
    distiller.observe(random_canvas(generator))
    assert distiller._kept
    distiller.set_update_stride(2)
    assert not distiller._kept


def test_a_window_of_one_is_the_latest_round_only(generator):
    for config in (_config(update_stride=4), _config(update_stride=4, update_window=1)):  # auto: 1 in the core
        distiller = Distiller(TinyDrafter(), config, publisher=WeightPublisher([]))
        assert not any(distiller.next_round_keeps() or distiller.observe(random_canvas(generator)) for _ in range(3))
    # An engine whose canvases stack resolves auto to DEFAULT_UPDATE_WINDOW rounds in at most
    # DEFAULT_WINDOW_ROWS rows; a given window stays, with the row bound of MAX_WINDOW_ROWS.
    auto = _config().with_default_window(stackable=True)
    assert auto.window == DEFAULT_UPDATE_WINDOW > 1 and auto.window_rows == DEFAULT_WINDOW_ROWS
    assert _config().with_default_window(stackable=False).window == 1
    assert _config(update_window=3).with_default_window(stackable=True).window == 3
    with pytest.raises(TTSConfigError, match="update-window"):
        _config(update_window=0).validate()
    with pytest.raises(TTSConfigError, match="update-window"):
        _config(update_window=65).validate()
    with pytest.raises(TTSConfigError, match="window_rows"):
        _config(window_rows=65).validate()


@pytest.mark.parametrize("batch, rounds", [(1, 8), (2, 4), (3, 2), (4, 2), (16, 1)])
def test_an_auto_window_takes_the_rounds_of_its_stride_that_fit_its_rows(generator, batch, rounds):
    """Every round of the stride up to window_rows rows: at 8 rows and S = 8, one request trains
    on its 8 rounds, a batch of 2 on the last 4, a batch of 16 on its latest round (16 rows). The
    engine is asked to build only the canvases the update will take (next_round_keeps)."""
    drafter = BatchRecorder()
    config = _config(update_stride=8, update_window=64, window_rows=8)
    distiller = Distiller(drafter, config, publisher=WeightPublisher([]), executor=DeferredExecutor())
    built = []
    for round_number in range(1, 17):
        distiller.barrier()
        canvas = None
        if round_number == 1 or distiller.next_round_submits() or distiller.next_round_keeps():
            built.append(round_number)  # round 1: the engine's first canvas tells the batch size
            canvas = random_canvas(generator, batch=batch, round_index=round_number)
            canvas.positions[:, 0] = round_number
            canvas.request_ids = [f"r{i}" for i in range(batch)]
        distiller.observe(canvas)
    distiller.barrier(force=True)
    assert built == sorted({1, *range(9 - rounds, 9), *range(17 - rounds, 17)})
    assert len(drafter.batches) == 2
    for stride, rows in zip((8, 16), drafter.batches):
        assert rows == [(r, f"r{i}") for r in range(stride + 1 - rounds, stride + 1) for i in range(batch)]


def test_a_window_learns_more_per_update_than_the_latest_round(generator):
    """Same stride, same number of updates: training on every round of the stride reaches a
    higher agreement with the teacher than training on the latest round only."""
    teacher = TinyTeacher()
    held_out = [teacher.canvas(generator, batch=8) for _ in range(4)]
    rounds = [teacher.canvas(generator, batch=1, round_index=i) for i in range(160)]
    for r, canvas in enumerate(rounds):
        canvas.request_ids = ["r"]
        canvas.positions[:] = canvas.positions + r  # one request, whose context grows
    scores = {}
    for window in (1, 4):
        drafter = TinyDrafter(seed=0)
        distiller = Distiller(drafter, _config(lr=3e-3, update_stride=4, update_window=window))
        for canvas in rounds:
            distiller.barrier()
            distiller.observe(canvas)
        distiller.barrier(force=True)
        assert distiller.stats.num_updates == 40
        scores[window] = agreement(drafter, held_out)
    assert scores[4] > scores[1] + 0.05, scores


def test_a_window_keeps_a_bounded_number_of_rows_whatever_the_batch(generator):
    """At most MAX_WINDOW_ROWS rows per update: a batch of 20 keeps 2 earlier rounds of a window of
    8, a batch of 40 none (the update trains on its latest round, as without a window)."""
    from sglang_tts.config import MAX_WINDOW_ROWS

    for batch, rows in ((20, 60), (40, 40)):
        drafter = BatchRecorder()
        distiller = Distiller(drafter, _config(update_stride=8, update_window=8), publisher=WeightPublisher([]))
        for round_number in range(1, 9):
            canvas = random_canvas(generator, batch=batch, round_index=round_number)
            canvas.request_ids = [f"r{i}" for i in range(batch)]
            distiller.observe(canvas)
            assert sum(c.batch_size for c in distiller._kept) + batch <= MAX_WINDOW_ROWS
        distiller.barrier(force=True)
        assert len(drafter.batches) == 1 and len(drafter.batches[0]) == rows
