"""Writing files so that a reader never sees half of one, and reading a log's last lines. Used on both sides (the
cluster server, the laptop), so it imports only the shared modules.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from art_sky.disk_full import disk_full


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


TEMP_PREFIX = ".tmp-"  # atomic_dir's work in progress; `remove_stale_temps` removes those of dead writers


@contextmanager
def atomic_dir(target: str | os.PathLike, *, replace: bool = True, advice: str = "") -> Iterator[Path]:
    """Yield a temp directory beside `target` to fill; when the block succeeds its files are flushed to disk and it
    is renamed to `target` (a reader, or a restart after a crash, sees all of it or nothing), when it fails it is
    removed. An existing `target` is replaced, or with `replace=False` kept (another writer finished first with the
    same content). A write that fails on a full disk raises DiskFullError (with `advice`: what to free), decided
    before the temp directory is removed.

    The writer holds a lock on the temp directory until it is done, so `remove_stale_temps` can tell the leftovers
    of a killed writer (the lock died with it) from another process's write in progress.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{target.name}-", dir=target.parent))
    lock = os.open(tmp, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield tmp
            _sync_tree(tmp)
        except Exception as exc:
            if full := disk_full(exc, target, advice):  # measured while what it wrote is still there
                raise full from exc
            raise
        if target.exists() and replace:
            old = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{target.name}-old-", dir=target.parent))
            os.replace(target, old)  # the old copy goes aside in one rename, never half-deleted in place
            os.rename(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.rename(tmp, target)
            except OSError:
                if replace or not target.exists():
                    raise
        _sync(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(lock)


def remove_stale_temps(directory: str | os.PathLike) -> list[Path]:
    """Remove what killed `atomic_dir` writers left in `directory` (a write in progress elsewhere is kept); returns
    what was removed."""
    removed: list[Path] = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(TEMP_PREFIX) or not entry.is_dir():
            continue
        try:
            fd = os.open(entry, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its writer is alive
        finally:
            os.close(fd)
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def _sync_tree(root: Path) -> None:
    """Every file under `root` and the directories holding them written to disk, not only to the cache: one syncfs
    of the filesystem holding `root` (Linux: one call however many files), else an fsync of each."""
    if _syncfs(root):
        return
    for directory, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _sync(Path(directory))


@functools.cache
def _libc_syncfs() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):  # not Linux
        return None


def _syncfs(path: Path) -> bool:
    syncfs = _libc_syncfs()
    if syncfs is None:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        if syncfs(fd) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"syncfs: {os.strerror(code)}", str(path))
        return True
    finally:
        os.close(fd)


def _sync(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tail(path: str | os.PathLike, lines: int = 30) -> str:
    """The last `lines` lines of a text file, or a note that it does not exist yet."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:]) or "(empty log)"
    except OSError:
        return f"(no log at {path})"
