"""A full disk, said as such whichever layer ran out of room.

Python's own writes raise OSError with errno ENOSPC, but not every writer keeps the errno: torch.save raises
`RuntimeError: [enforce fail at inline_container.cc:...] . unexpected pos ...`, a trainer rank's failure arrives as
its message. So a failed write counts as a full disk when ENOSPC (or EDQUOT, a quota) is on its cause chain, or when
the filesystem it wrote to is (nearly) full at the moment it failed, before anything it wrote is removed. Shared:
the cluster's checkpoints and history, the laptop's downloads.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from art_sky.errors import DiskFullError

FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
NEARLY_FULL_BYTES = 16 << 20  # a write that failed with less free than this (and 5% of the disk) ran out of room


def disk_full(exc: BaseException, path: str | os.PathLike, advice: str = "") -> DiskFullError | None:
    """The DiskFullError to raise from `exc` (raised writing to `path`), or None when the disk is not why: it names
    the disk (its mount point), how much is free, and what to free (`advice`, or a generic sentence)."""
    usage = _usage(Path(path))
    if usage is None:
        return None
    free, total = usage
    if not (_errno_full(exc) or free < min(NEARLY_FULL_BYTES, total // 20)):
        return None
    mount = mount_point(Path(path))
    advice = advice or f"Free space on {mount} (or give the machine a bigger disk) and try again."
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return DiskFullError(
        f"the disk is full: writing {path} failed ({first_line[:200]}); {mount} has "
        f"{size_text(free)} free of {size_text(total)}. {advice}"
    )


def _errno_full(exc: BaseException | None) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in FULL_ERRNOS:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _usage(path: Path) -> tuple[int, int] | None:
    """Free bytes (for this user) and total bytes of the filesystem holding `path` (or its nearest existing parent)."""
    for candidate in (path, *path.parents):
        try:
            usage = shutil.disk_usage(candidate)
        except OSError:
            continue
        return usage.free, usage.total
    return None


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem holding `path`: the disk to free."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    while not os.path.ismount(path):
        path = path.parent
    return path


def size_text(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            break
        size /= 1024
    return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
