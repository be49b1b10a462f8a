"""Every relative link in the README and the docs leads somewhere: the file exists, and an anchor names one of its
headings (GitHub's slugs). Moving a section breaks no link unseen."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted(
    [ROOT / "README.md", ROOT / "sdk" / "README.md", *(ROOT / "docs").rglob("*.md"), ROOT / "bench" / "RESULTS.md"]
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to hyphens."""
    text = re.sub(r"`|\*\*?", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        base = slug(line.lstrip("#"))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks hold no links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]  # http:, https:, mailto: are not ours


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_a_file_and_a_heading(doc):
    broken = []
    for target in links(doc):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: {broken}"


def test_the_checks_catch_a_broken_link(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text("# Top `x` part\n\n[ok](#top-x-part) [bad](#nowhere) [gone](missing.md)\n")
    assert links(doc) == ["#top-x-part", "#nowhere", "missing.md"]
    assert anchors(doc) == {"top-x-part"}
