"""Writing files so that a reader never sees half of one, and reading a log's last lines. Used on both sides (the
cluster server, the laptop), so it imports nothing of art-sky.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def atomic_write(path: str | os.PathLike, data: str | bytes, *, private: bool = False) -> Path:
    """Write `data` to a temp file beside `path`, then rename it into place. `private`: readable by this user only
    (0600), from the first byte."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if private:
            os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


@contextmanager
def atomic_dir(target: str | os.PathLike, *, replace: bool = True) -> Iterator[Path]:
    """Yield a temp directory beside `target` to fill; when the block succeeds it is renamed to `target`, when it
    fails it is removed. An existing `target` is replaced, or with `replace=False` kept (another writer finished
    first with the same content)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        yield tmp
        if target.exists() and replace:
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if replace or not target.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def tail(path: str | os.PathLike, lines: int = 30) -> str:
    """The last `lines` lines of a text file, or a note that it does not exist yet."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:]) or "(empty log)"
    except OSError:
        return f"(no log at {path})"
