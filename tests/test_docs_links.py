"""Every relative Markdown link in the repository's documentation resolves: the file it names
exists, and a ``#fragment`` names a heading of that file (GitHub's anchors).

Links to ``http(s)://`` and ``mailto:`` are not followed; links inside code (fenced blocks and
inline backticks) are not links."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[1]
SKIP_DIRS = {"build", "dist", "venv", "node_modules", "__pycache__"}
SKIP_TOP = {"results"}  # the suites' output folder at the root (docs/results/ is documentation)

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def markdown_files(root: Path = REPO) -> list[Path]:
    """The repository's ``*.md`` files, outside hidden and build/output folders."""
    out = []
    for path in sorted(root.rglob("*.md")):
        parts = path.relative_to(root).parts[:-1]
        if parts and parts[0] in SKIP_TOP:
            continue
        if any(p.startswith(".") or p in SKIP_DIRS or p.endswith(".egg-info") for p in parts):
            continue
        out.append(path)
    return out


def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` outside fenced code blocks, with inline code removed."""
    lines, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((n, INLINE_CODE.sub("", line)))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lower-cased, punctuation dropped, spaces
    to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of one Markdown file (repeats get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            base = slug(m.group(2))
            k = seen.get(base, 0)
            seen[base] = k + 1
            out.add(base if k == 0 else f"{base}-{k}")
    return out


def broken_links(root: Path = REPO) -> list[str]:
    """``file:line: target (why)`` for every relative link that does not resolve."""
    bad = []
    cache: dict[Path, set[str]] = {}
    for md in markdown_files(root):
        for n, line in prose_lines(md.read_text(encoding="utf-8")):
            for target in LINK.findall(line):
                if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:, ...
                    continue
                file_part, _, fragment = target.partition("#")
                dest = (md.parent / unquote(file_part)).resolve() if file_part else md
                where = f"{md.relative_to(root)}:{n}: {target}"
                if not dest.exists():
                    bad.append(f"{where} (no such file)")
                elif fragment and dest.suffix == ".md":
                    if dest not in cache:
                        cache[dest] = anchors(dest)
                    if unquote(fragment).lower() not in cache[dest]:
                        bad.append(f"{where} (no heading with that anchor)")
    return bad


def test_every_relative_markdown_link_resolves():
    files = {p.relative_to(REPO).as_posix() for p in markdown_files()}
    assert {"README.md", "docs/results.md", "docs/results/uci.md", "docs/benchmarks/svi.md"} <= files
    bad = broken_links()
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_the_checker_sees_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "a.md").write_text(
        "# Title: one (`x`)\n\n## Twice\n## Twice\n\n"
        "[ok](b.md) [ok](#title-one-x) [ok](#twice-1) [ok](b.md#other-heading) "
        "[web](https://example.org/none.md) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n"
        "[gone](missing.md) [bad anchor](b.md#no-such) [bad self](#twice-2)\n"
    )
    (tmp_path / "b.md").write_text("# B\n\n## Other heading\n")
    bad = broken_links(tmp_path)
    assert [b.split(": ", 1)[1] for b in bad] == [
        "missing.md (no such file)",
        "b.md#no-such (no heading with that anchor)",
        "#twice-2 (no heading with that anchor)",
    ]


@pytest.mark.parametrize("heading, anchor", [
    ("Which methods a UCI reference resolves: distances in units of the reference's resolution",
     "which-methods-a-uci-reference-resolves-distances-in-units-of-the-references-resolution"),
    ("Deep ensembles and Laplace on UCI (`comparisons/uci_fast.toml`, issue 13)",
     "deep-ensembles-and-laplace-on-uci-comparisonsuci_fasttoml-issue-13"),
    ("On an NVIDIA H100 again (the issue-11 session of 2026-11-26, 17:28 UTC): the 100× target met end to end",
     "on-an-nvidia-h100-again-the-issue-11-session-of-2026-11-26-1728-utc-the-100-target-met-end-to-end"),
])
def test_anchors_follow_githubs_rule(heading, anchor):
    assert slug(heading) == anchor
