"""The README's API example runs as written and does what its comments say; the README stays short
and, with the docs pages, links only to files (and headings) that exist."""

import re
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 400
_EXTERNAL = ("http://", "https://", "mailto:")


def test_api_example_runs():
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - our own README
    cache, out = scope["cache"], scope["out"]
    assert out.shape == (2, 4, 5, 8)
    # Rows were 5 and 3 tokens long in layer 0; rollback(2) then swapping the rows.
    np.testing.assert_array_equal(cache.layer(0).lengths, [1, 3])
    assert cache.layer(0).window == 4 and cache.max_rollback == 2


def test_readme_commands_match_ci():
    ci = (README.parent / ".ci" / "run").read_text()
    test_command = "bash scripts/setup.sh test && .venv/bin/python -m pytest -q"
    assert test_command in README.read_text() and test_command in ci


def _unfenced(page: Path) -> str:
    """The page without its fenced code blocks (indented ones included)."""
    return re.sub(r"^[ \t]*```.*?^[ \t]*```", "", page.read_text(), flags=re.S | re.M)


def _prose(page: Path) -> str:
    """The page without code: no fenced blocks, no inline code spans (no links live there)."""
    return re.sub(r"`[^`\n]*`", "", _unfenced(page))


def _links(page: Path) -> list[str]:
    """Every inline link and image target of the page that is not an external address."""
    targets = re.findall(r"\]\(([^)\s]+)\)", _prose(page))
    return [t for t in targets if not t.startswith(_EXTERNAL)]


def _anchors(page: Path) -> set[str]:
    """The page's heading anchors as GitHub writes them (a repeated heading gets -1, -2, ...)."""
    headings = re.findall(r"^#+ (.+)$", _unfenced(page), re.M)
    seen: Counter = Counter()
    anchors = set()
    for heading in headings:
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
        seen[slug] += 1
    return anchors


def _broken(page: Path, target: str) -> str | None:
    """Why ``target`` (a link on ``page``) points nowhere, or None when it resolves."""
    path, _, anchor = target.partition("#")
    where = f"{page.parent.name}/{page.name}"
    resolved = (page.parent / path).resolve() if path else page
    if not resolved.exists():
        return f"{where}: {target} (no file {resolved})"
    if anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
        return f"{where}: {target} (no heading #{anchor} in {resolved.name})"
    return None


def test_readme_stays_under_400_lines():
    lines = len(README.read_text().splitlines())
    assert lines < MAX_README_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_every_relative_link_points_to_an_existing_file_and_heading():
    assert DOCS, "docs/*.md is empty"
    broken = [why for page in [README, *DOCS] for target in _links(page) if (why := _broken(page, target))]
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in _links(README)}
    unlinked = [page.name for page in DOCS if page.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_link_checks_see_links_images_and_anchors(tmp_path):
    """The helpers find inline links and images outside code, and GitHub's heading anchors."""
    page = tmp_path / "page.md"
    page.write_text("# A `b` (c)\n## A b c\n[x](other.md#a-b-c) ![y](fig.png) `[z](code.md)`\n"
                    "[w](https://example.com)\n```\n[v](fenced.md)\n# not a heading\n```\n"
                    "- item\n  ```python\n  # not a heading either [u](indented.md)\n  ```\n")
    assert _links(page) == ["other.md#a-b-c", "fig.png"]
    assert _anchors(page) == {"a-b-c", "a-b-c-1"}
    assert _broken(page, "#a-b-c-1") is None
    assert "no heading #nope" in _broken(page, "#nope")
    assert "no file" in _broken(page, "fig.png")
