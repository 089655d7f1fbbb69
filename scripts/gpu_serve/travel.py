#!/usr/bin/env python
"""What travels to the GPU machine, and leaving the shipped drafters behind for a run.

The device tool copies the working tree: tracked files, untracked files git does not ignore, and the
ignored paths a call names in `carry`, at most 64 MiB in all. The shipped drafters
(sglang_tts/drafters/shipped/, about 68 MiB) alone are over that, and the committed benchmark results
(docs/results/, 36 MiB on 2026-12-04 and growing) would leave too little room for the wheelhouse. The GPU
run reads neither (it builds tiny models on the spot), so a session moves them out of the working tree for
the run and back afterwards:

    .venv/bin/python scripts/gpu_serve/travel.py size              # what would travel now (+ .gpukit)
    .venv/bin/python scripts/gpu_serve/travel.py leave             # move the drafters to a cache folder
    # device run, carry [".gpukit"]: bash scripts/gpu_serve/run.sh
    .venv/bin/python scripts/gpu_serve/travel.py restore           # put them back, whatever happened

The git index is never touched (no `git rm`, no assume-unchanged or skip-worktree bits): while the
drafters are away `git status` shows them deleted, and a commit made then with `-a` or `add -A` would
delete them, so `leave` refuses to run twice and `restore` follows the run at once. `restore` moves the
files back from the cache folder; what the cache lacks (a lost cache, a half-done move) is restored from
git with `git checkout -- PATH`, which writes the working tree only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIMIT_BYTES = 64 * 1024 * 1024  # the device tool's limit on what travels
# What a GPU run leaves behind: the shipped drafters and the committed benchmark results, neither read by it.
LEAVE_PATHS = ("sglang_tts/drafters/shipped", "docs/results")
CARRY_PATHS = (".gpukit",)  # what it carries (scripts/gpu_serve/build.py writes it)
MANIFEST = "travel.json"
MIB = 1024 * 1024


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def _files(repo: Path, *args: str) -> list[str]:
    return [p for p in git(repo, "ls-files", "-z", *args).split("\0") if p]


def _bytes(path: Path) -> int:
    if path.is_symlink() or not path.exists():
        return 0  # a link travels as a link; a tracked file missing from the tree does not travel
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


@dataclass
class TravelSize:
    tracked: int  # tracked files present in the working tree
    untracked: int  # untracked files git does not ignore
    carried: dict[str, int]  # each carried path (0 when absent)
    by_folder: dict[str, int] = field(default_factory=dict)  # tracked + untracked, by top two folder levels

    @property
    def total(self) -> int:
        return self.tracked + self.untracked + sum(self.carried.values())

    @property
    def fits(self) -> bool:
        return self.total <= LIMIT_BYTES


def measure(repo: Path = REPO, carry: Sequence[str] = CARRY_PATHS) -> TravelSize:
    """Bytes that a device call carrying `carry` would send from `repo`'s working tree."""
    by_folder: dict[str, int] = defaultdict(int)
    sizes = {}
    for kind, args in (("tracked", ()), ("untracked", ("--others", "--exclude-standard"))):
        total = 0
        for rel in _files(repo, *args):
            n = _bytes(repo / rel)
            total += n
            by_folder["/".join(rel.split("/")[:2]) if "/" in rel else "."] += n
        sizes[kind] = total
    carried = {c: _bytes(repo / c) for c in carry}
    return TravelSize(sizes["tracked"], sizes["untracked"], carried, dict(by_folder))


def format_size(size: TravelSize, top: int = 8) -> str:
    rows = [("tracked files", size.tracked), ("untracked, not ignored", size.untracked)]
    rows += [(f"carried {name}", n) for name, n in size.carried.items()]
    rows += [("total", size.total)]
    verdict = "fits" if size.fits else "TOO LARGE (travel.py leave moves the shipped drafters and docs/results out)"
    lines = [f"{label:<24} {n / MIB:7.1f} MiB" for label, n in rows]
    lines[-1] += f" of {LIMIT_BYTES / MIB:.0f} MiB: {verdict}"
    lines.append("largest folders:")
    for folder, n in sorted(size.by_folder.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {folder:<40} {n / MIB:7.1f} MiB")
    return "\n".join(lines)


def default_cache(repo: Path) -> Path:
    """A folder outside the repository, one per checkout."""
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    tag = hashlib.sha1(str(repo.resolve()).encode()).hexdigest()[:10]
    return base / "sglang_tts" / "travel" / f"{repo.name}-{tag}"


class TravelError(RuntimeError):
    pass


def leave(repo: Path, cache: Path, paths: Sequence[str] = LEAVE_PATHS, force: bool = False) -> list[str]:
    """Move `paths` from the working tree into `cache` (outside the repository); returns the paths moved.

    Refuses when an earlier leave was not restored, or (unless `force`) when a path has uncommitted
    changes, which a lost cache could not give back."""
    cache = cache.resolve()
    if cache.is_relative_to(repo.resolve()):
        raise TravelError(f"the cache folder {cache} is inside the repository: it would travel")
    if (cache / MANIFEST).exists():
        raise TravelError(f"an earlier leave was not restored ({cache / MANIFEST}): run `travel.py restore` first")
    if not force:
        dirty = git(repo, "status", "--porcelain", "--", *paths).strip()
        if dirty:
            raise TravelError(f"uncommitted changes under {', '.join(paths)} (commit them, or --force):\n{dirty}")
    present = [p for p in paths if (repo / p).exists()]
    cache.mkdir(parents=True, exist_ok=True)
    manifest = {
        "repo": str(repo.resolve()),
        "head": git(repo, "rev-parse", "HEAD").strip(),
        "left_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "paths": present,
    }
    (cache / MANIFEST).write_text(json.dumps(manifest, indent=1))  # first: restore knows what to expect
    for rel in present:
        target = cache / "tree" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(repo / rel), str(target))
    return present


def _merge_back(src: Path, dst: Path) -> None:
    """Move `src` (file or folder) to `dst`; where `dst` already has a file, the tree's copy is kept."""
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(src), str(dst))
        return
    if src.is_dir() and dst.is_dir():
        for child in src.iterdir():
            _merge_back(child, dst / child.name)


@dataclass
class RestoreReport:
    moved_back: list[str]
    from_git: list[str]  # tracked files the cache lacked, written by `git checkout --`
    still_missing: list[str]  # tracked files neither could give back (none, unless git fails too)
    clean: bool  # `git status` shows nothing under the restored paths

    def __str__(self) -> str:
        return json.dumps(asdict(self), indent=1)


def restore(repo: Path, cache: Path, paths: Sequence[str] = LEAVE_PATHS) -> RestoreReport:
    """Put back what `leave` moved, whatever state the cache and the tree are in. Idempotent."""
    cache = cache.resolve()
    manifest_path = cache / MANIFEST
    left = list(paths)
    if manifest_path.exists():
        left = sorted(set(left) | set(json.loads(manifest_path.read_text()).get("paths", [])))
    moved = []
    for rel in left:
        src = cache / "tree" / rel
        if src.exists():
            _merge_back(src, repo / rel)
            moved.append(rel)
    missing = [p for p in _files(repo, "--deleted", "--", *left)]
    from_git = []
    if missing:
        git(repo, "checkout", "--", *missing)  # the working tree only: the index is not written
        from_git = missing
    still = _files(repo, "--deleted", "--", *left)
    clean = not git(repo, "status", "--porcelain", "--", *left).strip()
    if not still:
        shutil.rmtree(cache / "tree", ignore_errors=True)
        manifest_path.unlink(missing_ok=True)
    return RestoreReport(moved, from_git, still, clean)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("command", choices=("size", "leave", "restore"))
    ap.add_argument("--repo", type=Path, default=REPO)
    ap.add_argument("--cache", type=Path, default=None, help="where left paths wait (default: under ~/.cache)")
    ap.add_argument("--carry", nargs="*", default=list(CARRY_PATHS), help="carried paths counted by `size`")
    ap.add_argument("--force", action="store_true", help="leave even with uncommitted changes under the paths")
    ap.add_argument("--json", action="store_true", help="`size`: print JSON")
    args = ap.parse_args(argv)
    repo = args.repo.resolve()
    cache = args.cache or default_cache(repo)
    try:
        if args.command == "size":
            size = measure(repo, args.carry)
            if args.json:
                print(json.dumps({**asdict(size), "total": size.total, "fits": size.fits, "limit": LIMIT_BYTES}))
            else:
                print(format_size(size))
            return 0 if size.fits else 1
        if args.command == "leave":
            moved = leave(repo, cache, force=args.force)
            print(f"left behind in {cache}: {', '.join(moved) or 'nothing (already absent)'}")
            print("git status shows them deleted until `travel.py restore`; commit nothing with -a or add -A meanwhile")
            print(format_size(measure(repo, args.carry)))
            return 0
        report = restore(repo, cache)
        print(report)
        return 0 if report.clean and not report.still_missing else 1
    except (TravelError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else ""
        print(f"travel.py {args.command}: {exc}{(': ' + detail) if detail else ''}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
