"""Provisioners obtain a machine for the cluster server: this machine, an SSH host, or a SkyPilot cluster.

Each hands back an `SSHTarget` (or nothing, for this machine); after that every backend shares the same
bootstrap, tunnel and HTTP client.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel


class SSHTarget(BaseModel):
    """How to reach a machine over SSH: what SkyPilot records for a cluster, or what the user gives for a host."""

    host: str
    port: int = 22
    user: str
    key_path: Path | None = None
    proxy_command: str | None = None
    env: dict[str, str] = {}  # sent with every command (ssh-config SetEnv): SkyPilot's Slurm sessions need it

    def __str__(self) -> str:  # never includes key material
        return f"{self.user}@{self.host}:{self.port}"
