"""`LocalBackend`: the cluster server on this machine (CPU or a local GPU), started detached like any other."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

from art_sky import clusters
from art_sky.errors import ConfigError
from art_sky.layout import ServerLayout
from art_sky.remote.runner import LocalRunner
from art_sky.settings import Settings
from art_sky.store import server_env

from .cluster import ClusterBackend

_INSTANCES = itertools.count()


class LocalBackend(ClusterBackend):
    """Starts `python -m art_sky.cluster` on this machine on a free port with a fresh API key; stops it on `close()`.

    `path` is the checkpoint root (ART's `.art`, in the working directory by default), shared with
    `art-sky up --local`. The server's run files and log go to `<path>/run/<server>/` (art_sky.layout): `name`
    names that directory (a recorded cluster's name); without it every backend gets its own. `python` runs the
    server (default: this interpreter); `env` is added to its environment. `checkpoint_uri` (default
    ART_SKY_CHECKPOINT_URI) mirrors every checkpoint to object storage, from where a new server restores them.
    """

    kind = "local"

    def __init__(self, *, path: str | os.PathLike = ".art", python: str = sys.executable,
                 env: dict[str, str] | None = None, checkpoint_uri: str | None = None, name: str | None = None,
                 port: int = 0, keep_server: bool = False, api_key: str | None = None,
                 settings: Settings | None = None):
        super().__init__(api_key=api_key, keep_server=keep_server, settings=settings)
        self.path = Path(path).resolve()
        self.python = python
        self.port = port
        self.env = server_env(self.settings, checkpoint_uri) | (env or {})
        self.name = name
        server = name or f"backend-{os.getpid()}-{next(_INSTANCES)}"
        self.layout = ServerLayout(run_dir=str(self.path / "run" / clusters.check_name(server)),
                                   art_path=str(self.path))

    @property
    def where(self) -> str:
        return "this machine"

    @property
    def log_path(self) -> Path:
        return Path(self.layout.log_file)

    def runner(self) -> LocalRunner:
        return LocalRunner()

    def _reach(self, port: int) -> str:
        return f"http://127.0.0.1:{port}"

    async def _launch(self, api_key: str) -> ServerLayout:
        self._launch_server(LocalRunner(), self.layout, python=self.python, env=self.env, port=self.port)
        return self.layout

    def shell_argv(self, command: list[str]) -> list[str]:
        raise ConfigError(f"the server runs on this machine: its files are in {self.layout.run_dir} and "
                          f"{self.layout.art_path}")

    @classmethod
    def from_record(cls, record: clusters.ClusterRecord, *, local_port: int = 0,
                    settings: Settings | None = None) -> LocalBackend:
        backend = cls(path=record.layout.art_path, name=record.name, settings=settings)
        return backend._attached(record)
