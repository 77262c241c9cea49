"""Every relative link in README.md and docs/*.md leads somewhere: the file exists and, for a
`#anchor`, the target page has a heading with that anchor (as GitHub makes them)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(?:(?!\n\s*\n)[\s\S])*?\1")  # may wrap, not past a paragraph
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The text outside code blocks and code spans (a link there is not a link)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(page: Path) -> list[str]:
    """The relative links of one page that lead nowhere, each with why."""
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):
            continue  # http:, https:, mailto: ...
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_somewhere(page: Path) -> None:
    assert broken_links(page) == []


def test_the_readme_links_every_docs_page() -> None:
    """The README is the table of contents: every page under docs/ is linked from it."""
    readme = set(LINK.findall(prose((ROOT / "README.md").read_text())))
    linked = {t.partition("#")[0] for t in readme}
    assert {f"docs/{p.name}" for p in PAGES[1:]} <= linked


@pytest.mark.parametrize(("text", "expected"), [
    ("[ok](b.md)", []),
    ("[ok](b.md#a-heading)", []),
    ("[ok](#local-one)", []),
    ("[ok](https://example.com/x.md)", []),
    ("`[not a link](nowhere.md)`", []),
    ("`a span that\nwraps [not a link](nowhere.md)`", []),
    ("```\n[not a link](nowhere.md)\n```", []),
    ("[gone](nowhere.md)", ["nowhere.md: no such file"]),
    ("[gone](b.md#no-such)", ["b.md#no-such: no heading with that anchor"]),
    ("[gone](#nope)", ["#nope: no heading with that anchor"]),
])
def test_the_check_finds_broken_links(tmp_path: Path, text: str, expected: list[str]) -> None:
    (tmp_path / "b.md").write_text("# B\n\n## A heading\n")
    page = tmp_path / "a.md"
    page.write_text(f"# A\n\n## Local one\n\n{text}\n")
    assert broken_links(page) == expected


@pytest.mark.parametrize(("heading", "anchor"), [
    ("Routing and `kvgate replay`", "routing-and-kvgate-replay"),
    ("Browser clients (CORS)", "browser-clients-cors"),
    ("`kvgate replay`: compare policies", "kvgate-replay-compare-policies"),
    ("Several gateways: one brain", "several-gateways-one-brain"),
    ("Load-ramp at 262,144: four gateways", "load-ramp-at-262144-four-gateways"),
])
def test_slug_is_githubs(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor
