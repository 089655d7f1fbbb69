"""The CPU linear path: packed oneDNN weights agree with F.linear for every row count serving makes,
the dispatch really switches at each weight's row threshold (measured per shape at load, or set), and the
SGLang hooks pack, use and repack weights."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from sglang_tts.platform.cpu import linear as cpu_linear
from sglang_tts.platform.cpu.linear import MAX_MIN_ROWS, MIN_ROWS_ATTR, PACKED_ATTR, pack_weight

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")

# Decode (1), 2, verify of chains 2..7 (3..8), batched verifies and prefill chunks.
ROWS = [1, 2, 3, 4, 7, 8, 16, 33, 256]


def _close(a: torch.Tensor, b: torch.Tensor, k: int) -> None:
    # Another summation order over k products: float32 rounding grows like sqrt(k) * eps * |terms|.
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * k**0.5 * 4)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", [(1000, 64), (96, 320)])
def test_packed_linear_matches_f_linear(rows: int, shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(rows)
    out_f, in_f = shape
    weight = torch.randn(out_f, in_f, generator=gen) * 0.05
    bias = torch.randn(out_f, generator=gen)
    x = torch.randn(rows, in_f, generator=gen)
    packed = pack_weight(weight)
    with torch.inference_mode():
        for b in (None, bias):
            _close(cpu_linear.linear(x, weight, packed, b), F.linear(x, weight, b), in_f)
        # Leading batch dims and a non-contiguous input (a column slice) are flattened the same way.
        x3 = x.reshape(1, rows, in_f)
        _close(cpu_linear.linear(x3, weight, packed, bias), F.linear(x3, weight, bias), in_f)
        wide = torch.randn(rows, 2 * in_f, generator=gen)[:, ::2]
        _close(cpu_linear.linear(wide, weight, packed), F.linear(wide, weight), in_f)


@pytest.mark.parametrize("min_rows", range(1, MAX_MIN_ROWS + 1))
@pytest.mark.parametrize("rows", ROWS)
def test_dispatch_switches_to_the_packed_weight_at_min_rows(rows: int, min_rows: int) -> None:
    """A packed copy of 2*W tells which weight was used: W below min_rows (exactly F.linear), the
    packed one from there on."""
    weight = torch.randn(48, 32)
    x = torch.randn(rows, 32)
    out = cpu_linear.linear(x, weight, pack_weight(2 * weight), min_rows=min_rows)
    if rows < min_rows:
        assert torch.equal(out, F.linear(x, weight))
    else:
        _close(out, 2 * F.linear(x, weight), 32)


def test_unpackable_inputs_take_f_linear() -> None:
    weight = torch.randn(16, 8)
    assert pack_weight(weight.to(torch.bfloat16)) is None  # bf16 is 3x slower than fp32 on these CPUs anyway
    assert pack_weight(torch.randn(16)) is None
    packed = pack_weight(2 * weight)
    x = torch.randn(5, 8, requires_grad=True)  # autograd: the packed op has no backward
    out = cpu_linear.linear(x, weight, packed)
    out.sum().backward()
    assert torch.equal(out, F.linear(x, weight)) and x.grad is not None
    assert torch.equal(
        cpu_linear.linear(x.detach().double(), weight.double(), packed), F.linear(x.double(), weight.double())
    )


# ---------------------------------------------------------------------------------------------------------
# The SGLang side: packing a model, the apply / LM-head hooks, repacking after a weight update
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sglang_cpu():
    from sglang_tts.platform import cpu

    cpu.install()  # SGLang's layers import sgl_kernel ops when the CPU engine is on


def _tiny_model():
    from sglang.srt.layers.linear import ReplicatedLinear

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = ReplicatedLinear(32, 24, bias=True)
            self.lm_head = torch.nn.Embedding(80, 32)  # a head SGLang reads by weight, like VocabParallelEmbedding

    model = Tiny()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model


def test_pack_model_and_hooks_use_the_packed_weights(sglang_cpu) -> None:
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    model = _tiny_model()
    report = cpu_linear.pack_model(model)
    assert (report.layers, report.lm_heads) == (1, 1)
    assert report.bytes == (24 * 32 + 80 * 32) * 4
    layer = model.proj
    x = torch.randn(4, 32)
    with torch.inference_mode():
        hooked = cpu_linear.linear_apply_hook(UnquantizedLinearMethod.apply, layer.quant_method, layer, x, layer.bias)
        _close(hooked, F.linear(x, layer.weight, layer.bias), 32)
        # The hook really reads the packed attribute: swap in a packed 2*W.
        setattr(layer, PACKED_ATTR, pack_weight(2 * layer.weight))
        doubled = cpu_linear.linear_apply_hook(UnquantizedLinearMethod.apply, layer.quant_method, layer, x, None)
        _close(doubled, 2 * F.linear(x, layer.weight), 32)
        # ... from the layer's own row threshold on: below it, F.linear on the dense weight.
        setattr(layer, MIN_ROWS_ATTR, x.shape[0] + 1)
        dense = cpu_linear.linear_apply_hook(UnquantizedLinearMethod.apply, layer.quant_method, layer, x, None)
        assert torch.equal(dense, F.linear(x, layer.weight))
        # A layer without a packed weight goes to SGLang's own apply.
        setattr(layer, PACKED_ATTR, None)
        calls = []

        def original(method, lyr, inp, bias=None):
            calls.append(inp.shape)
            return F.linear(inp, lyr.weight, bias)

        cpu_linear.linear_apply_hook(original, layer.quant_method, layer, x)
        assert calls == [x.shape]


class _Processor:
    """The LogitsProcessor attributes the LM-head hook reads."""

    def __init__(self, use_fp32_lm_head: bool = False) -> None:
        self.use_fp32_lm_head = use_fp32_lm_head
        self.rl_on_policy_target = None


def test_lm_head_hook(sglang_cpu) -> None:
    model = _tiny_model()
    cpu_linear.pack_model(model)
    hidden = torch.randn(7, 32)
    expected = hidden @ model.lm_head.weight.T

    def original(processor, hidden_states, lm_head, embedding_bias=None, *, out=None):
        return torch.full((hidden_states.shape[0], lm_head.weight.shape[0]), -1.0)

    with torch.inference_mode():
        logits = cpu_linear.compute_lm_head_hook(original, _Processor(), hidden, model.lm_head)
        _close(logits, expected, 32)
        # SGLang's fp32-head option (and an unpacked head) keep SGLang's own computation.
        assert (cpu_linear.compute_lm_head_hook(original, _Processor(True), hidden, model.lm_head) == -1).all()
        setattr(model.lm_head, PACKED_ATTR, None)
        assert (cpu_linear.compute_lm_head_hook(original, _Processor(), hidden, model.lm_head) == -1).all()


def test_weight_update_repacks(sglang_cpu) -> None:
    model = _tiny_model()
    cpu_linear.pack_model(model)

    class Updater:
        def get_model(self):
            return model

    def update(updater, scale):  # SGLang's loaders write parameters in place through .data
        for p in updater.get_model().parameters():
            p.data.mul_(scale)
        return True, "ok"

    assert cpu_linear.weight_update_hook(update, Updater(), 3.0) == (True, "ok")
    x = torch.randn(4, 32)
    with torch.inference_mode():
        out = cpu_linear.linear(x, model.proj.weight, getattr(model.proj, PACKED_ATTR))
    _close(out, F.linear(x, model.proj.weight), 32)


def test_load_packs_targets_and_drafters_unless_disabled(sglang_cpu, monkeypatch: pytest.MonkeyPatch) -> None:
    class Runner:
        def __init__(self, is_draft_worker: bool, model=None) -> None:
            self.is_draft_worker = is_draft_worker
            self.device = "cpu"
            self.model = model if model is not None else _tiny_model()

    def load(runner):
        return "loaded"

    target = Runner(False)
    assert cpu_linear.load_model_hook(load, target) == "loaded"
    head = getattr(target.model.lm_head, PACKED_ATTR)
    assert getattr(target.model.proj, PACKED_ATTR) is not None and head is not None
    # A drafter sharing the target's head keeps the one packed copy.
    drafter = Runner(True, _tiny_model())
    drafter.model.lm_head = target.model.lm_head
    cpu_linear.load_model_hook(load, drafter)
    assert getattr(drafter.model.proj, PACKED_ATTR) is not None
    assert getattr(target.model.lm_head, PACKED_ATTR) is head

    monkeypatch.setenv(cpu_linear.ENABLE_ENV, "0")
    off = Runner(False)
    cpu_linear.load_model_hook(load, off)
    assert getattr(off.model.proj, PACKED_ATTR, None) is None


def test_tts_publish_repacks_the_written_weight(sglang_cpu) -> None:
    """TTS publishes through ParamBinding.write (in place, via .data): the packed copy must follow."""
    from sglang_tts.core.publish import ParamBinding

    model = _tiny_model()
    cpu_linear.pack_model(model)
    binding = ParamBinding(dst=model.proj.weight, sources=["w"], name="proj")
    trained = {"w": torch.randn(24, 32)}
    cpu_linear.publish_write_hook(ParamBinding.write, binding, trained)
    assert torch.equal(model.proj.weight, trained["w"])
    x = torch.randn(5, 32)
    with torch.inference_mode():
        out = cpu_linear.linear(x, model.proj.weight, getattr(model.proj, PACKED_ATTR))
    _close(out, F.linear(x, trained["w"]), 32)
    # A destination no packed module owns (an adapter bank) is left alone.
    assert not cpu_linear.repack_tensor(torch.zeros(3, 3))


def test_a_publish_keeps_the_weights_threshold(sglang_cpu, monkeypatch: pytest.MonkeyPatch) -> None:
    """A repack after a publish writes the same shape: it keeps the threshold set at load, without timing
    again or reading the environment (which may have changed since the launch)."""
    from sglang_tts.core.publish import ParamBinding

    monkeypatch.setenv(cpu_linear.MIN_ROWS_ENV, "3")
    model = _tiny_model()
    cpu_linear.pack_model(model)
    monkeypatch.setenv(cpu_linear.MIN_ROWS_ENV, "not a row count")
    monkeypatch.setattr(cpu_linear, "measure_min_rows", lambda *a, **k: pytest.fail("timed again on a publish"))
    before = getattr(model.proj, PACKED_ATTR)
    binding = ParamBinding(dst=model.proj.weight, sources=["w"], name="proj")
    cpu_linear.publish_write_hook(ParamBinding.write, binding, {"w": torch.randn(24, 32)})
    assert getattr(model.proj, PACKED_ATTR) is not before and getattr(model.proj, MIN_ROWS_ATTR) == 3


def test_fastest_ms_times_at_least_the_calls_asked_and_until_the_budget() -> None:
    calls: list[float] = []

    def work() -> None:
        calls.append(time.perf_counter())
        time.sleep(0.0 if len(calls) == 3 else 0.02)  # the third call (the second timed one) is the fastest

    ms = cpu_linear.fastest_ms(work, calls=4)
    assert len(calls) == 5 and ms < 10.0  # one untimed call, then 4 timed; the fastest one counts
    calls.clear()
    cpu_linear.fastest_ms(lambda: calls.append(time.perf_counter()), calls=1, budget_s=0.05)
    assert len(calls) > 10 and calls[-1] - calls[1] >= 0.04  # calls go on until the budget is spent


def test_choose_min_rows_takes_the_packed_weight_from_where_it_is_never_slower() -> None:
    choose = cpu_linear.choose_min_rows
    assert choose([32.0, 73.0, 108.0], [7.8, 8.2, 8.8]) == 1  # AVX-512 EPYC, Qwen's LM head
    assert choose([18.0, 19.0, 21.0], [20.0, 21.0, 22.0]) == 4  # the older CPU: F.linear faster at 1-3
    assert choose([1.0, 3.0, 4.0], [2.0, 2.0, 2.0]) == 2
    assert choose([1.0, 3.0, 1.0], [2.0, 2.0, 2.0]) == 4  # a crossing back: F.linear until it never wins
    assert choose([], []) == 1


def test_the_threshold_is_measured_once_per_weight_shape(sglang_cpu, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset (or "auto"), each packed weight gets the threshold measured on its shape, once per shape."""
    monkeypatch.delenv(cpu_linear.MIN_ROWS_ENV, raising=False)
    monkeypatch.setattr(cpu_linear, "_MEASURED_MIN_ROWS", {})
    timed: list[tuple[int, ...]] = []
    real = cpu_linear.measure_min_rows

    def measure(weight, packed, calls=3):
        timed.append(tuple(weight.shape))
        return real(weight, packed, calls)

    monkeypatch.setattr(cpu_linear, "measure_min_rows", measure)
    first, second = _tiny_model(), _tiny_model()
    report = cpu_linear.pack_model(first)
    cpu_linear.pack_model(second)
    assert sorted(timed) == [(24, 32), (80, 32)]  # two shapes, two models: two measurements
    assert set(report.min_rows) == {"24x32", "80x32"}
    for model in (first, second):
        for module in (model.proj, model.lm_head):
            rows = getattr(module, MIN_ROWS_ATTR)
            assert 1 <= rows <= MAX_MIN_ROWS and rows == report.min_rows["x".join(map(str, module.weight.shape))]
    # The real timing agrees with a direct comparison on a shape where the two products differ clearly.
    weight = torch.randn(4096, 256)
    assert 1 <= real(weight, pack_weight(weight)) <= MAX_MIN_ROWS


def test_the_threshold_set_in_the_environment_wins_and_a_bad_value_fails_the_load(
    sglang_cpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLANG_TTS_CPU_PACKED_MIN_ROWS=N sets every weight's threshold; a bad value fails where SGLang
    stops the launch (the model load), naming the variable, and not at import, where SGLang's plugin
    loader would swallow it."""
    import subprocess
    import sys

    monkeypatch.setattr(cpu_linear, "measure_min_rows", lambda *a, **k: pytest.fail("measured despite a setting"))
    for value, rows in (("1", 1), (" 3 ", 3), ("4", 4)):
        monkeypatch.setenv(cpu_linear.MIN_ROWS_ENV, value)
        model = _tiny_model()
        assert cpu_linear.pack_model(model).min_rows == {"24x32": rows, "80x32": rows}
        assert getattr(model.proj, MIN_ROWS_ATTR) == rows
    monkeypatch.setenv(cpu_linear.MIN_ROWS_ENV, "AUTO")
    assert cpu_linear.min_rows_setting() is None
    loads = []

    class Runner:
        device, is_draft_worker, model = "cpu", False, None

    for bad in ("0", "5", "-2", "four", ""):
        monkeypatch.setenv(cpu_linear.MIN_ROWS_ENV, bad)
        with pytest.raises(ValueError, match=cpu_linear.MIN_ROWS_ENV):
            cpu_linear.pack_model(_tiny_model())
        with pytest.raises(ValueError, match=cpu_linear.MIN_ROWS_ENV):
            cpu_linear.load_model_hook(lambda runner: loads.append(runner), Runner())
    assert loads == []  # the launch fails before any weight is read
    imported = subprocess.run([sys.executable, "-c", "import sglang_tts.platform.cpu.linear"], capture_output=True)
    assert imported.returncode == 0, imported.stderr.decode()[-2000:]  # the env still holds the last bad value
