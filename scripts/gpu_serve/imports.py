#!/usr/bin/env python
"""Import SGLang's serving modules and load the plugins as a GPU server process does, and report.

On the GPU machine (run.sh, before any server starts) this fails in seconds where a server would fail in
minutes: a wheel missing from .gpukit, a name the stand-ins lack, the plugin's SGLang check. With
--fake-cuda, on a machine without CUDA, torch answers the CUDA queries SGLang's imports read as an H200
would, so SGLang takes its CUDA branches at import (the CPU rehearsal of the same step; nothing runs on
the faked device). Checked: SGLang takes its CUDA path; sgl_kernel is the stand-in (or a real one); both
plugins load (TTS registered, SGLang's internals as sglang_tts.sglang.compat declares them for a GPU
machine, the CPU layer off). Reported, not required: what the gpu_serve plugin routed, and whether each
routed op runs through SGLang's own bindings (on CPU tensors under --fake-cuda, on the GPU otherwise); the
installed distributions the imports used, and which of them are neither in the GPU image's list
(image_packages.txt) nor in the wheelhouse (wheels.txt): on CPU, a package the GPU machine would lack.

    python3 scripts/gpu_serve/imports.py --json $OUT/imports.json           # run.sh does this
    .venv/bin/python scripts/gpu_serve/imports.py --fake-cuda               # needs the stand-ins on PYTHONPATH
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# What a server process imports to serve a Llama-family target with EAGLE-3 or DFlash on CUDA.
SERVING_MODULES = (
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tp_worker",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.sampler",
    "sglang.srt.speculative.eagle_worker_v2",
    "sglang.srt.speculative.eagle_draft_cuda_graph_runner",
    "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner",
    "sglang.srt.speculative.dflash_worker_v2",
    "sglang.srt.speculative.eagle_utils",
    "sglang.srt.speculative.dflash_utils",
    "sglang.srt.models.llama",
    "sglang.srt.models.llama_eagle3",
    "sglang.srt.models.dflash",
    "sglang.srt.models.qwen2",
    "sglang.srt.models.qwen3",
)
# What a server process imports lazily on CUDA while it builds the model (after the plugins load): each must
# import, from SGLang or from a stand-in the gpu_serve plugin installed. Found on the first GPU run: Llama's MLP
# imports the CuTe-DSL dual GEMM (which needs cutlass) in its constructor.
MODEL_BUILD_MODULES = ("sglang.kernels.ops.gemm.cutedsl_dual_gemm",)
FAKE_DEVICE = "NVIDIA H200 (faked for imports)"
HERE = Path(__file__).resolve().parent
# Imported from the checkout or the stand-ins, not from an installed distribution.
LOCAL_MODULES = {"sglang_tts", "sglang_tts_gpu_serve", "gpu_serve_missing", "sgl_kernel", "flash_mla"}


def _names(path: Path) -> set[str]:
    """Normalised project names of a requirements-style list (comments and pins dropped)."""
    lines = (line.split("#", 1)[0].split("==", 1)[0].strip() for line in path.read_text().splitlines())
    return {_normalise(line) for line in lines if line}


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def imported_distributions() -> dict[str, str]:
    """Installed distributions whose top-level modules this process imported (the standard library and the
    checkout's own modules left out), with their versions."""
    from importlib.metadata import packages_distributions, version

    owners = packages_distributions()
    found: dict[str, str] = {}
    for top in {name.partition(".")[0] for name in list(sys.modules)}:
        if top in sys.stdlib_module_names or top in LOCAL_MODULES or top.startswith("_"):
            continue
        for dist in owners.get(top, []):
            try:
                found[dist] = version(dist)
            except Exception:  # a distribution without metadata
                found[dist] = "?"
    return dict(sorted(found.items()))


# Imported here only because they are installed (each import site catches ImportError), or loaded as a plugin of
# .venv's: absent on the GPU machine, and nothing there needs them.
OPTIONAL = {
    "mistral-common": "sglang/srt/entrypoints/openai/serving_chat.py: try/except ImportError",
    "pycountry": "mistral_common's",
    "pydantic-extra-types": "mistral_common's",
    "watchfiles": "uvicorn/supervisors/__init__.py: try/except ImportError",
    "zstandard": "httpx and urllib3: optional decoders (SGLang's own use is off by default)",
    "smg-grpc-servicer": "an SGLang plugin installed in .venv, not on the GPU machine",
}


def not_on_gpu_machine(distributions: dict[str, str]) -> list[str]:
    """Distributions in neither the GPU image's list (image_packages.txt) nor the wheelhouse (wheels.txt), nor
    known to be optional (OPTIONAL)."""
    there = _names(HERE / "image_packages.txt") | _names(HERE / "wheels.txt") | {"sglang"} | set(OPTIONAL)
    return sorted(d for d in distributions if _normalise(d) not in there)


def fake_cuda() -> None:
    """Answer what SGLang's imports ask torch about CUDA as a Hopper GPU would (is_cuda() needs
    torch.cuda.is_available() and torch.version.cuda). Nothing can run on the faked device."""
    import torch

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.get_device_name = lambda device=None: FAKE_DEVICE
    torch.version.cuda = "13.0"


@dataclass
class ImportReport:
    ok: bool = False
    fake_cuda: bool = False
    device: str = ""
    sglang: str = ""  # version and where it was imported from
    sglang_compiled_files: int = 0  # .so files in that SGLang (0 for the repacked wheel)
    is_cuda: bool = False
    sgl_kernel: str = ""  # "stand-in" or the real package's path
    sgl_kernel_names_bound: list[str] = field(default_factory=list)
    modules: dict[str, float] = field(default_factory=dict)  # module -> seconds since start when imported
    plugins: list[str] = field(default_factory=list)
    tts_registered: bool = False
    cpu_layer_active: bool | None = None
    compat_ok: bool = False
    compat_differences: list[str] = field(default_factory=list)
    routed: list[str] = field(default_factory=list)
    routed_ops_ran: dict[str, str] = field(default_factory=dict)  # op -> "ok" or the error
    model_build_modules: dict[str, str] = field(default_factory=dict)  # module -> "sglang" or "stand-in"
    distributions: dict[str, str] = field(default_factory=dict)  # every installed distribution imported -> version
    not_on_gpu_machine: list[str] = field(default_factory=list)  # of those, in neither the image nor the wheelhouse
    error: str = ""
    seconds: float = 0.0


def _run_routed_ops(device: str) -> dict[str, str]:
    """Call what the gpu_serve plugin routed, through SGLang's own module bindings, on tiny inputs."""
    import torch
    from sglang.srt.speculative import eagle_utils

    results: dict[str, str] = {}
    probs = torch.softmax(torch.randn(3, 16, device=device), -1)

    def attempt(name: str, fn) -> None:
        try:
            fn()
            results[name] = "ok"
        except Exception as exc:  # reported
            results[name] = f"{type(exc).__name__}: {exc}"

    def renorm() -> None:
        kept = eagle_utils.top_k_renorm_prob(probs, torch.tensor([1, 2, 16], device=device))
        assert int((kept[0] > 0).sum()) == 1 and torch.allclose(kept.sum(-1), torch.ones(3, device=device))
        eagle_utils.top_p_renorm_prob(probs, torch.tensor([0.5, 0.9, 1.0], device=device))

    def sample_chain() -> None:
        # One request, a chain of 3 drafted tokens (+ the root); the target is sure of every drafted token.
        draft = 4
        candidates = torch.tensor([[5, 6, 7, 8]], device=device)
        target = torch.zeros(1, draft, 16, device=device)
        for i in range(draft - 1):
            target[0, i, int(candidates[0, i + 1])] = 1.0
        target[0, draft - 1, 9] = 1.0
        predicts = torch.full((draft,), -1, dtype=torch.int32, device=device)
        accept_index = torch.full((1, draft), -1, dtype=torch.int32, device=device)
        accept_num = torch.zeros(1, dtype=torch.int32, device=device)
        eagle_utils.tree_speculative_sampling_target_only(
            predicts=predicts,
            accept_index=accept_index,
            accept_token_num=accept_num,
            candidates=candidates,
            retrive_index=torch.arange(draft, device=device)[None],
            retrive_next_token=torch.tensor([[1, 2, 3, -1]], device=device),
            retrive_next_sibling=torch.full((1, draft), -1, device=device),
            uniform_samples=torch.full((1, draft), 0.5, device=device),
            uniform_samples_for_final_sampling=torch.full((1,), 0.5, device=device),
            target_probs=target,
            draft_probs=torch.zeros_like(target),
        )
        assert int(accept_num[0]) == draft - 1, f"accepted {int(accept_num[0])} of {draft - 1} sure tokens"
        assert predicts.tolist() == [6, 7, 8, 9], predicts.tolist()

    def tree_verify() -> None:
        # SGLang's Triton greedy verify through the routed binding: a chain whose third draft the target rejects.
        from sglang.kernels.ops.speculative import tree

        long = {"dtype": torch.int64, "device": device}
        predicts = torch.zeros(4, dtype=torch.int32, device=device)
        accept_index = torch.full((1, 4), -1, dtype=torch.int32, device=device)
        accept_num = torch.zeros(1, dtype=torch.int32, device=device)
        tree.verify_tree_greedy(
            predicts=predicts,
            accept_index=accept_index,
            accept_token_num=accept_num,
            candidates=torch.tensor([[5, 6, 7, 8]], **long),
            retrive_index=torch.arange(4, **long)[None],
            retrive_next_token=torch.tensor([[1, 2, 3, -1]], **long),
            retrive_next_sibling=torch.full((1, 4), -1, **long),
            target_predict=torch.tensor([[6, 7, 99, 100]], **long),
        )
        assert int(accept_num[0]) == 2 and predicts.tolist()[:3] == [6, 7, 99], (accept_num, predicts)

    routed = " ".join(sys.modules["sglang_tts_gpu_serve"].ROUTED) if "sglang_tts_gpu_serve" in sys.modules else ""
    if "top_k_renorm_prob" in routed:
        attempt("top_k/top_p renorm", renorm)
    if "tree_speculative_sampling_target_only" in routed:
        attempt("tree_speculative_sampling_target_only", sample_chain)
    if "verify_tree_greedy" in routed:
        attempt("verify_tree_greedy (Triton)", tree_verify)
    return results


def run(fake: bool) -> ImportReport:
    report = ImportReport(fake_cuda=fake)
    start = time.perf_counter()
    try:
        if fake:
            fake_cuda()
        import torch

        report.device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        for name in SERVING_MODULES:
            importlib.import_module(name)
            report.modules[name] = round(time.perf_counter() - start, 2)
        import sglang
        from sglang.srt.utils import is_cuda

        sglang_dir = Path(sglang.__file__).parent
        report.sglang = f"{sglang.__version__} at {sglang_dir}"
        report.sglang_compiled_files = sum(1 for _ in sglang_dir.rglob("*.so"))
        report.is_cuda = bool(is_cuda())
        import sgl_kernel

        standin = getattr(sgl_kernel, "SGLANG_TTS_GPU_STANDIN", False)
        report.sgl_kernel = "stand-in" if standin else str(Path(sgl_kernel.__file__).parent)

        from importlib.metadata import entry_points

        from sglang.srt.plugins import load_plugins

        report.plugins = sorted(f"{ep.name} = {ep.value}" for ep in entry_points(group="sglang.srt.plugins"))
        load_plugins()  # both plugins' register(), then HookRegistry.apply_hooks()
        from sglang.srt.speculative.spec_registry import get_spec

        from sglang_tts.platform import cpu
        from sglang_tts.sglang import compat

        for name in MODEL_BUILD_MODULES:
            module = importlib.import_module(name)
            report.model_build_modules[name] = "stand-in" if getattr(module, "SGLANG_TTS_GPU_STANDIN", 0) else "sglang"
        report.tts_registered = get_spec("TTS") is not None
        report.cpu_layer_active = cpu._installed
        compat_report = compat.check(compat.register_scopes(cpu_active=False))
        report.compat_ok = compat_report.ok
        report.compat_differences = [str(d) for d in compat_report.differences]
        if "sglang_tts_gpu_serve" in sys.modules:
            report.routed = list(sys.modules["sglang_tts_gpu_serve"].ROUTED)
        report.routed_ops_ran = _run_routed_ops("cpu" if fake else "cuda")
        report.distributions = imported_distributions()
        report.not_on_gpu_machine = not_on_gpu_machine(report.distributions)
        if standin:
            report.sgl_kernel_names_bound = sorted(sys.modules["gpu_serve_missing"].BOUND)
        # The routed ops are reported, not required: a sampled-verify op that fails here fails the serving
        # check's sampled requests, after its greedy ones have run.
        report.ok = report.is_cuda and report.tts_registered and not report.cpu_layer_active and report.compat_ok
    except BaseException as exc:  # SystemExit too: the plugin's SGLang check raises one
        report.error = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:]
    report.seconds = round(time.perf_counter() - start, 1)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fake-cuda", action="store_true", help="answer torch's CUDA queries as an H200 (CPU rehearsal)")
    ap.add_argument("--json", type=Path, default=None, help="write the report here")
    args = ap.parse_args(argv)
    if args.fake_cuda:
        os.environ.setdefault("SGLANG_TTS_CPU_SUPPORT", "0")  # the CPU layer would take the faked machine for a CPU
        os.environ.setdefault("TRITON_INTERPRET", "1")  # a routed Triton kernel then runs on CPU tensors
    report = run(args.fake_cuda)
    data: dict[str, Any] = asdict(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1))
    keys = ("ok", "device", "sglang", "is_cuda", "sgl_kernel", "tts_registered", "routed", "not_on_gpu_machine")
    summary = {k: data[k] for k in keys}
    print(json.dumps(summary, indent=1))
    print(f"imports: {len(report.modules)} modules, {len(report.sgl_kernel_names_bound)} sgl_kernel names bound, "
          f"routed ops {report.routed_ops_ran or 'none'}, {report.seconds} s")  # fmt: skip
    if report.error:
        print(report.error, file=sys.stderr)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
