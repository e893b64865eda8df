"""The user's page, the design and the development notes link to each other: every relative link
and every #anchor in README.md, CHANGELOG.md and docs/*.md must lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where brackets are not links."""
    text = re.sub(r"(?ms)^```.*?^```", "", text)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (not ``_``), spaces to hyphens."""
    text = re.sub(r"[`*]|\[|\]\([^)]*\)", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a Markdown file's headings make (repeats get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in re.sub(r"(?ms)^```.*?^```", "", path.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_slug_follows_github():
    assert slug("The parent–rank protocol") == "the-parentrank-protocol"
    assert slug("Transformers `Trainer`, unchanged") == "transformers-trainer-unchanged"
    assert slug("Output, as you see it") == "output-as-you-see-it"
    assert slug("Working on dist_kernel") == "working-on-dist_kernel"  # GitHub keeps the underscore


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(doc: Path):
    broken = []
    for target in LINK.findall(_prose(doc.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not this repository's
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading makes #{anchor}")
    assert broken == []


def test_the_three_pages_link_to_each_other():
    readme, changelog = (ROOT / "README.md").read_text(), (ROOT / "CHANGELOG.md").read_text()
    arch, dev = (ROOT / "docs" / "architecture.md").read_text(), (ROOT / "docs" / "development.md").read_text()
    assert "docs/architecture.md" in readme and "docs/development.md" in readme and "CHANGELOG.md" in readme
    assert "../README.md" in arch and "development.md" in arch
    assert "../README.md" in dev and "architecture.md" in dev and "../CHANGELOG.md" in dev
    assert "## [Unreleased]" in changelog


def test_the_readme_starts_with_its_two_commands():
    """CI and the project brief run the README's first fenced block: set up, then test."""
    block = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert commands[0].startswith("python3 -m venv .venv && .venv/bin/pip install")
    assert any(".venv/bin/python -m pytest" in line for line in commands[1:])


def _links(doc: Path) -> set[Path]:
    """The files a document's relative links lead to."""
    targets = (t.partition("#")[0] for t in LINK.findall(_prose(doc.read_text())) if not re.match(r"[a-z]+:", t))
    return {(doc.parent / t).resolve() for t in targets if t}


def test_the_readme_is_the_users_page_of_at_most_400_lines():
    """The manuals (several machines, troubleshooting, GPUs, ...) live in docs/, one click away."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 400


def test_every_page_of_docs_is_linked_from_the_readme_and_listed_in_development():
    readme = _links(ROOT / "README.md")
    listed = _links(ROOT / "docs" / "development.md") | {(ROOT / "docs" / "development.md").resolve()}
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert {"several-machines.md", "troubleshooting.md", "gpu.md"} <= {p.name for p in pages}
    assert [p.name for p in pages if p.resolve() not in readme] == []
    assert [p.name for p in pages if p.resolve() not in listed] == []
    assert (ROOT / "benchmarks" / "README.md").resolve() in readme


def test_development_gives_the_readmes_test_command():
    """development.md's "everything" line is the README's second command after ruff and mypy."""
    block = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    (line,) = [line for line in block.splitlines() if ".venv/bin/python -m pytest" in line]
    tests = line[line.index(".venv/bin/python -m pytest"):]
    assert tests in (ROOT / "docs" / "development.md").read_text()


def test_the_fault_rules_are_written_once_and_architecture_lists_their_titles():
    """The rules live in fault_policy's docstring (``N. **Title.**``); architecture.md's "Faults"
    section lists their numbers and titles, and no more."""
    from dist_kernel.parent import fault_policy

    rules = re.findall(r"^(\d+)\. \*\*(.+?)\.\*\*", fault_policy.__doc__ or "", re.M)
    assert [int(n) for n, _ in rules] == list(range(1, len(rules) + 1)) and len(rules) >= 8
    faults = (ROOT / "docs" / "architecture.md").read_text().split("\n## Faults\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^(\d+)\. (.+)$", faults, re.M)
    assert listed == [(n, f"{title}.") for n, title in rules]
    assert "../dist_kernel/parent/fault_policy.py" in faults
