"""The project's documents hold together: every relative link and every cited docs section exists.

Markdown links (`[text](path)`, `[text](path#anchor)`, `[text](#anchor)`, images too) in the
README, docs/ and the other READMEs must name a file of the repository, and an anchor a heading of
that file, slugged as GitHub renders it. Code and documents cite a docs page as
`docs/<page>.md, "<heading>"`; that page and heading must exist too, so a heading renamed in a page
shows up here instead of leaving a comment that points nowhere. Links to other sites are not
followed.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = ("supa_emu", "accelerator", "op_builder", "tests", "bench", "examples")  # the project's own code
DOCUMENTS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                    *(path for folder in FOLDERS for path in (ROOT / folder).rglob("README.md"))])
SOURCES = sorted(path for folder in FOLDERS for suffix in ("*.py", "*.cpp", "*.h") for path in (ROOT / folder).rglob(suffix))

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
# `docs/<page>.md` and, when a quoted heading follows the comma, that heading (comment leaders removed).
CITATION = re.compile(r"docs/([\w.-]+\.md)(?:,\s*\"([^\"]+)\")?")
COMMENT_LEADER = re.compile(r"\s*\n\s*(?:#+|//+|\*)?[ \t]*")


def _prose(text: str) -> str:
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = heading.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(path: pathlib.Path) -> list[str]:
    return [match.group(1) for match in HEADING.finditer(_prose(path.read_text()))]


def anchors(path: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for heading in headings(path):
        base = slug(heading)
        result.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return result


def _relative(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken_links(document: pathlib.Path) -> list[str]:
    broken = []
    for target in LINK.findall(_prose(document.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        linked = (document.parent / file_part).resolve() if file_part else document
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with that anchor in {_relative(linked)}")
    return broken


def broken_citations(path: pathlib.Path) -> list[str]:
    text = COMMENT_LEADER.sub(" ", path.read_text())
    broken = []
    for page, heading in CITATION.findall(text):
        cited = ROOT / "docs" / page
        if not cited.exists():
            broken.append(f"docs/{page}: no such page")
        elif heading and "<" not in heading and heading.replace("`", "") not in {h.replace("`", "") for h in headings(cited)}:
            broken.append(f'docs/{page}, "{heading}": no such heading')
    return broken


def test_the_documents_are_found():
    names = {_relative(path) for path in DOCUMENTS}
    assert {"README.md", "docs/configuration.md", "docs/real_stack.md", "tests/README.md"} <= names


@pytest.mark.parametrize("document", DOCUMENTS, ids=_relative)
def test_relative_links_resolve(document):
    assert broken_links(document) == []


def test_cited_docs_sections_exist():
    broken = {_relative(path): found for path in SOURCES + DOCUMENTS if (found := broken_citations(path))}
    assert broken == {}


def test_slugs_follow_github():
    assert slug("The native build and its cache") == "the-native-build-and-its-cache"
    assert slug("`brsmi`") == "brsmi"
    assert slug("torch_supa.contrib.module") == "torch_supacontribmodule"
    assert slug("Collectives: the uniform-rank rule") == "collectives-the-uniform-rank-rule"
    assert slug("What an operator's kernel allocates") == "what-an-operators-kernel-allocates"


def test_a_broken_link_and_a_missing_heading_are_reported(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## A section\n\n[ok](#a-section) [gone](#no-section) [file](missing.md)\n"
                    "```\n[in code](not-checked.md)\n```\n")
    assert broken_links(page) == [f"#no-section: no heading with that anchor in {page}",
                                  "missing.md: no such file"]
