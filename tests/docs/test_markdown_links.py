"""Every link from one of the project's documents to another file or section resolves."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.docs.markdown import ROOT, anchor, anchors, links, markdown_files


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """The local links of ``path`` whose file or heading does not exist, each with why."""
    broken = []
    for target in links(path.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        file_part, _, fragment = target.partition("#")
        linked = (path.parent / unquote(file_part)).resolve() if file_part else path
        shown = os.path.relpath(linked, root)
        if not linked.exists():
            broken.append(f"{target}: no file {shown}")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked.read_text()):
            broken.append(f"{target}: no heading #{fragment} in {shown}")
    return broken


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_local_links_resolve(path):
    assert broken_links(path) == []


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# A release, step by step (PostgreSQL)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-release-step-by-step-postgresql) [gone](missing.md) "
        "[wrong](other.md#nowhere) `[code](ignored.md)` [web](https://example.org/x.md)\n"
        "## Here\n[self](#here) [nothere](#there)\n"
    )
    found = [line.split(":")[0] for line in broken_links(page, tmp_path)]
    assert found == ["missing.md", "other.md#nowhere", "#there"]


def test_anchor_follows_github():
    assert anchor("A release, step by step (PostgreSQL)") == "a-release-step-by-step-postgresql"
    assert anchor("CLI: dp-budget") == "cli-dp-budget"
    assert anchor("The ledger (no Airflow needed)") == "the-ledger-no-airflow-needed"
    assert anchor("The history: keyed chains") == "the-history-keyed-chains"
