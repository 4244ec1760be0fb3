"""`ClusterBackend`: a cluster server on a machine, run by the one lifecycle (art_sky.remote.lifecycle).

A kind (this machine, an SSH host, a SkyPilot cluster) says only how to reach the machine (`runner`), how to reach
a port there (`_reach`), and how to get a server started there (`_launch`). Starting, waiting until ready, attaching
to a recorded server, its log, stopping it and the cluster record are this code, for every kind.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import TYPE_CHECKING, ClassVar, Self

from pydantic import BaseModel

from art_sky import clusters
from art_sky.errors import ArtSkyError, BackendUnavailableError, ConfigError
from art_sky.layout import ServerLayout
from art_sky.remote import leftovers, lifecycle
from art_sky.remote.leftovers import Leftover
from art_sky.remote.lifecycle import RemoteServer
from art_sky.remote.progress import Progress, elapsed
from art_sky.remote.runner import CommandRunner
from art_sky.remote.ssh import SSHTarget
from art_sky.settings import Settings

from .base import Backend

if TYPE_CHECKING:
    from art_sky.client import TrainableModel
    from art_sky.wire import ModelInfo

ATTACH_TIMEOUT = 30.0  # a recorded server answers at once, or is broken


class Machine(BaseModel):
    """A cluster's machine as `art-sky status` shows it; what the kind knows (SkyPilot: state, price)."""

    where: str  # the machine, in words (SkyPilot: its infra)
    state: str | None = None  # SkyPilot's: UP, INIT, STOPPED; "gone" once it is not listed; None: not tracked
    accelerators: str | None = None  # "H100:1", "CPUs"; None: not known
    uptime_s: float | None = None
    hourly_cost: float | None = None  # dollars an hour, where SkyPilot knows the price
    note: str | None = None  # why something is not known


class ClusterBackend(Backend):
    """Starts a cluster server (or attaches to a recorded one: `server` set) and talks to it over HTTP.

    `close()` stops the server unless `keep_server` (attached backends keep it), once its checkpoints are in the
    object store (`force=True` skips that wait).
    """

    kind: ClassVar[str]  # how the machine was obtained, as the cluster record says: local, ssh, sky
    name: str | None = None  # the cluster's name, where it has one (a record's; `art-sky up NAME`)

    def __init__(self, *, api_key: str | None = None, keep_server: bool = False, settings: Settings | None = None):
        super().__init__(settings=settings)
        self.keep_server = keep_server
        self.server: RemoteServer | None = None  # the running server, once started or attached
        self.target: SSHTarget | None = None  # how to reach the machine over SSH, where it is another one
        self._api_key = api_key
        self._machine: CommandRunner | None = None  # the runner every lifecycle step uses, kept until close
        # Where the start's phases are shown (default: stderr, a live line on a terminal); the CLI sets its own.
        self.progress = Progress()

    # -- what a kind provides ----------------------------------------------------------------------------------

    @property
    def where(self) -> str:
        """The machine, for messages and `art-sky status`."""
        raise NotImplementedError

    def runner(self) -> CommandRunner:
        """A new command runner on the machine (blocking; a context manager)."""
        raise NotImplementedError

    def _reach(self, port: int) -> str:
        """The URL of `port` on the machine, from here (blocking: a tunnel may be opened)."""
        raise NotImplementedError

    def _unreach(self) -> None:
        """Close what `_reach` opened."""

    async def _launch(self, api_key: str) -> ServerLayout:
        """Get a server starting on the machine; return its layout. Kinds that start it use `_launch_server`."""
        raise NotImplementedError

    waits_for_start: ClassVar[bool] = False  # the server may not have started yet when `_launch` returns
    stops_its_server: ClassVar[bool] = True  # False: something else (a SkyPilot job) owns the server's life

    @classmethod
    def from_record(
        cls, record: clusters.ClusterRecord, *, local_port: int = 0, settings: Settings | None = None
    ) -> ClusterBackend:
        """The backend of a recorded cluster's running server; `close()` leaves it running."""
        raise NotImplementedError

    # -- the one path for every kind ---------------------------------------------------------------------------

    def machine_runner(self) -> CommandRunner:
        """The machine's runner, made once and kept until `close()`: one SSH connection for every lifecycle step."""
        if self._machine is None:
            self._machine = self.runner()
        return self._machine

    def forget_machine(self) -> None:
        """Close the machine's runner: the next lifecycle step connects anew (to a relaunched cluster)."""
        machine, self._machine = self._machine, None
        if machine is not None:
            machine.close()

    def _attached(self, record: clusters.ClusterRecord) -> Self:
        self.name = record.name
        self.keep_server = True
        self._api_key = record.api_key.get_secret_value()
        self.server = RemoteServer(layout=record.layout, port=record.port, pid=record.pid)
        return self

    def _launch_server(
        self,
        runner: CommandRunner,
        layout: ServerLayout,
        *,
        python: str,
        env: dict[str, str],
        port: int = 0,
        pythonpath: str | None = None,
        exit_with: int | None = None,
    ) -> None:
        """Start the server detached with this backend's key and the store's settings in its environment."""
        assert self.api_key is not None
        env = env | {"ART_SKY_API_KEY": self.api_key}
        if self.name:  # the owner records of its lineages name it; a relaunch under this name takes them over
            env = {"ART_SKY_CLUSTER_NAME": self.name} | env
        with self.progress.phase(f"starting the cluster server on {self.where}"):
            lifecycle.start(
                runner, layout, python=python, env=env, port=port, pythonpath=pythonpath, exit_with=exit_with
            )

    async def _start(self) -> None:
        settings = self.settings
        self.api_key = self._api_key or (
            settings.api_key.get_secret_value() if settings.api_key else secrets.token_urlsafe(32)
        )
        attached = self.server is not None
        ours = not attached and self.stops_its_server  # a server started here is stopped when its start fails
        layout = self.server.layout if self.server else None
        self.progress.begin()
        try:
            layout = layout or await self._launch(self.api_key)
            if attached:
                self.server = await asyncio.to_thread(self._wait_ready, layout, ATTACH_TIMEOUT, ours, attached)
            else:
                with self.progress.phase("waiting until the server answers"):
                    wait = settings.server_start_timeout
                    self.server = await asyncio.to_thread(self._wait_ready, layout, wait, ours, attached)
                self.progress.ready(f"cluster server ready on {self.where}, port {self.server.port} there,")
        except BaseException:
            if ours and layout is not None:
                await asyncio.to_thread(self._stop, layout)  # a half-started server is of no use to anyone
            await self._shutdown(stop_server=False)
            raise

    async def register(self, model: TrainableModel) -> ModelInfo | None:
        """As `Backend.register`, with the base model's load (the first one downloads its weights) reported."""
        if not getattr(model, "trainable", False):
            return await super().register(model)
        await self.ensure_started()
        started = time.monotonic()
        self.progress.note(f"loading the base model {model.base_model} for {model.name} ...")
        info = await super().register(model)
        took = elapsed(time.monotonic() - started)
        self.progress.note(
            f"{model.name} ready at step {info.step if info else 0}: {model.base_model} loaded in {took}"
        )
        return info

    def _wait_ready(self, layout: ServerLayout, timeout: float, stop: bool, attached: bool) -> RemoteServer:
        hint = f"`art-sky logs {self.name}` shows why, `art-sky up {self.name}` starts it again" if attached else ""

        def reach(port: int) -> str:
            self.base_url = self._reach(port)
            return self.base_url

        return lifecycle.wait_ready(
            self.machine_runner(),
            layout,
            timeout=timeout,
            reach=reach,
            stop_on_timeout=stop,
            waits_for_start=self.waits_for_start and not attached,
            hint=hint,
        )

    async def machine(self) -> Machine:
        """The machine for `art-sky status`: where (and, where the kind knows them, state, accelerators, cost)."""
        return Machine(where=self.where)

    async def logs(self, lines: int = 30) -> str:
        """The last lines of the server's log (it need not be running)."""
        return await asyncio.to_thread(lifecycle.log, self.machine_runner(), self._layout(), lines)

    def follow_argv(self, lines: int) -> list[str]:
        """argv (for exec) that follows the server's log (`art-sky logs --follow`)."""
        with self.runner() as runner:
            return lifecycle.follow_argv(runner, self._layout(), lines)

    def shell_argv(self, command: list[str]) -> list[str]:
        """argv (for exec) of a shell, or `command`, on the machine (`art-sky ssh`)."""
        with self.runner() as runner:
            return runner.shell_argv(command)

    async def stop_server(self) -> bool:
        """Stop the server (its whole process group); True if one was running. A server whose life something else
        owns (a SkyPilot job) is left alone."""
        if self.server is None or not self.stops_its_server:
            return False
        layout, self.server = self.server.layout, None
        return await asyncio.to_thread(self._stop, layout)

    def _stop(self, layout: ServerLayout) -> bool:
        return lifecycle.stop(self.machine_runner(), layout)

    async def close(self, force: bool = False) -> None:
        """Close the connection once the steps asked for with wait=False have trained (`force`: cancel them) and,
        unless `keep_server`, stop the server once its checkpoints are in the store."""
        await self._finish_steps(force)
        if not self.keep_server and self._started:
            await self._flush_before_stop(force, f"{self.where}:{self._layout().art_path}")
        await self._shutdown(stop_server=not self.keep_server)

    async def server_state(self) -> lifecycle.ServerStatus:
        """Is the recorded server running (a look at its run files, no request to it)? Raises
        `BackendUnavailableError` when the machine cannot be reached."""
        return await asyncio.to_thread(lifecycle.status, self.machine_runner(), self._layout())

    async def down(self, force: bool = False) -> str:
        """Stop the server for good once every checkpoint is in the store (`force`: even if not, or if the server
        cannot be asked); say what was done. A server that has already exited is done at once (nothing can be
        flushed from it). A SkyPilot cluster is torn down. Steps asked for with wait=False train first (`force`:
        cancelled)."""
        await self._finish_steps(force)
        layout = self._layout()
        try:
            state = (await self.server_state()).state
        except BackendUnavailableError as exc:
            if not force:
                first, detail = _split(exc)
                raise ConfigError(
                    f"cannot reach {self.where} to stop the server ({first}): fix that and retry, or "
                    f"forget the cluster anyway with {self._forced_down}{detail}"
                ) from exc
            state = None  # unreachable: `_end` does what it can without the machine
        if state != "stopped" and not force:
            try:
                await self.flush_checkpoints()
            except ArtSkyError as exc:
                first, detail = _split(exc)
                raise ConfigError(
                    f"not stopping the server on {self.where}: {first}. Fix it, or stop it anyway "
                    f"with {self._forced_down}{detail}"
                ) from exc
        await Backend.close(self)
        await asyncio.to_thread(self._unreach)
        self.server = None
        try:
            return await self._end(layout, state)
        finally:
            await self._shutdown(stop_server=False)  # and the machine's runner, once `_end` is done with it

    async def _end(self, layout: ServerLayout, state: str | None) -> str:
        """What `down` does once the checkpoints are safe: stop the server (`state`: what `server_state` found,
        None when the machine could not be reached)."""
        if state is None:
            return (
                f"{self.where} could not be reached: a server still running there was left alone (stop it "
                f"there: its pid is in {layout.pid_file})"
            )
        if await asyncio.to_thread(self._stop, layout):
            return "server stopped"
        if state == "stopped":
            return f"the server had already exited (its log: {layout.log_file})"
        return "server was not running"

    def _leftovers(self, runner: CommandRunner, layout: ServerLayout) -> tuple[list[Leftover], list[str]]:
        """What the cluster of `layout` leaves on the machine after `down` (the paths, and which of them other
        clusters still use), and the folders a purge removes once they are empty. Nothing, unless the kind says."""
        return [], []

    async def leftovers(self, layout: ServerLayout) -> list[Leftover]:
        """What stays on the machine of the stopped cluster of `layout`, with sizes (what exists only)."""

        def measure() -> list[Leftover]:
            runner = self.machine_runner()
            return leftovers.measure(runner, self._leftovers(runner, layout)[0])

        try:
            return await asyncio.to_thread(measure)
        finally:
            self.forget_machine()

    async def purge(self, layout: ServerLayout) -> list[Leftover]:
        """Remove what the stopped cluster of `layout` left on the machine, except what other clusters use;
        returns what was removed."""

        def remove() -> list[Leftover]:
            runner = self.machine_runner()
            items, empty_dirs = self._leftovers(runner, layout)
            return leftovers.purge(runner, leftovers.measure(runner, items), empty_dirs)

        try:
            return await asyncio.to_thread(remove)
        finally:
            self.forget_machine()

    @property
    def _forced_down(self) -> str:
        return f"`art-sky down {self.name} --force`" if self.name else "down(force=True)"

    def record(self, name: str) -> clusters.ClusterRecord:
        """What `art-sky up` saves about this backend's running server."""
        if self.server is None or self.api_key is None:
            raise ConfigError("no server started yet: `await backend.health()` starts it")
        return clusters.ClusterRecord(
            name=name,
            kind=self.kind,
            where=self.where,
            target=self.target,
            layout=self.server.layout,
            port=self.server.port,
            pid=self.server.pid,
            api_key=self.api_key,
        )

    def _layout(self) -> ServerLayout:
        if self.server is None:
            raise ConfigError("no server started or attached: `await backend.health()` starts it")
        return self.server.layout

    async def _shutdown(self, stop_server: bool) -> None:
        await Backend.close(self)
        await asyncio.to_thread(self._unreach)
        if stop_server:
            await self.stop_server()
        self.forget_machine()


def _split(exc: Exception) -> tuple[str, str]:
    """An error's first line, and the rest (detail) with its leading newline, to word a new error around it."""
    first, newline, rest = str(exc).partition("\n")
    return first.rstrip(". :"), newline + rest
