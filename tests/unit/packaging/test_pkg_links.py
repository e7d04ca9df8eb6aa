"""Every link in the user docs leads somewhere: relative Markdown links in README.md, docs/ and
the package READMEs name files that exist, and every docs/<name>.md a source file cites exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
MARKDOWN = sorted([REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("*/README.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")
SOURCES = [p for pattern in ("hicache_operator/**/*.py", "cache_runtime/**/*.py", "kernels/**/*", "tests/**/*.py",
                             "bench/**/*.py", "scripts/*", "charts/**/*.yaml", "manifests/**/*.yaml", "Dockerfile")
           for p in REPO.glob(pattern) if p.is_file()]


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same page
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            broken.append(target)
    assert not broken, f"{doc.relative_to(REPO)} links to missing files: {broken}"


def test_cited_docs_exist():
    cited = {(src.relative_to(REPO), m) for src in SOURCES
             for m in re.findall(r"(?<![\w/.])docs/[\w.-]+\.md", src.read_text(errors="ignore"))}
    missing = sorted((str(src), m) for src, m in cited if not (REPO / m).exists())
    assert not missing, missing
