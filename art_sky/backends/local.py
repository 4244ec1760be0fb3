"""`LocalBackend`: the cluster server on this machine (CPU or a local GPU), started detached like any other."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from art_sky import clusters
from art_sky.art_compat.training import Ready
from art_sky.errors import ConfigError
from art_sky.layout import ServerLayout
from art_sky.remote import leftovers
from art_sky.remote.runner import CommandRunner, LocalRunner
from art_sky.remote.wheel import DIST_NAME, source_checkout
from art_sky.settings import Settings
from art_sky.store import server_env
from art_sky.wire import ModelInfo

from .cluster import ClusterBackend

if TYPE_CHECKING:
    from art_sky.client import TrainableModel

_INSTANCES = itertools.count()


class LocalBackend(ClusterBackend):
    """Starts `python -m art_sky.cluster` on this machine on a free port with a fresh API key; stops it on `close()`.

    `path` is the checkpoint root (ART's `.art`, in the working directory by default), shared with
    `art-sky up --local`. The server's run files and log go to `<path>/run/<server>/` (art_sky.layout): `name`
    names that directory (a recorded cluster's name); without it every backend gets its own. `python` runs the
    server (default: this interpreter); `env` is added to its environment. `checkpoint_uri` (default
    ART_SKY_CHECKPOINT_URI) mirrors every checkpoint to object storage, from where a new server restores them.

    Unless `keep_server`, the server ends with the process that started it (its `close()`, or however that process
    ends: a crash, kill -9), and an unnamed backend's run directory is removed with it (those of dead processes at
    the next start; one whose server failed to start is kept, for the log its error names).
    """

    kind = "local"

    def __init__(
        self,
        *,
        path: str | os.PathLike = ".art",
        python: str = sys.executable,
        env: dict[str, str] | None = None,
        checkpoint_uri: str | None = None,
        name: str | None = None,
        port: int = 0,
        keep_server: bool = False,
        api_key: str | None = None,
        settings: Settings | None = None,
    ):
        super().__init__(api_key=api_key, keep_server=keep_server, settings=settings)
        self.path = Path(path).resolve()
        self.python = python
        if not 0 <= port <= 65535:
            raise ConfigError(f"port={port} is not a TCP port: give 1 to 65535, or 0 for a free one")
        self.port = port
        self.env = server_env(self.settings, checkpoint_uri) | (env or {})
        self.name = name
        server = name or f"backend-{os.getpid()}-{next(_INSTANCES)}"
        self._own_run_dir = name is None
        self.layout = ServerLayout(
            run_dir=str(self.path / "run" / clusters.check_name(server)), art_path=str(self.path)
        )

    @property
    def where(self) -> str:
        return "this machine"

    async def register(self, model: TrainableModel) -> ModelInfo | None:
        """As ART's LocalBackend does: an ART model's own files (its history, trajectories, state) go under `path`,
        beside the checkpoints, not into `./.art`."""
        if hasattr(model, "base_path"):
            model.base_path = str(self.path)
        return await super().register(model)

    @property
    def log_path(self) -> Path:
        return Path(self.layout.log_file)

    def runner(self) -> LocalRunner:
        return LocalRunner()

    def _reach(self, port: int) -> str:
        return f"http://127.0.0.1:{port}"

    async def _launch(self, api_key: str) -> ServerLayout:
        _check_server_packages(self.python)
        _remove_dead_run_dirs(Path(self.layout.run_dir).parent)
        self._launch_server(
            LocalRunner(),
            self.layout,
            python=self.python,
            env=self.env,
            port=self.port,
            exit_with=None if self.keep_server else os.getpid(),
        )
        return self.layout

    async def close(self, force: bool = False) -> None:
        started = self._started  # a failed start keeps the log its error names
        await super().close(force)
        if self._own_run_dir and not self.keep_server and started:
            shutil.rmtree(self.layout.run_dir, ignore_errors=True)

    def _leftovers(self, runner: CommandRunner, layout: ServerLayout) -> tuple[list[leftovers.Leftover], list[str]]:
        """The cluster's run files (a purge removes them) and the checkpoint root, which stays: it is this
        directory's `.art`, ART's LocalBackend's too."""
        root = layout.art_path
        items = [
            leftovers.Leftover(
                what="checkpoints",
                path=root,
                kept_because=f"{root} is this directory's checkpoint root (ART's too): delete it yourself",
            ),
            leftovers.Leftover(what=f"run/{os.path.basename(layout.run_dir)}", path=layout.run_dir),
        ]
        return items, [os.path.dirname(layout.run_dir)]

    def _checkpoint_ready(self, model) -> Ready:
        """The step's checkpoint is on this machine: listing the model's checkpoints waits for its write."""
        return Ready(lambda: self.list_checkpoints(model))

    def shell_argv(self, command: list[str]) -> list[str]:
        raise ConfigError(
            f"the server runs on this machine: its files are in {self.layout.run_dir} and {self.layout.art_path}"
        )

    @classmethod
    def from_record(
        cls, record: clusters.ClusterRecord, *, local_port: int = 0, settings: Settings | None = None
    ) -> LocalBackend:
        backend = cls(path=record.layout.art_path, name=record.name, settings=settings)
        return backend._attached(record)


_UNNAMED = re.compile(r"^backend-(\d+)-\d+$")
_NAME = re.compile(r"[A-Za-z0-9._-]+")  # a requirement's distribution name (packaging is not a laptop dependency)


def _check_server_packages(python: str) -> None:
    """The server runs on `python`: one without the `[cluster]` extra's packages (a venv with only `[art]`, as for
    a remote backend) is told, in one line, what to install, before a server is started to fail on its imports."""
    try:
        required = metadata.requires(DIST_NAME) or []
    except metadata.PackageNotFoundError:  # art-sky run from a folder, not installed: nothing to compare with
        return
    wanted = [m[0] for r in required if 'extra == "cluster"' in r and (m := _NAME.match(r))]
    probe = (
        "import importlib.metadata as m, sys\n"
        "for n in sys.argv[1:]:\n"
        "    try: m.distribution(n)\n"
        "    except m.PackageNotFoundError: print(n)"
    )
    try:
        found = subprocess.run([python, "-c", probe, *wanted], capture_output=True, text=True, timeout=60, check=True)
    except FileNotFoundError as exc:
        raise ConfigError(f"LocalBackend(python={python!r}): no such Python: give the path of one") from exc
    except (subprocess.SubprocessError, OSError):
        return  # the server's own start says what is wrong with this Python
    missing = found.stdout.split()
    if missing:
        checkout = source_checkout()
        package = f'-e "{checkout}[cluster]"' if checkout else '"art-sky[cluster]"'
        raise ConfigError(
            f"LocalBackend runs the cluster server with {python}, which lacks its packages ({', '.join(missing)}): "
            f"install them with `{python} -m pip install {package}`, or pass LocalBackend(python=...) a Python "
            "that has them"
        )


def _remove_dead_run_dirs(run_root: Path) -> None:
    """Unnamed backends' run directories whose process has ended (it was killed before its `close()`; its server
    stopped with it)."""
    try:
        entries = list(run_root.iterdir())
    except OSError:
        return
    for entry in entries:
        found = _UNNAMED.match(entry.name)
        if found and not pid_running(int(found[1])) and not pid_running(_pid_in(entry)):
            shutil.rmtree(entry, ignore_errors=True)


def _pid_in(run_dir: Path) -> int | None:
    try:
        return int(Path(ServerLayout(run_dir=str(run_dir), art_path="").pid_file).read_text())
    except (OSError, ValueError):
        return None


def pid_running(pid: int | None) -> bool:
    """Does process `pid` run on this machine (one of another user's counts)?"""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
