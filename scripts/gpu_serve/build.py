#!/usr/bin/env python
"""Build the GPU serving run's wheelhouse (.gpukit/, git-ignored) on a machine that reaches PyPI.

The GPU machine has python 3.12, torch 2.11 (cu130), triton 3.6 and transformers 5.17, but no SGLang,
no sglang-kernel and no network. This puts in .gpukit/whl:
- the wheels of wheels.txt (cp312 manylinux or pure Python): what SGLang 0.5.23 imports at module level
  that the GPU image lacks;
- SGLang 0.5.23 repacked as py3-none-any without its compiled parts (the Rust extensions, which the run
  does not use: SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python) and without sglang/multimodal_gen.
The sgl_kernel / flash_mla stand-ins and the plugin dist-infos are tracked (scripts/gpu_serve/standin) and
travel with the tree. Prints the wheelhouse's size and what a device call carrying it would send.

    .venv/bin/python scripts/gpu_serve/build.py            # about 26 MiB, a minute with a warm pip cache
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
KIT = REPO / ".gpukit"
SGLANG_VERSION = "0.5.23"
STRIPPED_NAME = f"sglang-{SGLANG_VERSION}-py3-none-any.whl"
# pip matches manylinux tags exactly: every glibc level a cp312 x86_64 wheel of the list may carry.
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
    "any",
)
TARGET_PYTHON = "3.12"
MIB = 1024 * 1024
# Left out of the repacked SGLang: compiled extensions (built for one Python, unused by the run) and the
# diffusion server (multimodal_gen, a third of the wheel, never imported when serving text models).
DROP_PREFIXES = ("sglang/multimodal_gen/",)
DROP_SUFFIXES = (".so",)


def target_platform_args(python_version: str = TARGET_PYTHON) -> list[str]:
    """pip flags that select wheels for the GPU machine's interpreter, whatever runs pip."""
    args = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


@dataclass
class StripReport:
    kept_files: int
    kept_bytes: int  # uncompressed
    dropped_files: int
    dropped_bytes: int
    dropped_compiled: list[str]  # the .so files left out


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def strip_sglang_wheel(src: Path, dst: Path, compresslevel: int = 6) -> StripReport:
    """Repack SGLang's wheel `src` as a pure-Python wheel `dst` (py3-none-any) without compiled parts."""
    kept_files = kept_bytes = dropped_files = dropped_bytes = 0
    compiled: list[str] = []
    record_rows: list[list[str]] = []
    record_name = None
    dst.parent.mkdir(parents=True, exist_ok=True)
    with (
        zipfile.ZipFile(src) as zin,
        zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=compresslevel) as zout,
    ):
        for info in zin.infolist():
            name = info.filename
            if name.endswith(".dist-info/RECORD"):
                record_name = name
                continue
            if name.startswith(DROP_PREFIXES) or name.endswith(DROP_SUFFIXES):
                dropped_files += 1
                dropped_bytes += info.file_size
                if name.endswith(DROP_SUFFIXES):
                    compiled.append(name)
                continue
            data = zin.read(name)
            if name.endswith(".dist-info/WHEEL"):
                data = (
                    b"Wheel-Version: 1.0\nGenerator: sglang-tts gpu_serve\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
                )
            zout.writestr(info, data)
            record_rows.append([name, _record_hash(data), str(len(data))])
            kept_files += 1
            kept_bytes += len(data)
        if record_name is None:
            raise ValueError(f"{src} has no .dist-info/RECORD: not a wheel")
        record_rows.append([record_name, "", ""])
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(record_rows)
        zout.writestr(record_name, buf.getvalue())
    return StripReport(kept_files, kept_bytes, dropped_files, dropped_bytes, compiled)


def read_wheel_list(path: Path = HERE / "wheels.txt") -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def _normalise(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def wheel_project(filename: str) -> str:
    """The normalised project name of a wheel file (`pydantic_core-2.50.5-cp312-...whl` -> `pydantic_core`)."""
    return _normalise(filename.split("-", 1)[0])


def download(requirements: Sequence[str], dest: Path, python: str = sys.executable) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [python, "-m", "pip", "download", "-qq", "--no-deps", *target_platform_args(), "-d", str(dest), *requirements]
    subprocess.run(cmd, check=True)


def sglang_wheel(cache: Path = REPO / ".cache" / "wheels") -> Path:
    """SGLang's wheel: the one scripts/setup_env.sh keeps, else downloaded for the GPU machine. Its Python
    sources are the same for every interpreter; only the compiled parts, which are dropped, differ."""
    found = sorted(cache.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not found:
        download([f"sglang=={SGLANG_VERSION}"], cache)
        found = sorted(cache.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    return found[0]


def prune(whl_dir: Path, wanted: Sequence[str]) -> list[str]:
    """Remove wheels of projects not in `wanted` or of another version (two versions stop the install)."""
    pins = {_normalise(r.split("==")[0]): r.split("==")[1] for r in wanted}
    pins[_normalise("sglang")] = SGLANG_VERSION
    removed = []
    for wheel in sorted(whl_dir.glob("*.whl")):
        project, version = wheel_project(wheel.name), wheel.name.split("-")[1]
        if pins.get(project) != version or (project == "sglang" and wheel.name != STRIPPED_NAME):
            wheel.unlink()
            removed.append(wheel.name)
    return removed


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build(kit: Path = KIT) -> dict:
    whl = kit / "whl"
    wanted = read_wheel_list()
    print(f"[build] {len(wanted)} dependency wheels for cp{TARGET_PYTHON.replace('.', '')} into {whl}", flush=True)
    download(wanted, whl)
    source = sglang_wheel()
    print(f"[build] repacking {source.name} without compiled parts", flush=True)
    report = strip_sglang_wheel(source, whl / STRIPPED_NAME)
    removed = prune(whl, wanted)
    wheels = sorted(whl.glob("*.whl"))
    missing = sorted({_normalise(r.split("==")[0]) for r in wanted} - {wheel_project(w.name) for w in wheels})
    if missing:
        raise SystemExit(f"[build] no wheel for: {', '.join(missing)}")
    manifest = {
        "sglang": SGLANG_VERSION,
        "python": TARGET_PYTHON,
        "source_wheel": source.name,
        "strip": asdict(report),
        "removed_stale": removed,
        "wheels": {w.name: w.stat().st_size for w in wheels},
    }
    (kit / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kit", type=Path, default=KIT, help="output folder (git-ignored; default .gpukit)")
    ap.add_argument("--print-target-args", action="store_true", help="print pip's flags for the GPU's python, exit")
    args = ap.parse_args(argv)
    if args.print_target_args:  # run.sh --cpu installs the wheelhouse for python 3.12 with these
        print(" ".join(target_platform_args()))
        return 0
    manifest = build(args.kit)
    strip = manifest["strip"]
    print(
        f"[build] SGLang repacked: {strip['kept_files']} files kept, {strip['dropped_files']} dropped "
        f"({strip['dropped_bytes'] / MIB:.0f} MiB uncompressed, {len(strip['dropped_compiled'])} compiled)"
    )
    print(f"[build] {len(manifest['wheels'])} wheels, {folder_bytes(args.kit) / MIB:.1f} MiB in {args.kit}")
    sys.path.insert(0, str(HERE))
    from travel import format_size, measure

    print("[build] what a device call carrying .gpukit sends now (travel.py size):")
    print(format_size(measure(REPO, [str(args.kit.resolve().relative_to(REPO))])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
