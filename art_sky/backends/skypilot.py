"""`SkyPilotBackend`: the cluster server as the job of a SkyPilot cluster (any cloud, Kubernetes, Slurm), reached
through the same SSH tunnel as an SSH host.

The server runs as the task's `run:` job (templates/cluster.yaml), not as a process started over SSH: on Slurm or
Kubernetes a process left behind by an SSH session is reaped, a job is not, and SkyPilot's autostop sees it.
"""

from __future__ import annotations

import asyncio
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

from dotenv import dotenv_values
from pydantic import SecretStr

from art_sky import bootstrap, clusters
from art_sky.bootstrap import RemoteServer
from art_sky.errors import BackendUnavailableError, ConfigError
from art_sky.provisioners import SSHTarget
from art_sky.provisioners import sky as provisioner
from art_sky.provisioners.sky_task import ClusterSpec, render_task, validate_task
from art_sky.settings import settings
from art_sky.ssh import SSHSession
from art_sky.store import server_env
from art_sky.wheel import build_wheel

from .ssh import SSHBackend


class SkyPilotBackend(SSHBackend):
    """Use `await SkyPilotBackend.initialize_cluster(cluster_name=..., gpu=...)`. `close()` closes the tunnel and
    leaves the cluster and its server running; `down()` tears the cluster down.

    The cluster is recorded like an SSH host (`art_sky.clusters`, kind "sky", with the server's API key), so
    another process (`art-sky tunnel`, `SSHBackend.attach`, a second `initialize_cluster`) reuses its server.
    """

    kind = "sky"

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
        checkpoint_uri: str | None = None,
    ) -> SkyPilotBackend:
        """Reuse the UP cluster `cluster_name` or launch it, make sure its server job runs (a new one on
        `force_restart`), tunnel to it and wait until it is healthy.

        `gpu`: an accelerator ("H100:1") or a list tried in order; None with `resources={"cpus": ...}` runs the
        portable engine. `infra`: SkyPilot's selector (aws, gcp/us-central1, k8s/<context>, slurm/<cluster>).
        `env_path`: a .env file whose variables reach the server as SkyPilot secrets. `art_sky_version`: install
        that release from PyPI, or build the wheel from that source checkout; default: this client's own build.
        `checkpoint_uri`: the object store the server mirrors checkpoints to (default ART_SKY_CHECKPOINT_URI); it
        and the store credentials set here travel as SkyPilot secrets, and a new cluster resumes from the store.
        `api_key`: the server's key (default ART_SKY_API_KEY, then the cluster's record); a reused server whose
        key this process does not know is restarted with a fresh one.
        """
        version, source = _version_or_source(art_sky_version)
        spec = ClusterSpec(
            gpu=gpu, infra=infra, resources=resources or {}, spot=spot, autostop_minutes=autostop_minutes,
            secrets=server_env(checkpoint_uri) | _read_env_file(env_path), python=settings().remote_python, version=version,
            template=Path(template) if template else None, overrides=overrides or {})
        recorded_key = _recorded_key(cluster_name)
        known_key = api_key or (settings().api_key.get_secret_value() if settings().api_key else None) or recorded_key
        backend = cls(cluster_name, spec, force_restart=force_restart or known_key is None, api_key=known_key)
        backend.source = source
        await backend._ensure_started()
        clusters.save(backend.record(cluster_name))
        return backend

    async def _provision(self) -> SSHTarget:
        self._api_key = self._api_key or secrets.token_urlsafe(32)
        with tempfile.TemporaryDirectory(prefix="art-sky-wheel-") as tmp:
            spec = self.spec
            if spec.python is None and spec.version is None:
                wheel = await asyncio.to_thread(build_wheel, Path(tmp), self.source)
                spec = spec.model_copy(update={"wheel": wheel})
            task = validate_task(render_task(spec, SecretStr(self._api_key)))
            await provisioner.ensure_server(self.cluster_name, task, force_restart=self.force_restart,
                                            timeout=settings().server_start_timeout)
        return await provisioner.ssh_target(self.cluster_name)

    def _bootstrap(self, timeout: float) -> RemoteServer:
        """The server is the cluster's job: wait until the job's server listens (the SSH-host layout under
        `~/art-sky`, the job's HOME) and read its port. A pid file of an earlier job reads as "stopped": wait on."""
        assert self.target is not None
        deadline = time.monotonic() + timeout
        with SSHSession(self.target) as session:
            remote_dir = session.run('echo "$HOME/art-sky"', timeout=30).stdout.strip()
            while time.monotonic() < deadline:
                state = bootstrap.server_status(session, remote_dir)
                if state.state == "listening":
                    assert state.port is not None and state.pid is not None
                    return RemoteServer(remote_dir=remote_dir, port=state.port, pid=state.pid)
                time.sleep(1)
        raise BackendUnavailableError(f"the server job on {self.cluster_name} was not listening within "
                                      f"{timeout:.0f}s: read `art-sky logs --name {self.cluster_name}` or "
                                      f"`sky logs {self.cluster_name}`")

    def _not_healthy(self, timeout: float, stopping: bool) -> Exception:
        return super()._not_healthy(timeout, stopping=False)  # the job keeps running: force_restart replaces it

    async def stop_server(self) -> bool:
        """The server is a SkyPilot job: `force_restart` replaces it, `down()` ends it with the cluster."""
        return False

    async def down(self, force: bool = False) -> None:
        """Tear the cluster down (its VM, pod or Slurm job goes away) once every checkpoint is in the store;
        `force=True` tears it down anyway."""
        if self.tunnel is not None:
            await self._flush_before_stop(force, f"the cluster {self.cluster_name}")
        await self.close()
        await provisioner.down(self.cluster_name)
        clusters.remove(self.cluster_name)


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


def _recorded_key(cluster_name: str) -> str | None:
    """The API key `art-sky up` (or another process) recorded for this SkyPilot cluster, if any."""
    if cluster_name not in clusters.all_names():
        return None
    record = clusters.load(cluster_name)
    if record.kind != "sky":
        raise ConfigError(f"the name {cluster_name!r} is taken by a {record.kind} cluster on {record.where}: "
                          f"`art-sky down --name {cluster_name}` first, or pick another cluster_name")
    return record.api_key.get_secret_value()


def _read_env_file(path: str | Path | None) -> dict[str, str]:
    if path is None:
        return {}
    if not Path(path).is_file():
        raise ConfigError(f"env_path {path} does not exist: give a .env file (KEY=value lines)")
    return {k: v for k, v in dotenv_values(path).items() if v is not None}
