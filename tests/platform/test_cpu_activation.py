"""The CPU layer activates only where SGLang's native kernels are missing.

Both cases are simulated in fresh interpreters: with a (fake) real `sgl_kernel` importable the
plugin must leave stock SGLang untouched; without one it must supply the stand-in and hooks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent(
    """
    import json, os, sys
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang_tts.platform import cpu
    active = cpu.install()
    import sgl_kernel
    print(json.dumps({
        "active": active,
        "cpu_engine": os.environ.get("SGLANG_USE_CPU_ENGINE"),
        "shim_on_path": str(cpu.SHIM_DIR) in sys.path,
        "standin": bool(getattr(sgl_kernel, "SGLANG_TTS_CPU_STANDIN", False)),
        "hooks": sorted(t for t, hs in HookRegistry._hooks.items() if hs),
    }))
    """
)


def _probe(tmp_path, fake_real_kernel: bool) -> dict:
    drop = ("SGLANG_USE_CPU_ENGINE", "SGLANG_TTS_CPU_SUPPORT", "TRITON_INTERPRET")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    if fake_real_kernel:
        pkg = tmp_path / "site" / "sgl_kernel"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("REAL = True\n")
        env["PYTHONPATH"] = str(tmp_path / "site")
    else:
        env.pop("PYTHONPATH", None)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_real_kernels_present_leaves_sglang_untouched(tmp_path):
    result = _probe(tmp_path, fake_real_kernel=True)
    assert result == {"active": False, "cpu_engine": None, "shim_on_path": False, "standin": False, "hooks": []}


def test_missing_kernels_activate_cpu_layer(tmp_path):
    result = _probe(tmp_path, fake_real_kernel=False)
    assert result["active"] is True
    assert result["cpu_engine"] == "1"
    assert result["shim_on_path"] is True
    assert result["standin"] is True
    assert "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend" in result["hooks"]
    assert "sglang.srt.speculative.draft_utils.DraftBackendFactory.create_decode_backend" in result["hooks"]
    assert "sglang.srt.speculative.draft_utils.DraftBackendFactory.create_draft_extend_backend" in result["hooks"]
    assert "sglang.srt.speculative.eagle_utils._verify_uses_greedy" in result["hooks"]
    assert "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply" in result["hooks"]
    assert "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head" in result["hooks"]
