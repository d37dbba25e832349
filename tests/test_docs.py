"""The documents' tables of contents: every section listed, every link landing on a heading.

A page that opens with a list of links to its own sections (``- [title](#anchor)``, before its
first ``## `` heading) must list every ``## `` section, and each anchor must be one GitHub makes
of a heading of the page (``##`` or ``###``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
LINK = re.compile(r"\[[^\]]+\]\(#([^)]+)\)")


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def sections(text: str) -> tuple[list[str], list[str]]:
    """(the anchors of the ## headings, of every ## and ### heading), outside code blocks."""
    top, every, fenced = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^(##|###) (.+)$", line)):
            every.append(slug(m.group(2)))
            if m.group(1) == "##":
                top.append(slug(m.group(2)))
    return top, every


def contents(text: str) -> list[str] | None:
    """The anchors linked from the list before the first ## heading, or None without one."""
    head = text.split("\n## ", 1)[0]
    items = [line for line in head.splitlines() if re.match(r"^\s*- \[", line)]
    if not items:
        return None
    return [a for line in items for a in LINK.findall(line)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_contents_list_every_section_and_each_link_lands(page: Path) -> None:
    text = page.read_text()
    listed = contents(text)
    if listed is None:
        pytest.skip(f"{page.name} has no contents list")
    top, every = sections(text)
    assert [s for s in top if s not in listed] == [], f"{page.name}: sections not listed"
    assert [a for a in listed if a not in every] == [], f"{page.name}: links to no heading"


def test_slug_as_github_makes_it() -> None:
    assert slug("Plain values: in the dict, or in `mpickpt.Values`") == \
        "plain-values-in-the-dict-or-in-mpickptvalues"
    assert slug("The node-local level: ls --local and drain") == \
        "the-node-local-level-ls---local-and-drain"


def test_the_code_table_of_format_md_names_every_module_and_only_modules_that_exist():
    """docs/format.md's "The code" lists every module of mpickpt/ by its path (cli/'s in one
    row), and no path that is not a module."""
    text = (REPO / "docs" / "format.md").read_text()
    table = text[text.index("## The code"):]
    table = table[:table.index("\n## ")] if "\n## " in table else table
    cells = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    named = {p for cell in cells for p in re.findall(r"`([\w/]+\.py)`", cell)}
    package = REPO / "mpickpt"
    modules = {str(p.relative_to(package)) for p in package.rglob("*.py")
               if p.name != "__init__.py" and p.parent.name != "cli"}
    assert modules - named == set(), "modules missing from docs/format.md's table"
    assert {p for p in named if not (package / p).exists()} == set(), "no such modules"
