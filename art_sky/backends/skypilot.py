"""`SkyPilotBackend`: the cluster server as the job of a SkyPilot cluster (any cloud, Kubernetes, Slurm), reached
through the same SSH tunnel as an SSH host.

The server runs as the task's `run:` job (templates/cluster.yaml), not as a process started over SSH: on Slurm or
Kubernetes a process left behind by an SSH session is reaped, a job is not, and SkyPilot's autostop sees it.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any

from dotenv import dotenv_values
from pydantic import SecretStr

from art_sky.bootstrap import RemoteServer
from art_sky.errors import BackendUnavailableError, ConfigError
from art_sky.provisioners import SSHTarget
from art_sky.provisioners import sky as provisioner
from art_sky.provisioners.sky_task import ClusterSpec, render_task, validate_task
from art_sky.settings import settings
from art_sky.ssh import SSHSession
from art_sky import wheel as wheel_builder
from art_sky.wheel import build_wheel

from .ssh import SSHBackend

PORT_FILE = "art-sky/server.json"  # relative to the job's HOME, as the template's run section writes it


class SkyPilotBackend(SSHBackend):
    """Use `await SkyPilotBackend.initialize_cluster(cluster_name=..., gpu=...)`. `close()` closes the tunnel and
    leaves the cluster and its server running; `down()` tears the cluster down."""

    def __init__(self, cluster_name: str, spec: ClusterSpec, *, force_restart: bool = False,
                 api_key: str | None = None):
        super().__init__(keep_server=True, api_key=api_key)
        self.cluster_name = cluster_name
        self.spec = spec
        self.force_restart = force_restart
        self.source: Path | None = None  # build the shipped wheel from this checkout instead of this client

    @classmethod
    async def initialize_cluster(
        cls, *, cluster_name: str, gpu: str | list[str] | None = "H100:1", infra: str | None = None,
        resources: dict[str, Any] | None = None, spot: bool = False, autostop_minutes: int | None = 60,
        env_path: str | Path | None = None, art_sky_version: str | Path | None = None, force_restart: bool = False,
        api_key: str | None = None, template: str | Path | None = None, overrides: dict[str, Any] | None = None,
    ) -> SkyPilotBackend:
        """Reuse the UP cluster `cluster_name` or launch it, make sure its server job runs (a new one on
        `force_restart`), tunnel to it and wait until it is healthy.

        `gpu`: an accelerator ("H100:1") or a list tried in order; None with `resources={"cpus": ...}` runs the
        portable engine. `infra`: SkyPilot's selector (aws, gcp/us-central1, k8s/<context>, slurm/<cluster>).
        `env_path`: a .env file whose variables reach the server as SkyPilot secrets. `art_sky_version`: install
        that release from PyPI, or build the wheel from that source checkout; default: this client's own build.
        `api_key`: the server's key (default ART_SKY_API_KEY); a reused server whose key this process does not
        know is restarted with a fresh one.
        """
        version, source = _version_or_source(art_sky_version)
        spec = ClusterSpec(
            gpu=gpu, infra=infra, resources=resources or {}, spot=spot, autostop_minutes=autostop_minutes,
            secrets=_read_env_file(env_path), python=settings().remote_python, version=version,
            template=Path(template) if template else None, overrides=overrides or {})
        known_key = api_key or (settings().api_key.get_secret_value() if settings().api_key else None)
        backend = cls(cluster_name, spec, force_restart=force_restart or known_key is None, api_key=known_key)
        backend.source = source
        await backend._ensure_started()
        return backend

    async def _provision(self) -> SSHTarget:
        self._api_key = self._api_key or secrets.token_urlsafe(32)
        with tempfile.TemporaryDirectory(prefix="art-sky-wheel-") as tmp:
            spec = self.spec
            if spec.python is None and spec.version is None:
                wheel = await asyncio.to_thread(
                    *((wheel_builder._build_from_source, self.source) if self.source else (build_wheel,)), Path(tmp))
                spec = spec.model_copy(update={"wheel": wheel})
            task = validate_task(render_task(spec, SecretStr(self._api_key)))
            await provisioner.ensure_server(self.cluster_name, task, force_restart=self.force_restart,
                                            timeout=settings().server_start_timeout)
        return await provisioner.ssh_target(self.cluster_name)

    def _bootstrap(self, timeout: float) -> RemoteServer:
        """The server is the cluster's job: wait for the port file it writes (a live pid) and read it."""
        assert self.target is not None
        deadline = time.monotonic() + timeout
        script = (f'f="$HOME/{PORT_FILE}"; [ -f "$f" ] && kill -0 "$(sed \'s/.*"pid": *\\([0-9]*\\).*/\\1/\' "$f")" '
                  f'2>/dev/null && echo "$HOME" && cat "$f"')
        with SSHSession(self.target) as session:
            while time.monotonic() < deadline:
                # The job's HOME differs from the login's on Slurm; SkyPilot's SetEnv makes the session use it.
                _, out, _ = session.client.exec_command(f"bash -c {shlex.quote(script)}",
                                                        environment=self.target.env, timeout=30)
                lines = out.read().decode().splitlines()
                if len(lines) == 2:
                    port_file = json.loads(lines[1])
                    return RemoteServer(remote_dir=f"{lines[0]}/art-sky", port=port_file["port"],
                                        pid=port_file["pid"])
                time.sleep(1)
        raise BackendUnavailableError(f"the server job on {self.cluster_name} wrote no port file within "
                                      f"{timeout:.0f}s: read `sky logs {self.cluster_name}`")

    def _not_healthy(self, timeout: float) -> Exception:
        return BackendUnavailableError(f"the server on {self.cluster_name} was not healthy within {timeout:.0f}s "
                                       f"(ART_SKY_SERVER_START_TIMEOUT): read `sky logs {self.cluster_name}`")

    async def stop_server(self) -> bool:
        """The server is a SkyPilot job: `force_restart` replaces it, `down()` ends it with the cluster."""
        return False

    def logs(self, lines: int = 30) -> str:
        return f"the server's log is its SkyPilot job's: `sky logs {self.cluster_name}`"

    async def down(self) -> None:
        """Close the tunnel and tear the cluster down (its VM, pod or Slurm job goes away)."""
        await self.close()
        await provisioner.down(self.cluster_name)


def _version_or_source(value: str | Path | None) -> tuple[str | None, Path | None]:
    if value is None:
        return None, None
    path = Path(value).expanduser()
    if isinstance(value, Path) or path.is_dir():
        if not (path / "pyproject.toml").is_file():
            raise ConfigError(f"art_sky_version={value!r} is not an art-sky source checkout (no pyproject.toml): "
                              "give a release like '0.1.0' or the checkout's directory")
        return None, path
    return str(value), None


def _read_env_file(path: str | Path | None) -> dict[str, str]:
    if path is None:
        return {}
    if not Path(path).is_file():
        raise ConfigError(f"env_path {path} does not exist: give a .env file (KEY=value lines)")
    return {k: v for k, v in dotenv_values(path).items() if v is not None}
