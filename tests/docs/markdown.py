"""Reading the project's Markdown: fenced code blocks, links and heading anchors."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE_MARK = "<!-- runnable-dag -->"
_FENCE = re.compile(r"^(```+|~~~+)\s*(\S*)")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


@dataclass(frozen=True)
class CodeBlock:
    """A fenced block: its language, text, first line (1-based) and whether it is marked."""

    language: str
    text: str
    line: int
    runnable: bool


def markdown_files() -> list[Path]:
    """Every Markdown file of the project (not the virtualenv's, not the tests' own)."""
    skipped = {".venv", ".git", "node_modules", ".demo"}
    return sorted(
        path
        for path in ROOT.rglob("*.md")
        if not skipped.intersection(path.relative_to(ROOT).parts)
    )


def code_blocks(text: str) -> list[CodeBlock]:
    """The fenced blocks of a document; a block is runnable when the last non-blank line
    before its fence is the ``<!-- runnable-dag -->`` mark."""
    blocks: list[CodeBlock] = []
    lines = text.splitlines()
    previous = ""
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if not opening:
            previous = lines[index].strip() or previous
            index += 1
            continue
        fence, language = opening.groups()
        body: list[str] = []
        index += 1
        while index < len(lines) and not lines[index].startswith(fence):
            body.append(lines[index])
            index += 1
        start = index - len(body) + 1
        blocks.append(CodeBlock(language, "\n".join(body) + "\n", start, previous == RUNNABLE_MARK))
        previous = ""
        index += 1
    return blocks


def without_code(text: str) -> str:
    """The document with its fenced blocks blanked, so a link in code is no link."""
    kept: list[str] = []
    fence: str | None = None
    for line in text.splitlines():
        opening = _FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)
        elif fence is not None and line.startswith(fence):
            fence = None
        elif fence is None:
            kept.append(re.sub(r"`[^`]*`", "", line))
            continue
        kept.append("")
    return "\n".join(kept)


def links(text: str) -> list[str]:
    """Every link target of the document outside code."""
    return _LINK.findall(without_code(text))


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    plain = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", plain).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of every heading outside code (GitHub numbers repeated ones)."""
    found: set[str] = set()
    for line in without_code(text).splitlines():
        heading = _HEADING.match(line)
        if heading:
            base = anchor(heading.group(1))
            name, n = base, 0
            while name in found:
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found
