"""The documentation stays inside the repository: no link leaves it, every relative link resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md", ROOT / "CONTRIBUTING.md",
                ROOT / "benchmarks" / "README.md"])
# [text](target) and <img src=...>/<a href=...>; code spans and blocks are removed first.
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|(?:src|href)=\"([^\"]+)\"")
FENCE = re.compile(r"```.*?```", re.S)
CODE = re.compile(r"`[^`\n]*`")


def _links(page: Path) -> list[str]:
    text = CODE.sub("", FENCE.sub("", page.read_text()))
    return [a or b for a, b in LINK.findall(text)]


def test_pages_found():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "CONTRIBUTING.md", "docs/index.md", "docs/getting-started.md",
            "docs/performance.md", "docs/api.md"} <= names
    assert not (ROOT / "docs" / "CONTRACTS.md").exists()  # internal contracts are not published


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_stay_in_the_repository_and_resolve(page):
    text = page.read_text()
    assert "../shared" not in text and "/work/" not in text, f"{page} points outside the repository"
    for link in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link) or link.startswith("#"):
            continue  # an absolute URL (another site) or an anchor on this page
        target = (page.parent / link.split("#", 1)[0]).resolve()
        assert target.is_relative_to(ROOT), f"{page.name}: {link} leaves the repository"
        assert target.exists(), f"{page.name}: {link} does not resolve"
        if page.is_relative_to(ROOT / "docs"):
            # The site is built from docs/ alone: a page may link only inside it.
            assert target.is_relative_to(ROOT / "docs"), f"{page.name}: {link} leaves docs/"


def test_mkdocs_nav_lists_every_page():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "docs").rglob("*.md"):
        assert page.relative_to(ROOT / "docs").as_posix() in nav, f"{page} is not in mkdocs.yml's nav"
