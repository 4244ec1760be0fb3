"""`attach(name)`: the backend of a cluster `art-sky up` (or `initialize_cluster`) started, whatever its kind."""

from __future__ import annotations

from art_sky import clusters

from .base import Backend
from .ssh import SSHBackend


def attach(name: str, *, local_port: int = 0) -> Backend:
    """Reach the recorded cluster `name`'s running server: through a tunnel (an SSH host, a SkyPilot cluster) or
    directly (this machine). `close()` leaves the server running; `art-sky down` stops it."""
    record = clusters.load(name)
    if record.target is None:
        return Backend(base_url=f"http://127.0.0.1:{record.port}", api_key=record.api_key.get_secret_value())
    return SSHBackend.attach(name, local_port=local_port)
