"""The children the server starts (vLLM's server, torchrun and its ranks): starting one, a free port for one, and
stopping one.

Starting one (`start_child`): the one way, for every child. It leads a process group of its own and gets SIGTERM
when the thread that started it ends, the server's death by kill -9 included (Linux's PR_SET_PDEATHSIG), so no
child outlives its server. The signal is set in the child by a few lines of Python that then exec the command, not
by subprocess's `preexec_fn`, which can deadlock a threaded server.

Stopping a child the server started (vLLM's server, torchrun and its ranks, on the head and on a worker node): each
leads a process group of its own (`start_new_session=True`), and one sequence stops every one of them, with the same
grace, whatever of the group is left: SIGTERM to the group, SIGKILL to what remains of it after the grace, the child
reaped. A group already gone, or a child that ended while the rest of its group lives on, is no error.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

STOP_GRACE = 10.0  # seconds a child's group has to end after SIGTERM (or after being asked): within the 15 s the
# laptop gives the server itself (art_sky.remote.lifecycle.STOP_GRACE)


# In the child, before the command: the parent-death signal, then, where the parent already died (the signal set too
# late to fire), exit; else exec the command. Where there is no prctl (not Linux), the command runs without it.
_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "prctl = getattr(ctypes.CDLL(None), 'prctl', None)\n"
    "if prctl is not None:\n"
    "    prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def start_child(args: list[str], **popen) -> subprocess.Popen:
    """Start `args` as a child of the server: its own process group (for `stop_group`), ended with the server."""
    return subprocess.Popen(
        [sys.executable, "-c", _WITH_PARENT, str(os.getpid()), *args], start_new_session=True, **popen
    )


def stop_group(process: subprocess.Popen, *, asked: bool = False, grace: float = STOP_GRACE) -> None:
    """Stop `process`'s group and reap it. `asked`: the child was told to stop (a command it reads) and gets `grace`
    seconds to end on its own first. Blocking: up to three times `grace` with `asked`, twice without."""
    if asked:
        _ended(process, grace)
    if not _signal(process, signal.SIGTERM) or _ended(process, grace):
        return
    _signal(process, signal.SIGKILL)
    _ended(process, grace)


def _ended(process: subprocess.Popen, within: float) -> bool:
    """Has every process of the group ended within `within` s (the child reaped)?"""
    deadline = time.monotonic() + within
    while True:
        # The group first, the child after: a child that ends between the two is a zombie the poll then reaps.
        if not _running(process.pid) and process.poll() is not None:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _running(group: int) -> bool:
    """Does a process of the group still run? A zombie does not: an orphan's lingers where nothing reaps it (a
    container's first process may not)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        if int(pgrp) == group and state != "Z":
            return True
    return False


def _signal(process: subprocess.Popen, sig: int) -> bool:
    """Send `sig` to the child's group; False when none of it is left."""
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now at `host`, for a child to bind a moment later (a race only with strangers)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
