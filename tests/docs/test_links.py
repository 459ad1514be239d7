"""Every relative link in README.md and docs/*.md names a file of the repository, and every #anchor one of that
file's headings (GitHub's heading ids: lower case, punctuation dropped, spaces as hyphens, -1, -2 ... for repeats)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
BLOCKS = re.compile(r"```.*?```", re.S)
SPANS = re.compile(r"`[^`\n]*`")  # code spans hold no links (they may hold `f[grid](*args)`)


def heading_ids(page: Path) -> set[str]:
    ids, seen = set(), {}
    for line in BLOCKS.sub("", page.read_text()).splitlines():
        if not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        ids.add(slug if n == 0 else f"{slug}-{n}")
    return ids


def test_heading_ids_follow_githubs_rules(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Multi-GPU: DDP on 2 × H200 (2026-11-29)\n## `llama_small`, four backends\n## Setup\n## Setup\n")
    assert heading_ids(page) == {"multi-gpu-ddp-on-2--h200-2026-11-29", "llama_small-four-backends", "setup",
                                 "setup-1"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(SPANS.sub("", BLOCKS.sub("", page.read_text()))):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in heading_ids(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)
