"""The target model's linear layers and LM head on CPU, through oneDNN weights packed once at load.

Why: with a few rows (a verify of 4-8 draft tokens, a draft-extend) `F.linear` costs 2-3x the
one-row product on this CPU, because the BLAS repacks the whole weight for every small GEMM; a
verify then costs two decode steps although it reads the weights once, like a decode step does.
A oneDNN linear whose weight was reordered once at load (`torch.ops.mkldnn._reorder_linear_weight`)
does not repack. Measured per (weight shape, rows) by scripts/bench_cpu_linear.py
(docs/results/cpu-linear/report.md): from 4 rows on the packed product is the fastest (Qwen2.5-0.5B's
LM head, 4 rows: 22.6 ms packed, 57.7 ms `F.linear`; one row 18.2 ms), while with 1-3 rows `F.linear`
(the BLAS's small-M kernel, no repacking) is faster by 10-60%. On an AVX-512 AMD EPYC it is the other
way round: the packed product was 3-14x faster than `F.linear` from one row on (Qwen's LM head,
1 / 2 / 3 rows: 7.8 / 8.2 / 8.8 ms packed, 32 / 73 / 108 ms `F.linear`). So the row count from which a
weight takes its packed copy is the CPU's, and it is measured: when a weight is packed, both products
are timed at 1-3 rows (once per weight shape and process, the fastest of a few calls), and the weight
takes `F.linear` below the first row count from which the packed product is never slower
(`choose_min_rows`); from `MAX_MIN_ROWS` (4) rows on it always takes the packed one.
`SGLANG_TTS_CPU_PACKED_MIN_ROWS=N` sets the threshold instead (1-4; a bad value fails the model load,
naming the variable); `scripts/bench_cpu_linear.py` measures every formulation at any row count.

Which weights: float32 `UnquantizedLinearMethod` layers and the LM head of every model SGLang loads
(target and drafter). A packed copy must follow its dense weight, so every in-place write repacks:
TTS publishing trained drafter weights (`ParamBinding.write`, which writes through `.data` and so
bumps no version counter a cache could check) and SGLang's online weight updates (from disk,
tensors, IPC, distributed). Outputs agree with `F.linear` to float rounding (another summation
order), not bit for bit.

Cost: one packed copy per weight (the linear weights are held twice in memory: Qwen2.5-0.5B +2.0 GB,
SmolLM2-135M +0.4 GB), and a repack of the published weights per TTS publish (Qwen2.5-0.5B's
random EAGLE-3 drafter: about 0.2 GB). Packing and timing Qwen2.5-0.5B at load: about 4 s on the EPYC
(the timing about 1 s, mostly `F.linear` on its LM head). `SGLANG_TTS_CPU_PACKED_LINEAR=0` turns the packing off.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

ENABLE_ENV = "SGLANG_TTS_CPU_PACKED_LINEAR"
MIN_ROWS_ENV = "SGLANG_TTS_CPU_PACKED_MIN_ROWS"
MAX_MIN_ROWS = 4  # from 4 rows on, the packed product was the fastest on every CPU measured
PACKED_ATTR = "_sglang_tts_packed_weight"
MIN_ROWS_ATTR = "_sglang_tts_packed_min_rows"  # per packed module: F.linear below this many rows

# Packed modules by the data_ptr of their dense weight: what a publish into that tensor must repack.
_PACKED_BY_WEIGHT: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
# The measured threshold per weight shape [out, in], for this process (a handful of shapes per model).
_MEASURED_MIN_ROWS: dict[tuple[int, ...], int] = {}


def min_rows_setting() -> int | None:
    """SGLANG_TTS_CPU_PACKED_MIN_ROWS as a row count, or None (unset or "auto": measure per shape).

    Read when a model is packed, not at import: SGLang's plugin loader swallows import errors, while a
    failed model load stops the launch with this message."""
    text = os.environ.get(MIN_ROWS_ENV, "auto").strip()
    if text.lower() == "auto":
        return None
    try:
        rows = int(text)
    except ValueError:
        rows = 0
    if not 1 <= rows <= MAX_MIN_ROWS:
        raise ValueError(
            f"{MIN_ROWS_ENV}={text!r}: use 'auto' (the default: measured per weight shape at load) "
            f"or a row count from 1 to {MAX_MIN_ROWS}"
        )
    return rows


def choose_min_rows(dense_ms: Sequence[float], packed_ms: Sequence[float]) -> int:
    """The first row count from which the packed product is never slower, up to MAX_MIN_ROWS.

    dense_ms[i] / packed_ms[i]: the time of `F.linear` / the packed product with i + 1 rows."""
    min_rows = 1
    for rows, (dense, packed) in enumerate(zip(dense_ms, packed_ms), start=1):
        if dense < packed:
            min_rows = rows + 1
    return min(min_rows, MAX_MIN_ROWS)


def fastest_ms(fn: Callable[[], object], calls: int, budget_s: float = 0.0) -> float:
    """The fastest of at least `calls` timed calls of `fn` (more until `budget_s` seconds have passed), in ms,
    after one untimed call (allocation, oneDNN primitive creation)."""
    fn()
    best = float("inf")
    start = time.perf_counter()
    done = 0
    while done < calls or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        done += 1
    return best * 1e3


def measure_min_rows(weight: torch.Tensor, packed: torch.Tensor, calls: int = 3) -> int:
    """Time `F.linear` and the packed product on `weight` at 1..MAX_MIN_ROWS-1 rows; `choose_min_rows`.

    The fastest of `calls` calls, so a stall of the other core does not decide. Qwen2.5-0.5B's LM head,
    the largest weight served here, costs about a second on the slowest path measured."""
    dense_ms, packed_ms = [], []
    with torch.no_grad():
        for rows in range(1, MAX_MIN_ROWS):
            x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
            dense_ms.append(fastest_ms(lambda x=x: F.linear(x, weight), calls))
            packed_ms.append(fastest_ms(lambda x=x: _packed_linear(x, packed), calls))
    return choose_min_rows(dense_ms, packed_ms)


def _min_rows_for(weight: torch.Tensor, packed: torch.Tensor, setting: int | None) -> int:
    if setting is not None:
        return setting
    shape = tuple(weight.shape)
    if shape not in _MEASURED_MIN_ROWS:
        _MEASURED_MIN_ROWS[shape] = measure_min_rows(weight, packed)
    return _MEASURED_MIN_ROWS[shape]


def packing_enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1") != "0" and torch.backends.mkldnn.is_available()


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed copy of a [out, in] float32 CPU weight, or None where packing does not apply."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def linear(
    x: torch.Tensor,  # [..., in]
    weight: torch.Tensor,  # [out, in], dense
    packed: torch.Tensor | None,  # pack_weight(weight), or None
    bias: torch.Tensor | None = None,  # [out]
    min_rows: int = MAX_MIN_ROWS,  # F.linear below this many rows (the module's MIN_ROWS_ATTR)
) -> torch.Tensor:  # [..., out]
    """`F.linear(x, weight, bias)`, through the packed weight when it is given and x has enough rows."""
    rows = x.numel() // max(x.shape[-1], 1)  # shapes only: no host sync
    if packed is None or rows < min_rows or x.dtype != torch.float32 or x.requires_grad:
        return F.linear(x, weight, bias)
    return _packed_linear(x, packed, bias)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@dataclass
class PackReport:
    layers: int = 0
    lm_heads: int = 0
    bytes: int = 0
    min_rows: dict[str, int] = field(default_factory=dict)  # "out x in" -> the packed weight from this many rows

    def add(self, module: torch.nn.Module, packed: torch.Tensor, lm_head: bool) -> None:
        self.lm_heads += int(lm_head)
        self.layers += int(not lm_head)
        self.bytes += packed.numel() * packed.element_size()
        out_f, in_f = module.weight.shape
        self.min_rows[f"{out_f}x{in_f}"] = getattr(module, MIN_ROWS_ATTR, MAX_MIN_ROWS)


def _lm_head_is_plain(lm_head: torch.nn.Module) -> bool:
    """Whether SGLang computes this head's logits with a plain matmul of its weight (no quant, no LoRA)."""
    from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method

    if hasattr(lm_head, "set_lora") and hasattr(lm_head, "apply_lora"):
        return False
    return not should_apply_lm_head_quant_method(lm_head, getattr(lm_head, "quant_method", None))


def _pack_module(module: torch.nn.Module, setting: int | None) -> torch.Tensor | None:
    """Pack `module`'s weight; its threshold is `setting`, or measured (once per shape) where None."""
    with torch.no_grad():
        packed = pack_weight(module.weight)
    if packed is not None:
        setattr(module, MIN_ROWS_ATTR, _min_rows_for(module.weight, packed, setting))
        _PACKED_BY_WEIGHT[module.weight.data_ptr()] = module
    setattr(module, PACKED_ATTR, packed)
    return packed


def pack_model(model: torch.nn.Module, repack: bool = True) -> PackReport:
    """Attach packed weights to `model`'s unquantized linear layers and its LM head.

    With repack=False a module that already has one keeps it (a drafter sharing the target's head)."""
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    modules = [
        (m, False)
        for m in model.modules()
        if isinstance(m, LinearBase) and isinstance(m.quant_method, UnquantizedLinearMethod)
    ]
    lm_head = getattr(model, "lm_head", None)
    if isinstance(lm_head, torch.nn.Module) and isinstance(getattr(lm_head, "weight", None), torch.Tensor):
        if _lm_head_is_plain(lm_head):
            modules.append((lm_head, True))
    setting = min_rows_setting()
    report = PackReport()
    for module, is_head in modules:
        packed = getattr(module, PACKED_ATTR, None)
        if repack or packed is None:
            packed = _pack_module(module, setting)
        if packed is not None:
            report.add(module, packed, lm_head=is_head)
    return report


def repack_tensor(weight: torch.Tensor) -> bool:
    """Repack the module whose dense weight is `weight` (just written in place); False if none is packed."""
    module = _PACKED_BY_WEIGHT.get(weight.data_ptr())
    if module is None or getattr(module, PACKED_ATTR, None) is None or module.weight.data_ptr() != weight.data_ptr():
        return False
    _pack_module(module, getattr(module, MIN_ROWS_ATTR, None))  # same shape: the threshold it already has
    return True


def _is_packed(model: torch.nn.Module) -> bool:
    return any(getattr(module, PACKED_ATTR, None) is not None for module in model.modules())


# ---------------------------------------------------------------------------------------------------------
# HookRegistry AROUND hooks
# ---------------------------------------------------------------------------------------------------------


def linear_apply_hook(original, method, layer, x, bias=None, *args, **kwargs):
    """AROUND hook on UnquantizedLinearMethod.apply: the packed weight where the layer has one."""
    packed = getattr(layer, PACKED_ATTR, None)
    if packed is None or args or kwargs:
        return original(method, layer, x, bias, *args, **kwargs)
    return linear(x, layer.weight, packed, bias, getattr(layer, MIN_ROWS_ATTR, MAX_MIN_ROWS))


def compute_lm_head_hook(original, processor, hidden_states, lm_head, embedding_bias=None, *args, **kwargs):
    """AROUND hook on LogitsProcessor._compute_lm_head: the packed head where SGLang would take a plain
    `hidden_states @ weight.T` (float32, no fp32-head or RL on-policy option; its `out` buffer is
    CUDA-only and ignored there too)."""
    packed = getattr(lm_head, PACKED_ATTR, None)
    if (
        packed is None
        or args
        or processor.use_fp32_lm_head
        or processor.rl_on_policy_target is not None
        or hidden_states.dtype != torch.float32
    ):
        return original(processor, hidden_states, lm_head, embedding_bias, *args, **kwargs)
    return linear(hidden_states, lm_head.weight, packed, min_rows=getattr(lm_head, MIN_ROWS_ATTR, MAX_MIN_ROWS))


def load_model_hook(original, runner, *args, **kwargs):
    """AROUND hook on ModelRunner.load_model: pack the model's weights once loaded."""
    pack = runner.device == "cpu" and packing_enabled()
    setting = min_rows_setting() if pack else None  # a bad value fails before the weights are read
    result = original(runner, *args, **kwargs)
    if not pack:
        return result
    report = pack_model(runner.model, repack=False)
    logger.info(
        "sglang-tts: packed %d linear layers and %d LM head(s) of the %s for oneDNN (%.2f GB); "
        "packed from this many rows, per weight shape (%s): %s",
        report.layers,
        report.lm_heads,
        "drafter" if runner.is_draft_worker else "target",
        report.bytes / 2**30,
        "measured" if setting is None else MIN_ROWS_ENV,
        report.min_rows,
    )
    return result


def publish_write_hook(original, binding, *args, **kwargs):
    """AROUND hook on sglang_tts.core.publish.ParamBinding.write: repack the weight TTS just published."""
    result = original(binding, *args, **kwargs)
    repack_tensor(binding.dst)
    return result


def weight_update_hook(original, updater, *args, **kwargs):
    """AROUND hook on SGLang's WeightUpdater methods: repack a packed model after its weights changed."""
    result = original(updater, *args, **kwargs)
    model = updater.get_model()
    if _is_packed(model):
        pack_model(model)
    return result


_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"
HOOKS = {
    "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply": linear_apply_hook,
    "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head": compute_lm_head_hook,
    "sglang.srt.model_executor.model_runner.ModelRunner.load_model": load_model_hook,
    "sglang_tts.core.publish.ParamBinding.write": publish_write_hook,
    **{
        f"{_UPDATER}.{name}": weight_update_hook
        for name in (
            "update_weights_from_disk",
            "update_weights_from_tensor",
            "update_weights_from_ipc",
            "load_weights_from_distributed",
        )
    },
}


def register_hooks(registry, hook_type) -> None:
    for target, hook in HOOKS.items():
        registry.register(target, hook, hook_type.AROUND)
