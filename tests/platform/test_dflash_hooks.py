"""The DFLASH-on-CPU hooks (sglang_tts/platform/cpu/dflash.py), without a server.

Everything that needs `sglang.srt` runs in one fresh interpreter (this file run as a script,
`_probe`): there the CPU layer is installed, stock SGLang's behaviour is recorded first, then the
registered hooks are applied with SGLang's own `HookRegistry.apply_hooks()` and the same calls are
made again. The pytest process itself never imports `sglang.srt` nor patches it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from sglang_tts.platform.cpu import dflash

# --- in-process: the record_stream guard and the platform stand-in (plain torch) -----------------


def _cpu_stream() -> Any:
    return torch.get_device_module("cpu").current_stream()


def test_stock_record_stream_rejects_cpu_tensors():
    # What dflash_worker_v2.py runs every decode step; the reason for the hook.
    with pytest.raises(RuntimeError):
        torch.zeros(3).record_stream(_cpu_stream())


def test_record_stream_is_noop_for_cpu_tensors_only_inside_the_block():
    stock = torch.Tensor.record_stream
    with dflash.cpu_record_stream_is_noop():
        assert torch.zeros(3).record_stream(_cpu_stream()) is None
        with dflash.cpu_record_stream_is_noop():  # re-entrant: no double wrapping
            assert torch.Tensor.record_stream.__wrapped__ is stock
    assert torch.Tensor.record_stream is stock
    with pytest.raises(RuntimeError):
        torch.zeros(3).record_stream(_cpu_stream())


def test_record_stream_guard_delegates_other_devices(monkeypatch):
    calls: list[str] = []

    def recording_original(tensor: torch.Tensor, stream: Any) -> str:
        calls.append(tensor.device.type)
        return "original"

    monkeypatch.setattr(torch.Tensor, "record_stream", recording_original)
    with dflash.cpu_record_stream_is_noop():
        assert torch.empty(2, device="meta").record_stream("s") == "original"
        assert torch.empty(2).record_stream("s") is None
    assert calls == ["meta"]
    assert torch.Tensor.record_stream is recording_original


def test_record_stream_is_restored_when_the_call_raises():
    stock = torch.Tensor.record_stream

    def failing(worker: Any) -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError):
        dflash.forward_batch_generation_hook(failing, object())
    assert torch.Tensor.record_stream is stock


def test_forward_batch_generation_hook_passes_arguments_and_result_through():
    seen: dict[str, Any] = {}

    def original(worker: Any, batch: Any, on_publish: Any = None) -> str:
        batch.seq_lens.record_stream(_cpu_stream())  # the stock call site
        seen.update(worker=worker, batch=batch, on_publish=on_publish)
        return "result"

    batch = type("Batch", (), {"seq_lens": torch.tensor([5, 7])})()
    worker = object()
    assert dflash.forward_batch_generation_hook(original, worker, batch, on_publish=print) == "result"
    assert seen == {"worker": worker, "batch": batch, "on_publish": print}


def test_platform_stand_in_declares_dflash_with_torch_native_and_delegates_the_rest():
    real = type("RealPlatform", (), {"device_name": "cpu", "is_out_of_tree": lambda self: False})()
    stand_in = dflash._CpuDFlashPlatform(real)
    assert stand_in.is_out_of_tree() is True
    assert stand_in.supports_speculative_algorithm("DFLASH") is True
    assert stand_in.supports_speculative_algorithm("DSPARK") is False
    assert stand_in.supports_speculative_draft_attention_backend("DFLASH", "torch_native") is True
    assert stand_in.supports_speculative_draft_attention_backend("DFLASH", "flashinfer") is False
    assert stand_in.get_default_speculative_draft_attention_backend("DFLASH") == "torch_native"
    assert stand_in.device_name == "cpu"


def test_register_hooks_names_sglang_targets_with_the_right_hook_types(monkeypatch):
    registered: list[tuple[str, Any, str]] = []
    extended: list[bool] = []

    class Registry:
        @staticmethod
        def register(target: str, hook: Any, hook_type: str) -> None:
            registered.append((target, hook, hook_type))

    hook_type = type("HookType", (), {"AROUND": "around", "AFTER": "after"})
    monkeypatch.setattr(dflash, "allow_torch_native_draft_backend", lambda: extended.append(True))
    dflash.register_hooks(Registry, hook_type)
    assert extended == [True]
    assert registered == [
        (dflash.HANDLE_DFLASH, dflash.handle_dflash_hook, "around"),
        (dflash.FORWARD_BATCH_GENERATION, dflash.forward_batch_generation_hook, "around"),
        (dflash.DFLASH_ATTENTION_INIT, dflash.dflash_attention_init_hook, "after"),
        (dflash.EXTEND_FORWARD_KWARGS, dflash.extend_forward_kwargs_hook, "after"),
    ]


# --- against the installed SGLang, in a fresh interpreter ---------------------------------------

RESOLVED_FIELDS = (
    "speculative_algorithm",
    "speculative_num_draft_tokens",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_draft_attention_backend",
    "max_running_requests",
    "disable_overlap_schedule",
)


def _resolve(target: str, draft: str | None, *extra: str) -> dict[str, Any]:
    """Resolve server args the way `launch_server` does; the resolved fields, or the error."""
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.server_args import prepare_server_args

    argv = ["--model-path", target, "--device", "cpu", "--attention-backend", "torch_native"]
    argv += ["--dtype", "float32", "--speculative-algorithm", "DFLASH"]
    if draft is not None:
        argv += ["--speculative-draft-model-path", draft]
    server_args = prepare_server_args([*argv, *extra])
    try:
        server_args.resolve_once()
    except Exception as e:  # noqa: BLE001 - the message is what the test compares
        return {"error": f"{type(e).__name__}: {e}"}
    view = resolved_view(server_args)
    return {name: getattr(view, name) for name in RESOLVED_FIELDS}


def _attention_layer(draft: str, dtype: torch.dtype) -> Any:
    """A real `DFlashAttention` from the drafter's config, random weights, attention kernel stubbed.

    The stub returns q and records q/k/v, which isolates the QK-norm + RoPE step the hook changes;
    o_proj is bypassed too (its row-parallel reduction needs a tensor-parallel group).
    """
    from sglang.srt.models.dflash import DFlashAttention
    from sglang.srt.runtime_context import get_context
    from transformers import AutoConfig

    class RecordingAttention(torch.nn.Module):
        def forward(self, q, k, v, forward_batch, **kwargs):
            self.qkv = (q.float(), k.float(), v.float())
            return q

    class PassThrough(torch.nn.Module):  # o_proj without the tensor-parallel reduction
        def forward(self, x):
            return x, None

    config = AutoConfig.from_pretrained(draft)
    with get_context().override_server_args(device="cpu"):
        layer = DFlashAttention(config, layer_id=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            param.copy_(base + 0.2 * torch.randn(param.shape, generator=gen))
    layer.attn = RecordingAttention()
    layer.o_proj = PassThrough()
    return layer.to(dtype)


def _run_attention(layer: Any, hidden: torch.Tensor) -> dict[str, Any]:
    try:
        layer(positions=torch.arange(hidden.shape[0]) + 5, hidden_states=hidden, forward_batch=None)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}
    return {"qkv": layer.attn.qkv}


def _attention_scenarios(draft: str) -> dict[str, Any]:
    import copy

    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    layer = _attention_layer(draft, torch.float32)
    out: dict[str, Any] = {"flag": layer.use_table_qk_norm_rope}
    bf16 = copy.deepcopy(layer).to(torch.bfloat16)
    out["bf16"] = _run_attention(bf16, hidden.to(torch.bfloat16))
    ref = _run_attention(layer, hidden)["qkv"]
    if "qkv" in out["bf16"]:
        out["bf16"] = {"max_err": max((a - b).abs().max().item() for a, b in zip(out["bf16"]["qkv"], ref))}
    return out


def _embeds_scenarios() -> dict[str, Any]:
    from types import SimpleNamespace

    from sglang.srt.model_executor.model_runner import ModelRunner

    embeds = torch.randn(4, 8, dtype=torch.float64).float()
    replace = torch.randn(1, 8)

    def kwargs_for(runner_dtype: torch.dtype, with_replace: bool) -> dict[str, Any]:
        runner = SimpleNamespace(dtype=runner_dtype, is_generation=True, _pp_kwargs=lambda proxy: {})
        batch = SimpleNamespace(
            input_embeds=embeds,
            replace_embeds=replace if with_replace else None,
            replace_positions=torch.tensor([2]) if with_replace else None,
        )
        result = ModelRunner._extend_forward_kwargs(runner, batch, None)["input_embeds"]
        expected = embeds.clone()
        if with_replace:
            expected[2] = replace[0]
        return {
            "dtype": str(result.dtype),
            "exact": bool(torch.equal(result.float(), expected)),
            "embeds_untouched": bool(torch.equal(batch.input_embeds, embeds)),
        }

    return {
        "fp32": kwargs_for(torch.float32, False),
        "fp32_replace": kwargs_for(torch.float32, True),
        "bf16": kwargs_for(torch.bfloat16, False),
    }


def _draft_backend_choice() -> dict[str, str]:
    from sglang.srt.arg_groups.choices import DRAFT_ATTENTION_BACKEND_CHOICES
    from sglang.srt.runtime_context import get_context
    from sglang.srt.speculative.draft_worker_common import resolve_draft_worker_attention_backend

    out = {}
    with get_context().override_server_args(device="cpu", speculative_draft_attention_backend="torch_native"):
        DRAFT_ATTENTION_BACKEND_CHOICES.remove("torch_native")
        out["stock"] = resolve_draft_worker_attention_backend(algo_label="DFLASH")
        dflash.allow_torch_native_draft_backend()
        dflash.allow_torch_native_draft_backend()
        out["hooked"] = resolve_draft_worker_attention_backend(algo_label="DFLASH")
    out["count"] = DRAFT_ATTENTION_BACKEND_CHOICES.count("torch_native")
    return out


def _worker_record_stream() -> dict[str, Any]:
    """Call the (hooked) `DFlashWorkerV2.forward_batch_generation` on a stand-in worker whose first
    step does what the real method does at its `record_stream` line, then stops."""
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    class Stop(Exception):
        pass

    class Worker:
        def _validate_phase1_sampling_support(self, batch: Any) -> None:
            batch.seq_lens.record_stream(_cpu_stream())
            raise Stop

    batch = type("Batch", (), {"seq_lens": torch.tensor([3])})()
    try:
        DFlashWorkerV2.forward_batch_generation(Worker(), batch)
    except Stop:
        return {"inside": "no-op"}
    except RuntimeError as e:
        return {"inside": f"RuntimeError: {e}"}
    return {"inside": "returned"}


def _other_device_passthrough(target: str, draft: str) -> dict[str, Any]:
    """For a non-CPU device the hook must call `_handle_dflash` with the real platform."""
    from sglang.srt.arg_groups import speculative_hook
    from sglang.srt.server_args import prepare_server_args

    seen: dict[str, Any] = {}

    def original(server_args: Any) -> str:
        seen["platform"] = type(speculative_hook.current_platform).__name__
        return "stock"

    out = {}
    for device in ("xpu", "cpu"):
        argv = ["--model-path", target, "--device", device, "--speculative-algorithm", "DFLASH"]
        server_args = prepare_server_args([*argv, "--speculative-draft-model-path", draft])
        out[device] = {"result": dflash.handle_dflash_hook(original, server_args), **seen}
    return out


def _probe(target: str, draft: str) -> dict[str, Any]:
    from sglang_tts.platform import cpu

    assert cpu.install(), "the CPU layer must activate on this machine (no sgl_kernel, no CUDA)"
    from sglang.srt.arg_groups import speculative_hook
    from sglang.srt.plugins.hook_registry import HookRegistry

    real_platform = speculative_hook.current_platform
    out: dict[str, Any] = {"stock": {}, "hooked": {}}
    stock = out["stock"]
    stock["resolve"] = _resolve(target, draft)
    stock["attention"] = _attention_scenarios(draft)
    stock["embeds"] = _embeds_scenarios()
    stock["worker"] = _worker_record_stream()

    HookRegistry.apply_hooks()
    hooked = out["hooked"]
    hooked["patched"] = sorted(HookRegistry._patched)
    hooked["resolve"] = _resolve(target, draft)
    hooked["resolve_triton_draft"] = _resolve(target, draft, "--speculative-draft-attention-backend", "triton")
    hooked["resolve_block_size"] = _resolve(target, draft, "--speculative-dflash-block-size", "2")
    hooked["no_draft"] = _resolve(target, None)
    hooked["block_mismatch"] = _resolve(
        target, draft, "--speculative-dflash-block-size", "4", "--speculative-num-draft-tokens", "8"
    )
    hooked["window_too_small"] = _resolve(target, draft, "--speculative-draft-window-size", "2")
    hooked["pp"] = _resolve(target, draft, "--pp-size", "2")
    hooked["platform_restored"] = speculative_hook.current_platform is real_platform
    hooked["passthrough"] = _other_device_passthrough(target, draft)
    hooked["attention"] = _attention_scenarios(draft)
    hooked["embeds"] = _embeds_scenarios()
    hooked["worker"] = _worker_record_stream()
    hooked["draft_backend"] = _draft_backend_choice()
    return out


@pytest.fixture(scope="module")
def probe(tiny_qwen3: Path, tmp_path_factory) -> dict[str, Any]:
    from sglang_tts.drafters.checkpoints import write_tiny_dflash

    target_config = json.loads((tiny_qwen3 / "config.json").read_text())
    draft = write_tiny_dflash(tmp_path_factory.mktemp("dflash") / "draft", target_config, block_size=4)
    # A plain SGLang process: the kernel tests' TRITON_INTERPRET would make the stock Triton path run.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, __file__, str(tiny_qwen3), str(draft)], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_stock_sglang_refuses_dflash_on_cpu(probe):
    assert probe["stock"]["resolve"] == {
        "error": "ValueError: DFLASH speculative decoding is not supported by CpuSRTPlatform on device 'cpu'."
    }


def test_all_hooks_apply_to_existing_sglang_targets(probe):
    patched = set(probe["hooked"]["patched"])
    for target in (
        dflash.HANDLE_DFLASH,
        dflash.FORWARD_BATCH_GENERATION,
        dflash.DFLASH_ATTENTION_INIT,
        dflash.EXTEND_FORWARD_KWARGS,
    ):
        assert target in patched


def test_hooked_resolution_accepts_cpu_with_dflash_defaults(probe):
    assert probe["hooked"]["resolve"] == {
        "speculative_algorithm": "DFLASH",
        "speculative_num_draft_tokens": 4,  # the drafter checkpoint's block_size
        "speculative_num_steps": 1,
        "speculative_eagle_topk": 1,
        "speculative_draft_attention_backend": "torch_native",
        "max_running_requests": 48,
        # DFLASH's worker is the overlap-capable V2 one and it runs overlapped on CPU.
        "disable_overlap_schedule": False,
    }
    assert probe["hooked"]["platform_restored"] is True


def test_hook_only_acts_for_the_cpu_device(probe):
    assert probe["hooked"]["passthrough"] == {
        "xpu": {"result": "stock", "platform": "CpuSRTPlatform"},
        "cpu": {"result": "stock", "platform": "_CpuDFlashPlatform"},
    }


def test_hooked_resolution_replaces_unusable_draft_backends_and_honours_block_size(probe):
    assert probe["hooked"]["resolve_triton_draft"]["speculative_draft_attention_backend"] == "torch_native"
    assert probe["hooked"]["resolve_block_size"]["speculative_num_draft_tokens"] == 2


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no_draft", "DFLASH speculative decoding requires setting --speculative-draft-model-path."),
        ("block_mismatch", "Both --speculative-num-draft-tokens and --speculative-dflash-block-size are set"),
        ("window_too_small", "--speculative-draft-window-size must be >= --speculative-num-draft-tokens"),
        ("pp", "pp_size == 1"),
    ],
)
def test_hooked_resolution_still_rejects_what_sglang_rejects_for_other_reasons(probe, case, message):
    assert message in probe["hooked"][case].get("error", "")


def test_stock_dflash_attention_takes_the_triton_path_in_bf16(probe):
    stock = probe["stock"]["attention"]
    assert stock["flag"] is True
    assert "active drivers" in stock["bf16"]["error"]


def test_hooked_dflash_attention_runs_bf16_on_cpu_and_matches_fp32(probe):
    hooked = probe["hooked"]["attention"]
    assert hooked["flag"] is False
    assert hooked["bf16"]["max_err"] < 0.1  # bf16 rounding of O(1) q/k/v values


def test_stock_extend_kwargs_cast_embeds_to_bf16_whatever_the_model_dtype(probe):
    assert probe["stock"]["embeds"]["fp32"] == {"dtype": "torch.bfloat16", "exact": False, "embeds_untouched": True}


def test_hooked_extend_kwargs_keep_fp32_embeds_exact(probe):
    embeds = probe["hooked"]["embeds"]
    assert embeds["fp32"] == {"dtype": "torch.float32", "exact": True, "embeds_untouched": True}
    assert embeds["fp32_replace"] == {"dtype": "torch.float32", "exact": True, "embeds_untouched": True}
    # bf16 models keep SGLang's own result.
    assert embeds["bf16"] == probe["stock"]["embeds"]["bf16"]


def test_dflash_worker_record_stream_line(probe):
    assert probe["stock"]["worker"] == {"inside": "RuntimeError: unknown parameter type"}
    assert probe["hooked"]["worker"] == {"inside": "no-op"}


def test_draft_worker_backend_choice_needs_torch_native_in_sglangs_list(probe):
    assert probe["hooked"]["draft_backend"] == {"stock": "flashinfer", "hooked": "torch_native", "count": 1}


if __name__ == "__main__":
    result = _probe(sys.argv[1], sys.argv[2])
    print(json.dumps(result, default=str))
