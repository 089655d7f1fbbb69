"""The package must import, and its PyTorch backends work, on a machine without Triton."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter where ``import triton`` raises ImportError (a None entry in sys.modules does that).
NO_TRITON_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["triton"] = None
    import torch
    from sglang_tts import kernels

    assert not kernels.triton_available()
    n, h, v = 3, 4, 10
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    teacher = torch.softmax(torch.randn(n, v), -1)
    loss = kernels.fused_linear_kl(hidden, weight, teacher, torch.ones(n))  # auto -> chunked
    loss.backward()
    ref = kernels.naive_linear_kl(hidden.detach(), weight.detach(), teacher, torch.ones(n))
    assert torch.allclose(loss, ref, rtol=1e-5), (loss, ref)
    d2t = torch.zeros(4, dtype=torch.long)
    probs, mask = kernels.gather_draft_probs(torch.randn(n, v), d2t)
    assert probs.shape == (n, 4) and mask.shape == (n,)
    for call in (
        lambda: kernels.fused_linear_kl(hidden, weight, teacher, torch.ones(n), backend="triton"),
        lambda: kernels.gather_draft_probs(torch.randn(n, v), d2t, backend="triton"),
    ):
        try:
            call()
        except RuntimeError as err:
            assert "triton" in str(err)
        else:
            raise AssertionError("backend='triton' without triton must raise")
    print("ok")
    """
)


def test_import_and_pytorch_backends_without_triton() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", NO_TRITON_SCRIPT],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")
