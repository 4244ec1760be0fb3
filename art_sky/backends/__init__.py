"""Backends: a cluster server reachable over HTTP (base), started and stopped by the one lifecycle on a machine
(cluster), which is this one (local), an SSH host (ssh) or a SkyPilot cluster (skypilot)."""

from __future__ import annotations

from art_sky import clusters
from art_sky.art_compat.training import TrainResult
from art_sky.settings import Settings

from .base import Backend
from .cluster import ClusterBackend
from .local import LocalBackend
from .skypilot import SkyPilotBackend
from .ssh import SSHBackend

KINDS: dict[str, type[ClusterBackend]] = {"local": LocalBackend, "ssh": SSHBackend, "sky": SkyPilotBackend}


def attach(name: str, *, local_port: int = 0, settings: Settings | None = None, recover: bool = True) -> ClusterBackend:
    """The backend of the recorded cluster `name` (what `art-sky up` or `initialize_cluster` started), whatever its
    kind: the one place a record's kind picks its backend. `close()` leaves the server running; `down()` (or
    `art-sky down`) stops it. A SkyPilot cluster recorded with recovery is relaunched by this backend when it is
    lost, unless `recover=False` (the CLI's commands: the loop's own process recovers it)."""
    settings = settings or Settings()
    record = clusters.load(settings.home, name)
    if not recover:
        record = record.model_copy(update={"recover": False})
    return KINDS[record.kind].from_record(record, local_port=local_port, settings=settings)


__all__ = [
    "Backend",
    "ClusterBackend",
    "KINDS",
    "LocalBackend",
    "SSHBackend",
    "SkyPilotBackend",
    "TrainResult",
    "attach",
]
