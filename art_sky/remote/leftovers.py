"""What a cluster leaves on its machine after `down` (a venv, checkpoints, its folder), how big it is, and removing
it (`art-sky down NAME --purge`), over a command runner.

A backend names the paths (`Leftover`s) and which of them other clusters of the machine still use (`shared_with`):
those are kept by a purge and said to be, since art-sky cannot tell whose they are (the checkpoints of a host's
clusters share one root).
"""

from __future__ import annotations

import posixpath
import shlex

from pydantic import BaseModel

from .runner import CommandRunner


class Leftover(BaseModel):
    what: str  # in words: "venv", "checkpoints", "clusters/box"
    path: str  # absolute, on the machine
    size: int = 0  # bytes (du's)
    kept_because: str | None = None  # why a purge keeps it (other clusters use it); None: a purge removes it


def measure(runner: CommandRunner, items: list[Leftover]) -> list[Leftover]:
    """The items that exist on the machine, with their sizes."""
    if not items:
        return []
    q = shlex.quote
    script = "".join(f"[ -e {q(i.path)} ] && du -sk {q(i.path)} 2>/dev/null | cut -f1 || echo -\n" for i in items)
    sizes = runner.run(script, timeout=120, check=False).stdout.split()
    return [
        item.model_copy(update={"size": int(size) * 1024})
        for item, size in zip(items, sizes, strict=False)
        if size.isdigit()
    ]


def purge(runner: CommandRunner, items: list[Leftover], empty_dirs: list[str]) -> list[Leftover]:
    """Remove the items no other cluster uses, then `empty_dirs` (deepest first) where nothing else is left in them;
    returns what was removed."""
    gone = [item for item in items if item.kept_because is None]
    q = shlex.quote
    script = "".join(f"rm -rf {q(item.path)}\n" for item in gone)
    script += "".join(f"rmdir {q(path)} 2>/dev/null\n" for path in empty_dirs) + "exit 0\n"
    runner.run(script, timeout=600)
    return gone


def subfolders(runner: CommandRunner, path: str) -> list[str]:
    """The names of the folders in `path` on the machine (none if it is not there)."""
    listing = runner.run(
        f'cd {shlex.quote(path)} 2>/dev/null && for d in */; do [ -d "$d" ] && echo "${{d%/}}"; done',
        timeout=60,
        check=False,
    )
    return [line for line in listing.stdout.splitlines() if line]


def inside(path: str, folder: str) -> bool:
    return posixpath.commonpath([posixpath.normpath(path), posixpath.normpath(folder)]) == posixpath.normpath(folder)


def size_text(size: int) -> str:
    """Bytes as `du -h` would say them, in decimal units: 5.9 GB, 120 MB, 4 KB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}" if size < 10 * scale else f"{size / scale:.0f} {unit}"
    return f"{max(1, round(size / 1e3))} KB"


def summary(items: list[Leftover]) -> str:
    """`venv 5.9 GB, checkpoints 120 MB, clusters/box 3 MB`."""
    return ", ".join(f"{item.what} {size_text(item.size)}" for item in items)
