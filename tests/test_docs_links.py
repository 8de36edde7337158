"""Every relative link in the project's Markdown (README.md, docs/, the other READMEs) reaches a file that exists and,
with ``#anchor``, a heading of that file (GitHub's anchors: lower case, punctuation dropped, spaces to hyphens)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted({REPO / "README.md", *(REPO / "docs").glob("*.md"), *REPO.glob("*/README.md"),
                *REPO.glob("*/*/README.md"), *REPO.glob("tests/*/*/README.md")})
LINK = re.compile(r"(?<!`)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"(?ms)^```.*?^```")


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``page`` (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for title in re.findall(r"(?m)^#{1,6} (.*)$", FENCE.sub("", page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", re.sub(r"`", "", title).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        found.add(slug if count == 0 else f"{slug}-{count}")
        seen[slug] = count + 1
    return found


def links(page: Path) -> list[str]:
    return [target for target in LINK.findall(FENCE.sub("", page.read_text()))
            if not target.startswith(("http://", "https://", "mailto:"))]


def test_the_pages_are_found():
    names = {str(p.relative_to(REPO)) for p in PAGES}
    assert {"README.md", "docs/README.md", "docs/DESIGN.md", "docs/kueue.md", "localcluster/README.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_exists(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor} in {linked.relative_to(REPO)}")
    assert broken == []


def test_the_front_page_is_short_and_links_every_topic_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 160
    linked = {Path(t.partition("#")[0]).name for t in links(REPO / "README.md")}
    topics = {p.name for p in (REPO / "docs").glob("*.md")} - {"README.md"}
    benchmarks = {"operator-scale.md", "trainer-memory.md", "learning-robustness.md", "weight-sync.md",
                  "time-to-reward.md", "rollout-throughput.md", "chaos-soak.md"}  # write-ups, reached from docs/README.md and testing.md
    assert topics - linked <= benchmarks, topics - linked
