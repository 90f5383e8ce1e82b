"""Reading README.md and docs/*.md as the docs tests need them: fenced blocks, code spans, paragraphs.

Just enough CommonMark for our own files: fences of three or more backticks or
tildes (indented under a list item or not), closed by a fence of the same
character at least as long; inline code spans; paragraphs and list items
separated by blank lines or a new bullet.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(?P<code>.+?)(?<!`)\1(?!`)")


def doc_files() -> list[Path]:
    """README.md, docs/*.md in name order, CONTRIBUTING.md: the pages a reader pastes from."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "CONTRIBUTING.md"]


@dataclass(frozen=True)
class Fenced:
    """One fenced code block of a Markdown file."""

    path: str          # relative to the repository, e.g. "docs/lock.md"
    line: int          # 1-based line of the opening fence
    info: str          # the info string: "python", "python fragment", "sh", ""
    source: str        # the block's text, the fence's indentation removed

    @property
    def language(self) -> str:
        return self.info.split()[0] if self.info.split() else ""


def fenced_blocks(path: Path) -> list[Fenced]:
    lines = path.read_text().splitlines()
    blocks: list[Fenced] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            closing = FENCE.match(lines[j])
            if closing and closing["fence"][0] == fence[0] and len(closing["fence"]) >= len(fence) \
                    and not closing["info"].strip():
                break
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        blocks.append(Fenced(str(path.relative_to(ROOT)), i + 1, opening["info"].strip(), "\n".join(body) + "\n"))
        i = j + 1
    return blocks


@dataclass(frozen=True)
class PythonBlock:
    """A ```python block, numbered by its place among the file's ```python blocks (fragments included)."""

    block: Fenced
    index: int

    @property
    def id(self) -> str:
        return f"{self.block.path}[{self.index}]"

    @property
    def fragment(self) -> bool:
        return self.block.info.split()[1:] == ["fragment"]


def python_blocks() -> list[PythonBlock]:
    found = []
    for path in doc_files():
        python = [block for block in fenced_blocks(path) if block.language == "python"]
        found += [PythonBlock(block, index) for index, block in enumerate(python)]
    return found


def prose(path: Path) -> str:
    """The file without its fenced blocks (each replaced by a blank line, so paragraphs stay apart)."""
    lines = path.read_text().splitlines()
    for block in fenced_blocks(path):
        end = block.line + block.source.count("\n")
        lines[block.line - 1:end + 1] = [""] * (end + 2 - block.line)
    return "\n".join(lines)


def paragraphs(text: str) -> list[str]:
    """Paragraphs and list items: split at blank lines and at each new bullet."""
    return [p for p in re.split(r"\n[ \t]*\n|\n(?=[ \t]*(?:[-*+]|\d+\.)[ \t])", text) if p.strip()]


def code_spans(text: str) -> list[str]:
    return [match["code"].strip() for match in CODE_SPAN.finditer(text.replace("\n", " "))]
