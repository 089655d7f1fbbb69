"""The README is a front page (two commands first, under 15 KB) and no relative link is broken."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_opens_with_the_two_commands_and_stays_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) < 15 * 1024
    first_block = text.split("```")[1]
    assert "bash scripts/setup_env.sh && .venv/bin/python scripts/demo.py" in first_block
    assert ".venv/bin/python -m pytest tests -q" in first_block
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/setup_env.sh" in ci and "-m pytest tests -q" in ci  # CI runs what the README says


def test_every_relative_link_resolves():
    broken = []
    for page in _pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # external or in-page
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    unlinked = [p.name for p in (ROOT / "docs").glob("*.md") if f"(docs/{p.name})" not in readme]
    assert not unlinked, unlinked
