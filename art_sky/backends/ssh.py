"""`SSHBackend`: the cluster server on a machine reached over SSH (your own GPU box), through a tunnel.

`_launch` = install (ship this client's wheel, make a venv) + the lifecycle's detached start. A SkyPilot backend
overrides `_launch` to let its cluster's job start the server; reaching it is this code.
"""

from __future__ import annotations

import asyncio
import posixpath
import tempfile
from pathlib import Path

from art_sky import clusters
from art_sky.errors import ConfigError
from art_sky.layout import ServerLayout
from art_sky.remote import leftovers
from art_sky.remote.install import BootstrapOptions, install
from art_sky.remote.runner import CommandRunner
from art_sky.remote.ssh import SSHRunner, SSHTarget
from art_sky.remote.tunnel import Tunnel
from art_sky.remote.wheel import build_wheel
from art_sky.settings import Settings
from art_sky.store import server_env

from .cluster import ClusterBackend


class SSHBackend(ClusterBackend):
    """Runs the cluster server on `target` (an `SSHTarget` or "user@host[:port]") and talks to it through one SSH
    tunnel to its port (inference included: the server's /v1).

    `close()` closes the tunnel and, unless `keep_server`, stops the remote server once its checkpoints are in the
    store (`force=True` stops it anyway). `options` say where and how the server runs (remote dir, a prepared
    `python`, port, extra environment); `checkpoint_uri` (default ART_SKY_CHECKPOINT_URI) is the object store the
    server mirrors checkpoints to, with the store's credentials set here (environment or .env). `name` names the
    server's own directory on the host (`<remote_dir>/clusters/<name>`: its build and run files; `art-sky up`
    passes the cluster's name): backends of one host with different names run side by side, and starting one
    replaces only a server of the same name.
    """

    kind = "ssh"
    name: str  # the host's server directory's name: always one ("default" unless given)
    tunnel_refused_wait = 0.0  # seconds a connection through the tunnel retries a server port that refuses

    def __init__(
        self,
        target: SSHTarget | str | None = None,
        *,
        key_path: str | Path | None = None,
        options: BootstrapOptions | None = None,
        local_port: int = 0,
        keep_server: bool = False,
        api_key: str | None = None,
        checkpoint_uri: str | None = None,
        name: str = "default",
        settings: Settings | None = None,
    ):
        super().__init__(api_key=api_key, keep_server=keep_server, settings=settings)
        self.name = clusters.check_name(name)
        self.target = SSHTarget.parse(target, key_path) if isinstance(target, str) else target
        options = options or BootstrapOptions()
        self.options = options.model_copy(update={"env": server_env(self.settings, checkpoint_uri) | options.env})
        self.local_port = local_port
        self.tunnel: Tunnel | None = None

    @property
    def where(self) -> str:
        return str(self.target)

    def runner(self) -> SSHRunner:
        if self.target is None:
            raise ConfigError("SSHBackend needs a target: SSHBackend('user@host', key_path=...)")
        return SSHRunner(self.target, self.settings)

    def _reach(self, port: int) -> str:
        """One tunnel, to the server's port: every request (inference too) goes through it."""
        if self.tunnel is None or self.tunnel.remote[1] != port:
            self._unreach()
            assert self.target is not None
            tunnel = Tunnel(
                self.target, port, self.settings, local_port=self.local_port, refused_wait=self.tunnel_refused_wait
            )
            tunnel.start()
            self.tunnel = tunnel
        return self.tunnel.base_url

    def _unreach(self) -> None:
        tunnel, self.tunnel = self.tunnel, None
        if tunnel is not None:
            tunnel.close()

    async def _launch(self, api_key: str) -> ServerLayout:
        return await asyncio.to_thread(self._install_and_start)

    def _install_and_start(self) -> ServerLayout:
        runner = self.machine_runner()
        with tempfile.TemporaryDirectory(prefix="art-sky-wheel-") as tmp:
            installed = install(
                runner,
                lambda: build_wheel(Path(tmp)),
                self.options,
                self.settings.remote_install_timeout,
                name=self.name,
                progress=self.progress,
            )
            self._launch_server(
                runner,
                installed.layout,
                python=installed.python,
                env=self.options.env,
                port=self.options.port,
                pythonpath=installed.pythonpath,
            )
            return installed.layout

    def _leftovers(self, runner: CommandRunner, layout: ServerLayout) -> tuple[list[leftovers.Leftover], list[str]]:
        """The host's venv and checkpoints (kept while another cluster of the host has a folder there: they share
        both, and checkpoints cannot be told apart by cluster) and this cluster's own folder."""
        own = posixpath.dirname(layout.run_dir)  # <remote_dir>/clusters/<name> (install.py's layout)
        folders = posixpath.dirname(own)
        remote_dir = posixpath.dirname(folders)
        others = [name for name in leftovers.subfolders(runner, folders) if name != posixpath.basename(own)]
        plural = len(others) > 1
        users = f"cluster{'s' * plural} {', '.join(others)} of this host use{'' if plural else 's'} it"
        shared = users if others else None
        outside = f"{layout.art_path} is outside art-sky's directory {remote_dir}"
        items = [
            leftovers.Leftover(what="venv", path=posixpath.join(remote_dir, "venv"), kept_because=shared),
            leftovers.Leftover(
                what="checkpoints",
                path=layout.art_path,
                kept_because=shared if leftovers.inside(layout.art_path, remote_dir) else outside,
            ),
            leftovers.Leftover(what=f"clusters/{posixpath.basename(own)}", path=own),
        ]
        empty_dirs = [folders, remote_dir]
        if posixpath.basename(posixpath.dirname(remote_dir)) == ".art-sky":  # the default, ~/.art-sky/server
            empty_dirs.append(posixpath.dirname(remote_dir))
        return items, empty_dirs

    @classmethod
    def from_record(
        cls, record: clusters.ClusterRecord, *, local_port: int = 0, settings: Settings | None = None
    ) -> SSHBackend:
        return cls(record.target, local_port=local_port, name=record.name, settings=settings)._attached(record)
