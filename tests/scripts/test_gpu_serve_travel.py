"""scripts/gpu_serve/travel.py: what travels to the GPU machine; leaving paths behind and restoring them,
on a temporary git repository, without ever writing git's index."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from scripts_testing import load_script

travel = load_script("gpu_serve/travel", "gpu_serve_travel")

SHIPPED = "sglang_tts/drafters/shipped"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    (root / SHIPPED / "a").mkdir(parents=True)
    (root / SHIPPED / "a" / "model.safetensors").write_bytes(b"\1" * 300_000)
    (root / SHIPPED / "a" / "config.json").write_text('{"kind": "eagle3"}')
    (root / SHIPPED / "b.json").write_text("{}")
    (root / "code.py").write_text("print('hi')\n")
    (root / ".gitignore").write_text("/.gpukit/\n")
    (root / ".gpukit").mkdir()
    (root / ".gpukit" / "w.whl").write_bytes(b"\0" * 1000)
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    return root


def _index_state(repo: Path) -> tuple[str, str]:
    """The index as git stores it (entries with their flags: `ls-files -v` prints h/S for assume-unchanged
    and skip-worktree) and the staged diff."""
    return _git(repo, "ls-files", "-v", "--stage"), _git(repo, "diff", "--cached", "--stat")


def test_size_counts_tracked_untracked_and_carried_files(repo: Path) -> None:
    (repo / "new.txt").write_text("x" * 50)
    size = travel.measure(repo, [".gpukit", "absent"])
    assert size.untracked == 50
    assert size.carried == {".gpukit": 1000, "absent": 0}
    on_disk = sum(p.stat().st_size for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts)
    assert size.tracked == on_disk - 50 - 1000  # less the untracked and the ignored (carried) file
    assert size.by_folder["sglang_tts/drafters"] > 300_000
    assert size.fits and size.total < travel.LIMIT_BYTES


def test_leave_and_restore_never_touch_the_index(repo: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    index_before = _index_state(repo)
    original = (repo / SHIPPED / "a" / "model.safetensors").read_bytes()
    before = travel.measure(repo, [])

    assert travel.leave(repo, cache) == [SHIPPED]
    assert not (repo / SHIPPED).exists()
    assert (cache / "tree" / SHIPPED / "a" / "model.safetensors").exists()
    assert travel.measure(repo, []).tracked == before.tracked - 300_000 - len('{"kind": "eagle3"}') - 2
    assert _index_state(repo) == index_before  # the files show as deleted in the tree, the index is as it was
    status = _git(repo, "status", "--porcelain").splitlines()
    assert status and all(line.startswith(" D ") for line in status)  # deleted in the tree, nothing staged
    with pytest.raises(travel.TravelError, match="not restored"):
        travel.leave(repo, cache)  # a second leave would overwrite the first one's manifest

    report = travel.restore(repo, cache)
    assert report.moved_back == [SHIPPED] and report.from_git == [] and report.clean and not report.still_missing
    assert (repo / SHIPPED / "a" / "model.safetensors").read_bytes() == original
    assert _index_state(repo) == index_before
    assert not (cache / travel.MANIFEST).exists()
    assert travel.restore(repo, cache).clean  # idempotent


def test_restore_falls_back_to_git_when_the_cache_is_lost_or_partial(repo: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    travel.leave(repo, cache)
    (cache / "tree" / SHIPPED / "a" / "model.safetensors").unlink()  # a half-done move, a cleaned cache
    report = travel.restore(repo, cache)
    assert report.from_git == [f"{SHIPPED}/a/model.safetensors"]
    assert report.clean and (repo / SHIPPED / "b.json").exists()

    travel.leave(repo, cache)
    shutil.rmtree(cache)  # the whole cache gone
    report = travel.restore(repo, cache)
    assert sorted(report.from_git) == sorted(_git(repo, "ls-files", SHIPPED).split())
    assert report.clean and not _git(repo, "status", "--porcelain")


def test_untracked_files_travel_back_through_the_cache(repo: Path, tmp_path: Path) -> None:
    (repo / SHIPPED / "new-drafter").mkdir()
    (repo / SHIPPED / "new-drafter" / "model.safetensors").write_bytes(b"\2" * 10)
    travel.leave(repo, tmp_path / "cache", force=True)
    assert not (repo / SHIPPED).exists()
    travel.restore(repo, tmp_path / "cache")
    assert (repo / SHIPPED / "new-drafter" / "model.safetensors").read_bytes() == b"\2" * 10


def test_leave_refuses_uncommitted_changes_and_a_cache_inside_the_repo(repo: Path, tmp_path: Path) -> None:
    (repo / SHIPPED / "b.json").write_text('{"edited": true}')
    with pytest.raises(travel.TravelError, match="uncommitted changes"):
        travel.leave(repo, tmp_path / "cache")
    assert (repo / SHIPPED / "b.json").exists()
    with pytest.raises(travel.TravelError, match="inside the repository"):
        travel.leave(repo, repo / ".cache" / "travel", force=True)


def test_the_command_line_reports_and_exits_by_the_outcome(repo: Path, tmp_path: Path, capsys) -> None:
    cache = str(tmp_path / "cache")
    assert travel.main(["size", "--repo", str(repo)]) == 0
    assert "fits" in capsys.readouterr().out
    assert travel.main(["leave", "--repo", str(repo), "--cache", cache]) == 0
    assert travel.main(["leave", "--repo", str(repo), "--cache", cache]) == 2
    assert travel.main(["restore", "--repo", str(repo), "--cache", cache]) == 0
    assert not _git(repo, "status", "--porcelain")


def test_the_default_cache_is_outside_the_checkout() -> None:
    assert not travel.default_cache(travel.REPO).resolve().is_relative_to(travel.REPO)


# The wheelhouse scripts/gpu_serve/build.py writes (26.2 MiB on 2026-11-28) with room for a few more wheels.
WHEELHOUSE_ALLOWANCE = 30 * 1024 * 1024


def test_this_checkout_fits_once_the_left_paths_are_away() -> None:
    """What a GPU run sends from this repository (tracked files outside LEAVE_PATHS, plus the wheelhouse)
    stays under the device tool's limit: a folder that grows past it must join LEAVE_PATHS, or shrink."""
    tracked = [p for p in _git(travel.REPO, "ls-files", "-z").split("\0") if p]
    staying = [p for p in tracked if not any(p == left or p.startswith(left + "/") for left in travel.LEAVE_PATHS)]
    sent = sum((travel.REPO / p).stat().st_size for p in staying if (travel.REPO / p).is_file())
    assert sent + WHEELHOUSE_ALLOWANCE <= travel.LIMIT_BYTES, f"{sent / travel.MIB:.1f} MiB of tracked files travel"
