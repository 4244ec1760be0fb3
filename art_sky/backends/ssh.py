"""`SSHBackend`: the cluster server on a machine reached over SSH (your own GPU box), through a tunnel.

`_start` = provision (here: the host you named) + bootstrap (ship this client's wheel, install, start the
server detached) + tunnel. A SkyPilot backend overrides only `_provision` to return the `SSHTarget` SkyPilot
records for its cluster; everything after that is this code.
"""

from __future__ import annotations

import asyncio
import secrets
import tempfile
import time
from pathlib import Path


from art_sky import bootstrap, clusters
from art_sky.bootstrap import BootstrapOptions, RemoteServer
from art_sky.errors import ConfigError
from art_sky.provisioners import SSHTarget
from art_sky.settings import settings
from art_sky.ssh import SSHSession
from art_sky.store import server_env
from art_sky.tunnel import Tunnel
from art_sky.wheel import build_wheel

from .base import Backend

_ATTACH_TIMEOUT = 30.0


def parse_host(spec: str, key_path: str | Path | None = None) -> SSHTarget:
    """`user@host[:port]` (as `art-sky up --host` takes it) into an `SSHTarget`."""
    user, at, rest = spec.rpartition("@")
    host, colon, port = rest.rpartition(":") if rest.count(":") == 1 else ("", "", rest)
    host = host if colon else rest
    if not at or not user or not host or (colon and not port.isdigit()):
        raise ConfigError(f"cannot read host {spec!r}: write it as user@host or user@host:port")
    return SSHTarget(host=host, port=int(port) if colon else 22, user=user,
                     key_path=Path(key_path).expanduser() if key_path else None)


class SSHBackend(Backend):
    """Runs the cluster server on `target` (an `SSHTarget` or "user@host[:port]") and talks to it through a tunnel.

    `close()` closes the tunnel and, unless `keep_server`, stops the remote server once its checkpoints are in the
    store (`force=True` stops it anyway). `options` say where and how the server runs (remote dir, a prepared
    `python`, port, extra environment); `checkpoint_uri` (default ART_SKY_CHECKPOINT_URI) is the object store the
    server mirrors checkpoints to, with the store credentials set here.
    """

    kind = "ssh"  # how the machine was obtained, as its cluster record says

    def __init__(self, target: SSHTarget | str | None = None, *, key_path: str | Path | None = None,
                 options: BootstrapOptions | None = None, local_port: int = 0, keep_server: bool = False,
                 api_key: str | None = None, checkpoint_uri: str | None = None):
        super().__init__()
        self.target = parse_host(target, key_path) if isinstance(target, str) else target
        options = options or BootstrapOptions()
        self.options = options.model_copy(update={"env": server_env(checkpoint_uri) | options.env})
        self.local_port = local_port
        self.keep_server = keep_server
        self.server: RemoteServer | None = None
        self.tunnel: Tunnel | None = None
        self.engine_tunnel: Tunnel | None = None  # to the engine's own port (vLLM), once the server reports one
        self._api_key = api_key

    @classmethod
    def attach(cls, name: str, *, local_port: int = 0) -> SSHBackend:
        """The server `art-sky up` started as cluster `name`: only a tunnel is opened; close() leaves it running."""
        record = clusters.load(name)
        backend = cls(record.target, local_port=local_port, keep_server=True,
                      api_key=record.api_key.get_secret_value())
        backend.server = RemoteServer(remote_dir=record.remote_dir, port=record.port, pid=record.pid)
        return backend

    def record(self, name: str) -> clusters.ClusterRecord:
        """What `art-sky up` saves about this backend's running server."""
        if self.target is None or self.server is None or self.api_key is None:
            raise ConfigError("no server started yet: `await backend.health()` starts it")
        return clusters.ClusterRecord(name=name, kind=self.kind, target=self.target, remote_dir=self.server.remote_dir,
                                      port=self.server.port, pid=self.server.pid, api_key=self.api_key)

    async def _provision(self) -> SSHTarget:
        """The machine to bootstrap. Subclasses (SkyPilot) obtain one here."""
        if self.target is None:
            raise ConfigError("SSHBackend needs a target: SSHBackend('user@host', key_path=...)")
        return self.target

    async def _start(self) -> None:
        self.target = await self._provision()
        self.api_key = self._api_key or (settings().api_key.get_secret_value() if settings().api_key
                                         else secrets.token_urlsafe(32))
        started_here = self.server is None
        # A server we start may load weights for minutes; one we attach to answers at once or is broken.
        timeout = settings().server_start_timeout if started_here else _ATTACH_TIMEOUT
        deadline = time.monotonic() + timeout
        try:
            if started_here:
                self.server = await asyncio.to_thread(self._bootstrap, timeout)
            assert self.server is not None
            self.tunnel = Tunnel(self.target, self.server.port, local_port=self.local_port)
            await asyncio.to_thread(self.tunnel.start)
            self.base_url = self.tunnel.base_url
            await self._wait_healthy(deadline, timeout, started_here)
        except BaseException:
            await self._shutdown(stop_server=started_here)  # a half-started server is of no use to anyone
            raise

    def _bootstrap(self, timeout: float) -> RemoteServer:
        assert self.target is not None
        with tempfile.TemporaryDirectory(prefix="art-sky-wheel-") as tmp, SSHSession(self.target) as session:
            remote_dir, python = bootstrap.install(session, build_wheel(Path(tmp)), self.options)
            return bootstrap.start_server(session, remote_dir, python, self.api_key or "", self.options, timeout)

    async def _wait_healthy(self, deadline: float, timeout: float, stopping: bool) -> None:
        """The port file exists once the socket is bound; /health through the tunnel says it serves."""
        while time.monotonic() < deadline:
            if await self._answers_health():
                return
            await asyncio.sleep(0.3)
        raise await asyncio.to_thread(self._not_healthy, timeout, stopping)

    def _not_healthy(self, timeout: float, stopping: bool) -> Exception:
        assert self.target is not None and self.server is not None
        with SSHSession(self.target) as session:
            return bootstrap.not_healthy(session, self.server.remote_dir, timeout,
                                         bootstrap.server_log(session, self.server.remote_dir), stopping)

    def logs(self, lines: int = 30) -> str:
        """The last lines of the remote server's log (blocking: call it from a thread in async code)."""
        if self.server is None or self.target is None:
            return "(no server started)"
        with SSHSession(self.target) as session:
            return bootstrap.server_log(session, self.server.remote_dir, lines)

    async def stop_server(self) -> bool:
        """Stop the remote server; True if one was running."""
        if self.server is None or self.target is None:
            return False
        target, remote_dir, self.server = self.target, self.server.remote_dir, None

        def stop() -> bool:
            with SSHSession(target) as session:
                return bootstrap.stop_server(session, remote_dir)

        return await asyncio.to_thread(stop)

    async def close(self, force: bool = False) -> None:
        if not self.keep_server and self.tunnel is not None:
            await self._flush_before_stop(force, f"{self.target}:{self.server.remote_dir if self.server else '?'}")
        await self._shutdown(stop_server=not self.keep_server)

    async def _reach_engine(self, port: int) -> str:
        """A second tunnel, to vLLM's port: inference goes straight to the engine, not through the server."""
        if self.engine_tunnel is None or self.engine_tunnel.remote[1] != port:
            await self._close_engine_tunnel()
            assert self.target is not None
            tunnel = Tunnel(self.target, port)
            await asyncio.to_thread(tunnel.start)
            self.engine_tunnel = tunnel
        return f"{self.engine_tunnel.base_url}/v1"

    async def _close_engine_tunnel(self) -> None:
        tunnel, self.engine_tunnel = self.engine_tunnel, None
        if tunnel is not None:
            await asyncio.to_thread(tunnel.close)

    async def _shutdown(self, stop_server: bool) -> None:
        await super().close()
        await self._close_engine_tunnel()
        tunnel, self.tunnel = self.tunnel, None
        if tunnel is not None:
            await asyncio.to_thread(tunnel.close)
        if stop_server:
            await self.stop_server()
