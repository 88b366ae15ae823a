"""The project's documents hold together: every relative link and every cited docs section exists.

Markdown links (`[text](path)`, `[text](path#anchor)`, `[text](#anchor)`, images too) in the
README, docs/ and the other READMEs must name a file of the repository, and an anchor a heading of
that file, slugged as GitHub renders it. Code and documents cite a docs page as
`docs/<page>.md, "<heading>"`; that page and heading must exist too, so a heading renamed in a page
shows up here instead of leaving a comment that points nowhere. Links to other sites are not
followed. No committed file names a path of one developer's machine: examples show a placeholder.
"""

from __future__ import annotations

import pathlib
import re
import subprocess

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
# An absolute path inside a home, a worktree or a temporary directory: it names one developer's
# machine. Examples write a placeholder instead (`CHECKOUT_OF_<commit>`, `"$(mktemp -d)"`,
# `~/.cache`, `/home/<you>/...`, `$TMPDIR/...`); the bare system directories (`/tmp`) are no one's.
MACHINE_PATH = re.compile(r"(?<![\w.$/~-])/(?:home|Users|root|work|tmp|var/tmp|var/folders|private/tmp)"
                          r"/(?![<$])[^\s`'\"(),;|]+")


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


def machine_paths(text: str) -> list[str]:
    return MACHINE_PATH.findall(text)


def committed_files() -> list[pathlib.Path]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / name for name in listed.stdout.split("\0") if name]


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


def test_no_committed_file_names_a_path_of_a_developer_s_machine():
    found = {}
    for path in committed_files():
        if path == pathlib.Path(__file__).resolve() or not path.is_file():  # this file's examples below
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # binary data
            continue
        if paths := machine_paths(text):
            found[_relative(path)] = paths
    assert found == {}


def test_machine_paths_are_found_and_placeholders_are_not():
    assert machine_paths("bench/x.py --against /work/wt-13904 --rounds 3") == ["/work/wt-13904"]
    assert machine_paths("HOME=/tmp/coldhome bash; (/home/alice/src/x.py) `/root/.cache/supa_emu`") == [
        "/tmp/coldhome", "/home/alice/src/x.py", "/root/.cache/supa_emu"]
    assert machine_paths("--against CHECKOUT_OF_13904d9, HOME=\"$(mktemp -d)\", ~/.cache/supa_emu, a sticky /tmp, "
                         "/home/<you>/src, $TMPDIR/x, https://example.org/tmp/x, src/work/x.py") == []
