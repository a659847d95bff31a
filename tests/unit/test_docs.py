"""Links into docs/*.md resolve: every `docs/<file>.md#<anchor>` cited in iscore's code and every
in-page link of the docs names a heading that exists, with GitHub's anchor rules."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# Anchors the docstrings cite or are meant to cite: renaming one of these headings breaks links.
STABLE_ANCHORS = {
    "corrections.md": (
        "notation",
        "catalogue",
        "token-tis",
        "sequence-tis",
        "geometric-tis",
        "icepop",
        "token-mask",
        "sequence-mask",
        "geometric-mask",
        "seq-mask-tis",
        "outlier-veto",
        "kl-mask",
        "batch-normalization",
        "current-policy-is",
        "bypass",
        "cispo",
        "numerics",
        "exponent-clamp",
        "clamp-before-or-after-aggregating",
        "float32-overflow",
        "float32-comparisons",
        "loss-aggregation",
        "effective-lr-scale",
        "frameworks",
        "verl",
        "skyrl",
        "nemo-rl",
        "slime",
        "areal",
        "openrlhf",
        "trl",
        "fireworks",
        "mismatch-diagnostics",
    ),
}

_CITATION = re.compile(r"docs/([\w.-]+\.md)#([\w-]+)")
_IN_PAGE = re.compile(r"\]\(#([\w-]+)\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: lower case, punctuation dropped, spaces to hyphens.

    >>> slug("### `token-tis`"[4:]), slug("Loss aggregation"), slug("NeMo-RL")
    ('token-tis', 'loss-aggregation', 'nemo-rl')
    """
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts by its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings (repeats get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else _HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def _citations() -> list[tuple[str, str, str]]:
    """(where, file, anchor) for every docs/<file>.md#<anchor> in iscore's code."""
    out = []
    for path in sorted((ROOT / "iscore").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for match in _CITATION.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            out.append((f"{path.relative_to(ROOT)}:{line}", match.group(1), match.group(2)))
    return out


@pytest.mark.parametrize(("where", "name", "anchor"), _citations() or [("none", "", "")])
def test_code_citations_resolve(where: str, name: str, anchor: str) -> None:
    if not name:
        pytest.skip("no docs/<file>.md#<anchor> citation in iscore/ yet")
    path = DOCS / name
    assert path.is_file(), f"{where} cites docs/{name}, which does not exist"
    assert anchor in anchors(path), f"{where} cites docs/{name}#{anchor}: no such heading"


@pytest.mark.parametrize("path", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_in_page_links_resolve(path: Path) -> None:
    missing = set(_IN_PAGE.findall(path.read_text(encoding="utf-8"))) - anchors(path)
    assert not missing, f"{path.name} links to missing anchors: {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(STABLE_ANCHORS))
def test_stable_anchors_exist(name: str) -> None:
    missing = set(STABLE_ANCHORS[name]) - anchors(DOCS / name)
    assert not missing, f"docs/{name} lost the headings of {sorted(missing)}"
