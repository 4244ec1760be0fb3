"""One writer at a time: a folder held by one process (an exclusive `flock` on a lock file in it, kept open for the
process's life) and the owner record that says who holds it (host, pid, cluster, since when). The kernel lets go of
the lock when the process ends however it ends (kill -9 included), so a lock left by a dead process is simply free.
Shared by the cluster server (its run directory, each lineage's folder: cluster/lineage.py) and the laptop (`art-sky
demo` asks who runs in its folder before it removes the last run), so it imports only the shared modules.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import socket
import threading
import time
from pathlib import Path

from pydantic import BaseModel, ValidationError

from art_sky.files import atomic_write

OWNER_FORMAT = 1  # an owner record of another format (an older art-sky's) is named as such, never guessed at


class Owner(BaseModel):
    """Who writes a lineage (the owner json beside its lock, and the record under its store prefix)."""

    format: int = OWNER_FORMAT
    host: str
    pid: int
    cluster: str | None = None  # the cluster's name (ART_SKY_CLUSTER_NAME, or SkyPilot's), None when unnamed
    server: str  # the server's run directory (its log is server.log there), or its checkpoint root
    since: float  # when it took the lineage (seconds since the epoch)
    refreshed: float  # the store record's last refresh: stale once older than ART_SKY_OWNER_STALE_AFTER

    @classmethod
    def me(cls, cluster: str | None, server: str) -> Owner:
        now = time.time()
        return cls(host=socket.gethostname(), pid=os.getpid(), cluster=cluster, server=server, since=now, refreshed=now)

    def describe(self) -> str:
        since = datetime.datetime.fromtimestamp(self.since, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        cluster = f"cluster {self.cluster!r}, " if self.cluster else ""
        return f"{cluster}host {self.host}, pid {self.pid}, since {since}, server files in {self.server}"

    def same_process(self) -> bool:
        return self.host == socket.gethostname() and self.pid == os.getpid()

    def dead_here(self) -> bool:
        """Is it a process of this host that has ended? (Its records then need no waiting for.)"""
        return self.host == socket.gethostname() and not alive(self.pid)


class UnreadableOwner(ValueError):
    """An owner record that is not this art-sky's format: the message says what it is."""


def parse_owner(data: bytes | str, where: str) -> Owner:
    try:
        owner = Owner.model_validate_json(data)
    except ValidationError as exc:
        raise UnreadableOwner(
            f"the owner record {where} is not one this art-sky reads (garbled, or written by another art-sky "
            f"version: {str(exc).splitlines()[0]}); if no server of that lineage is running, delete it"
        ) from None
    if owner.format != OWNER_FORMAT:
        raise UnreadableOwner(
            f"the owner record {where} has format {owner.format} (this art-sky writes {OWNER_FORMAT}): it was "
            "written by another art-sky version; run one version on a lineage, or delete the record once no server "
            "of that lineage runs"
        )
    return owner


class Unlockable(OSError):
    """The filesystem refuses locks (some network filesystems): nothing there can tell two writers apart."""


_held: dict[str, int] = {}  # lock files this process holds -> their open descriptor (one per process, never closed)
_held_lock = threading.Lock()


def hold(lock_file: Path) -> None:
    """Hold `lock_file` exclusively for the rest of this process's life (again in the same process: already held).
    Raises BlockingIOError when another process holds it, Unlockable when the filesystem cannot lock."""
    key = os.path.realpath(lock_file)
    with _held_lock:
        if key in _held:
            return
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise
        except OSError as exc:
            os.close(fd)
            raise Unlockable(exc.errno, f"{lock_file.parent} cannot be locked ({exc.strerror})") from exc
        _held[key] = fd


def release(lock_file: Path) -> None:
    """Let go of a lock `hold` took (a registration that failed after taking its lineage's)."""
    with _held_lock:
        fd = _held.pop(os.path.realpath(lock_file), None)
    if fd is not None:
        os.close(fd)


def holds(lock_file: Path) -> bool:
    return os.path.realpath(lock_file) in _held


def held_by_another(lock_file: Path) -> bool:
    """Does another process hold `lock_file` now? (Asked without keeping it: False when the lock is free, ours, or
    the filesystem cannot lock.)"""
    if holds(lock_file) or not lock_file.exists():
        return False
    fd = os.open(lock_file, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing lets go of a lock taken here


def write_owner(path: Path, owner: Owner) -> None:
    atomic_write(path, owner.model_dump_json(indent=2))


def read_owner(path: Path) -> str:
    """The owner a folder's record names, as a phrase for a message (what it is, when it cannot be read)."""
    try:
        return parse_owner(path.read_bytes(), str(path)).describe()
    except FileNotFoundError:
        return "an art-sky server that has not written its owner record yet"
    except (OSError, UnreadableOwner) as exc:
        return str(exc)


def alive(pid: int) -> bool:
    """Is `pid` running (a zombie, dead but not yet reaped, is not)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
