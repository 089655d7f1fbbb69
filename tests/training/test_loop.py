"""The optimisation loop: LR schedule, checkpoints, exact resume, time/step stops."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sglang_tts.training.loop import LoopConfig, OptimConfig, lr_lambda, read_metrics, train_loop, training_state_step


def test_warmup_then_cosine_to_the_floor():
    factor = lr_lambda(OptimConfig(warmup_ratio=0.1, min_lr_ratio=0.1), total_steps=100)
    assert factor(0) == pytest.approx(0.1) and factor(9) == pytest.approx(1.0)
    assert factor(10) == pytest.approx(1.0) and factor(99) == pytest.approx(0.1, abs=1e-3)
    assert all(factor(s) >= factor(s + 1) for s in range(10, 99))
    constant = lr_lambda(OptimConfig(schedule="constant", warmup_ratio=0.1), 100)
    assert constant(50) == 1.0
    with pytest.raises(ValueError):
        lr_lambda(OptimConfig(schedule="linear"), 10)


def _problem(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    data = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    target = data.sum(-1, keepdim=True)

    def step_fn(step: int):
        rows = torch.arange(4) + 4 * (step % 4)  # step-determined batch
        loss = (model(data[rows]) - target[rows]).pow(2).mean()
        return loss, {"half_loss": float(loss.detach()) / 2}

    return model, step_fn


def test_resume_continues_exactly_from_the_saved_step(tmp_path):
    optim = OptimConfig(lr=1e-2)
    saves: list[int] = []

    model, step_fn = _problem()
    straight = train_loop(model, step_fn, optim, LoopConfig(steps=12, progress=False), tmp_path / "a", saves.append)
    assert straight.finished and saves == [12]

    model2, step_fn2 = _problem()
    cfg = LoopConfig(steps=12, save_every=3, stop_after=7, progress=False, log_every=1)
    first = train_loop(model2, step_fn2, optim, cfg, tmp_path / "b", saves.append)
    assert (first.step, first.finished) == (7, False) and training_state_step(tmp_path / "b") == 7

    model3, step_fn3 = _problem(seed=5)  # different init: everything must come from the state
    cfg = LoopConfig(steps=12, save_every=3, progress=False, log_every=1)
    second = train_loop(model3, step_fn3, optim, cfg, tmp_path / "b", saves.append, resume=True)
    assert (second.start_step, second.step, second.finished) == (7, 12, True)
    for a, b in zip(model.parameters(), model3.parameters()):
        assert torch.allclose(a, b, atol=1e-7)
    assert [r["loss"] for r in second.history] == pytest.approx([r["loss"] for r in straight.history], rel=1e-5)
    assert [r["step"] for r in read_metrics(tmp_path / "b")] == list(range(1, 13))


def test_resume_takes_the_requested_learning_rate(tmp_path):
    # A resumed run with a new --lr (e.g. to train longer, faster) must use it, not the saved one.
    model, step_fn = _problem()
    constant = OptimConfig(lr=1e-2, schedule="constant", warmup_ratio=0.0)
    train_loop(model, step_fn, constant, LoopConfig(steps=4, progress=False), tmp_path, lambda s: None)
    model2, step_fn2 = _problem()
    faster = OptimConfig(lr=5e-2, schedule="constant", warmup_ratio=0.0)
    result = train_loop(
        model2, step_fn2, faster, LoopConfig(steps=8, progress=False), tmp_path, lambda s: None, resume=True
    )
    assert [r["lr"] for r in result.history] == pytest.approx([1e-2] * 4 + [5e-2] * 4)


def test_resume_without_state_starts_fresh_and_time_budget_stops(tmp_path):
    model, step_fn = _problem()
    loop = LoopConfig(steps=50, time_budget_s=0.0, progress=False)
    result = train_loop(model, step_fn, OptimConfig(), loop, tmp_path, lambda s: None, resume=True)
    assert (result.start_step, result.step, result.finished) == (0, 1, False)
    assert training_state_step(tmp_path) == 1


class _RunsCode:
    """A pickle payload: unpickling it calls Path.touch on the marker (any callable would do)."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (type(self.marker).touch, (self.marker,))


def test_resume_never_runs_code_from_a_tampered_state(tmp_path):
    model, step_fn = _problem()
    train_loop(model, step_fn, OptimConfig(), LoopConfig(steps=2, progress=False), tmp_path, lambda s: None)
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    assert set(state) == {"model", "optimizer", "meta"}  # non-tensor state is a JSON string
    marker = tmp_path / "pwned"
    state["meta"] = _RunsCode(marker)
    torch.save(state, tmp_path / "state.pt")
    with pytest.raises(ValueError, match="refusing to resume from .*state.pt"):
        train_loop(
            model, step_fn, OptimConfig(), LoopConfig(steps=4, progress=False), tmp_path, lambda s: None, resume=True
        )
    with pytest.raises(ValueError, match="state.pt"):
        training_state_step(tmp_path)
    assert not marker.exists()
