"""The Python code blocks of the README and the docs pages, with what the line above each says of it (the convention
in docs/development.md): `<!-- docs: run -->` (or `<!-- docs: run with cluster NAME -->`, a program for a cluster
`art-sky up NAME` started), executed by tests/test_docs_examples.py, or `<!-- docs: illustration: REASON -->`, not
run, for the reason given."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(
    r"<!-- docs: (?:(?P<run>run)(?: with cluster (?P<cluster>[A-Za-z0-9][A-Za-z0-9-]*))?"
    r"|illustration: (?P<reason>\S.*?)) -->"
)
FENCE = re.compile(r"(?P<indent> *)```python\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    marker: str  # the line above the fence
    code: str

    @property
    def runs(self) -> bool:
        match = MARKER.fullmatch(self.marker.strip())
        return bool(match and match["run"])

    @property
    def cluster(self) -> str | None:
        """The cluster a `run with cluster NAME` program uses (`python program.py NAME`), or None."""
        match = MARKER.fullmatch(self.marker.strip())
        return match["cluster"] if match else None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def is_program(self) -> bool:
        """A whole program (it starts its own event loop), run as a script rather than in the pages' namespace."""
        return "asyncio.run(" in self.code


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks = []
    for index, line in enumerate(lines):
        fence = FENCE.fullmatch(line)
        if not fence:
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == "```")
        indent = len(fence["indent"])
        code = "\n".join(body[indent:] for body in lines[index + 1 : end]) + "\n"
        blocks.append(Block(path, index + 1, lines[index - 1] if index else "", code))
    return blocks


def all_blocks() -> list[Block]:
    return [block for path in documents() for block in python_blocks(path)]
