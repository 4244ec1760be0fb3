"""`Recovery`: a lost SkyPilot cluster (preempted, stopped, its server job ended) is launched again and the loop
goes on, as if nothing had happened but in the log.

The one place it happens, on the laptop. `watch` asks the server every CHECK_EVERY seconds (its checkpoint sync
status, which also says which steps the object store has); a server unanswered for ART_SKY_RECOVER_AFTER seconds has
SkyPilot asked what became of the cluster (a refreshed status, the server job's state). One that is up with its
server job running is left alone: a network blip, which the tunnel outlives. Otherwise, once:

1. the tunnel is held: its local port stays (the OpenAI base URL the loop holds) and new connections wait;
2. SkyPilot launches the cluster again with the same task: its own launch and failover over the GPU list, under the
   same cluster name (so never a second cluster beside the first), and the server job runs;
3. through a private tunnel, every model the loop registered is registered again (restored from the object store)
   and the steps the store did not have yet are trained again from the requests this client kept, with their
   request ids;
4. the tunnel is pointed at the new server and released: requests in flight retry (a training request with its id:
   the server trains an id once, so a step is never trained twice).

A relaunch that fails, or outlasts ART_SKY_RECOVER_TIMEOUT, tears the cluster down (nothing is left billing) and every
waiting call raises, saying what SkyPilot said and how to resume. A cluster lost again before a step trained on its
relaunch is not relaunched again: something other than the cloud is killing it, and relaunching would loop. Several
processes of this machine using one cluster (two loops) relaunch it one at a time (a lock file beside its record):
the next finds it up with a new server job, which it only reconnects to.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from art_sky import capacity, clusters
from art_sky.art_compat.models import served
from art_sky.errors import ArtSkyError, BackendUnavailableError
from art_sky.provisioners import sky as provisioner
from art_sky.remote import lifecycle
from art_sky.remote.tunnel import Tunnel
from art_sky.wire import SFTRequest, SyncStatus, TrainProgress, TrainRequest

from .base import Backend

if TYPE_CHECKING:
    from art_sky.client import TrainableModel
    from art_sky.layout import ServerLayout
    from art_sky.provisioners.sky_task import ClusterSpec
    from art_sky.remote.lifecycle import RemoteServer
    from art_sky.remote.runner import CommandRunner
    from art_sky.remote.ssh import SSHTarget
    from art_sky.server_client import ServerClient
    from art_sky.settings import Settings
    from art_sky.wire import HealthResponse


class Relaunchable(Protocol):
    """The cluster backend recovery drives (SkyPilotBackend), by its public members: its cluster, its server and
    tunnel, and `relaunch()`, as SkyPilot's StrategyExecutor drives `launch()`/`recover()` of its task."""

    api_key: str | None
    cluster_name: str
    recover: bool | Literal["from-scratch"]
    server: RemoteServer | None
    server_job: int | None
    settings: Settings
    spec: ClusterSpec | None
    target: SSHTarget | None
    tunnel: Tunnel | None

    @property
    def where(self) -> str: ...

    @property
    def server_client(self) -> ServerClient: ...

    def machine_runner(self) -> CommandRunner: ...

    def record(self, name: str) -> clusters.ClusterRecord: ...

    def known_step(self, name: str) -> int | None: ...

    def saw_step(self, name: str, step: int) -> None: ...

    async def relaunch(self, on_request: Callable[[str], None]) -> ServerLayout: ...

    async def wait_for_nodes(self, health: HealthResponse, server: ServerClient) -> HealthResponse: ...


log = logging.getLogger("art_sky")

CHECK_EVERY = 5.0  # seconds between the watch's questions to the server
CHECK_TIMEOUT = 5.0  # a server that does not answer /art/checkpoints/sync within this is not answering
DIAGNOSIS = 120.0  # seconds SkyPilot may take to say what became of a cluster (a refreshed status, the job queue)
QUEUE_AFTER = 3  # ART_SKY_RECOVER_AFTER periods of silence before an UP cluster's server job is looked at
QUEUE_TIMEOUT = 20.0  # seconds for the job queue of a cluster that reads UP (a dying one's may not answer)
SETTLED = 600.0  # a cluster lost again this soon after its relaunch, with no step trained since, is not relaunched
MAX_KEPT = 100  # requests kept per model for steps the store does not confirm (a broken store: the oldest go)


@dataclass
class Kept:
    """A step this client trained whose checkpoint the object store may not have yet: its request, to train it
    again on a relaunched cluster."""

    model: TrainableModel
    route: str
    request: TrainRequest | SFTRequest
    step: int
    wall_s: float  # how long it took: GPU time paid again when it is trained again


class Recovery:
    """Recovery for one SkyPilot backend: `watch` once its server answers; `lost` when a request's connection is
    lost; `registered`, `sent`, `trained` and `done` as the loop goes; `metrics` for each step's result."""

    def __init__(self, backend: Relaunchable):
        self.backend = backend
        self.settings = backend.settings
        self.models: dict[str, TrainableModel] = {}
        self.kept: dict[str, list[Kept]] = {}
        self.in_flight: dict[str, float] = {}  # training request id -> when it was sent
        self.interrupted: set[str] = set()  # requests in flight when a cluster was lost: trained again, if not done
        self.status: clusters.RecoveryStatus | None = None
        self.recoveries = 0
        self.downtime_s = 0.0
        self.steps_replayed = 0
        self.lost_gpu_hours = 0.0
        self._task: asyncio.Task[None] | None = None  # the recovery under way
        self._watch: asyncio.Task[None] | None = None
        self._failed: ArtSkyError | None = None
        self._lost_at: float | None = None  # when a request found the cluster gone (the downtime starts)
        self._recovered_at: float | None = None
        self._steps_since = 0  # steps trained since the last relaunch
        self.phases: dict[str, float] = {}  # the last recovery's phases, in seconds (its log line)

    # -- what the backend tells it -----------------------------------------------------------------------------

    def watch(self) -> None:
        """Watch the cluster, on this event loop (again, where the loop is a new one)."""
        loop = asyncio.get_running_loop()
        if self._watch is None or self._watch.done() or self._watch.get_loop() is not loop:
            self._watch = loop.create_task(self._watching(), name=f"art-sky-recovery-{self.backend.cluster_name}")

    async def stop(self) -> None:
        """Stop watching (`close`, `down`); a recovery under way finishes first."""
        if self._watch is not None and not self._watch.get_loop().is_closed():  # (a loop asyncio.run ended)
            self._watch.cancel()
        self._watch = None
        if self._task is not None and self._task.get_loop() is asyncio.get_running_loop():
            await asyncio.wait([self._task])

    def registered(self, model: TrainableModel) -> None:
        self.models[served(model)] = model

    def sent(self, request_id: str) -> None:
        self.in_flight[request_id] = time.monotonic()

    def done(self, request_id: str) -> None:
        self.in_flight.pop(request_id, None)

    def trained(
        self,
        model: TrainableModel,
        route: str,
        request: TrainRequest | SFTRequest,
        result: TrainProgress,
        wall_s: float,
    ) -> None:
        """A step's result came back: kept until the store has the step; counted as trained again when its request
        was in flight through a loss and the new cluster trained it (not answered from the old one's record)."""
        if request.request_id in self.interrupted:
            self.interrupted.discard(request.request_id)
            if not result.replayed:
                self.steps_replayed += 1
        self._steps_since += 1
        if self.backend.recover == "from-scratch" or result.step is None:
            return  # no store to resume from: nothing to train again on top of
        kept = self.kept.setdefault(served(model), [])
        kept.append(Kept(model, route, request, result.step, wall_s))
        if len(kept) > MAX_KEPT:
            log.warning(
                "%s: the object store has not confirmed %d steps: a lost cluster resumes from the store's "
                "newest (`art-sky status` shows its sync)",
                served(model),
                len(kept),
            )
            del kept[0]

    def metrics(self) -> dict[str, float]:
        """Recovery so far, in each step's metrics (docs/guides/spot.md says what each means)."""
        return {
            "cluster/recoveries": float(self.recoveries),
            "cluster/downtime_s": self.downtime_s,
            "cluster/steps_replayed": float(self.steps_replayed),
            "cluster/lost_gpu_hours": self.lost_gpu_hours,
        }

    async def lost(self, cause: Exception) -> bool:
        """A request's connection was lost: True once the cluster has been relaunched (retry now), False when the
        server answers or SkyPilot says the cluster is up (retry as usual); raises when the cluster could not be
        brought back."""
        seen = self.recoveries
        log.info("%s: a request lost its connection (%s): is the cluster still there?", self.backend.where, cause)
        self._lost_at = self._lost_at or time.monotonic()
        deadline = time.monotonic() + self.settings.recover_after + DIAGNOSIS  # the watch has decided by then
        self.watch()
        while True:
            if self._failed is not None:
                raise self._failed
            if self._task is not None:
                await asyncio.shield(self._task)
            if self.recoveries > seen:
                return True
            if time.monotonic() > deadline or await self._answers():
                return False
            await asyncio.sleep(1.0)

    # -- watching ----------------------------------------------------------------------------------------------

    async def _watching(self) -> None:
        answered = asked = time.monotonic()  # when the server last answered, and SkyPilot was last asked
        while self._failed is None:
            await asyncio.sleep(min(CHECK_EVERY, self.settings.recover_after))
            if self._task is not None:
                await asyncio.wait([self._task])
                answered = asked = time.monotonic()
                continue
            if await self._answers():
                answered, asked, self._lost_at = time.monotonic(), time.monotonic(), None
                continue
            if time.monotonic() - asked < self.settings.recover_after:
                continue
            why = await self._diagnose(time.monotonic() - answered)
            asked = time.monotonic()
            if why is not None:
                lost_at = min(self._lost_at or answered, answered + CHECK_EVERY)
                self._task = asyncio.create_task(self._recover(why, lost_at))

    async def _answers(self) -> bool:
        """Does the server answer (through the tunnel)? Its sync status also drops the kept requests of steps the
        store has."""
        backend = self.backend
        if backend.tunnel is None or not backend.tunnel.connected:
            return False
        answer = await backend.server_client.answers(CHECK_TIMEOUT)
        if isinstance(answer, SyncStatus):
            for name, kept in self.kept.items():
                kept[:] = [k for k in kept if k.step > answer.synced.get(name, -1)]
            return True
        return answer

    async def _diagnose(self, down_for: float) -> str | None:
        """What became of the cluster, as SkyPilot says after asking the infra; None when it is up with its server
        job running (or SkyPilot cannot be asked: nothing is relaunched on a guess). A cluster that reads UP has
        its job queue asked only once the server has been silent for QUEUE_AFTER checks: one being preempted reads
        UP for a while, and its queue may not answer."""
        name = self.backend.cluster_name
        try:
            state = await asyncio.wait_for(provisioner.cluster_status(name, refresh=True), DIAGNOSIS)
            if state == "UP":
                if down_for < QUEUE_AFTER * self.settings.recover_after:
                    return None
                jobs = await asyncio.wait_for(provisioner.server_jobs(name), QUEUE_TIMEOUT)
                running = [job["job_id"] for job in jobs if job["status"] == "RUNNING"]
                ours = self.backend.server_job
                if running and (ours is None or ours in running):
                    return None
                if running:
                    return f"its server job {ours} was replaced by job {running[0]} (relaunched elsewhere)"
                return "its server job is no longer running (`art-sky logs` of the old server is gone with it)"
        except Exception as exc:
            log.warning(
                "%s does not answer, and SkyPilot could not say what became of it (%s): asking again",
                self.backend.where,
                str(exc).partition("\n")[0],
            )
            return None
        if state is None:
            return "it is gone (preempted, or ended outside art-sky)"
        return f"it is {state} (stopped, preempted, or a node lost)"

    # -- recovering --------------------------------------------------------------------------------------------

    async def _recover(self, why: str, lost_at: float) -> None:
        try:
            await self._recover_once(why, lost_at)
        finally:
            self._task = None

    async def _recover_once(self, why: str, lost_at: float) -> None:
        backend = self.backend
        if (
            self._recovered_at is not None
            and self._steps_since == 0
            and time.monotonic() - self._recovered_at < SETTLED
        ):
            await self._give_up(
                why,
                BackendUnavailableError(
                    "it was lost again before a step trained on its relaunch: something other than the infra ends it "
                    f"(`{provisioner.sky_cli()} logs {backend.cluster_name}` of a new launch says what)"
                ),
                [],
            )
            return
        log.warning(
            "%s was lost %.0f s ago: %s. Relaunching it (recovery %d); the loop's calls wait for it",
            backend.where,
            time.monotonic() - lost_at,
            why,
            self.recoveries + 1,
        )
        self.phases = {"found lost": time.monotonic() - lost_at}
        self.interrupted |= set(self.in_flight)
        self._save("recovering", why, lost_at)
        assert backend.tunnel is not None  # recovery watches a started backend, which has its tunnel
        backend.tunnel.hold()
        requests: list[str] = []  # SkyPilot's launch request, to cancel if recovery ends first
        try:
            async with asyncio.timeout(self.settings.recover_timeout):
                async with self._only_recovery_of_the_cluster():
                    redone = await self._relaunch(requests.append)
        except asyncio.CancelledError:
            await _cancel(requests)
            log.error(
                "recovery of %s was interrupted: `%s status` shows what was launched (`%s down %s` ends it)",
                backend.where,
                provisioner.sky_cli(),
                provisioner.sky_cli(),
                backend.cluster_name,
            )
            raise
        except Exception as exc:
            await self._give_up(why, exc, requests)
            return
        downtime = time.monotonic() - lost_at
        redone += sum(lost_at - sent for sent in self.in_flight.values() if sent < lost_at)
        self.recoveries += 1
        self.downtime_s += downtime
        self.lost_gpu_hours += _machines(backend) * (downtime + redone) / 3600
        self._lost_at, self._recovered_at, self._steps_since = None, time.monotonic(), 0
        self._save("recovered", why, lost_at)
        log.warning(
            "%s is back: %.0f s of downtime (%s; %s); %d step(s) trained again so far, %.3f GPU-hour(s) lost in all",
            backend.where,
            downtime,
            why,
            ", ".join(f"{phase} in {seconds:.0f} s" for phase, seconds in self.phases.items()),
            self.steps_replayed,
            self.lost_gpu_hours,
        )

    @contextlib.asynccontextmanager
    async def _only_recovery_of_the_cluster(self):
        """One process of this machine relaunches a cluster at a time (two loops may use one cluster): the next
        finds it relaunched, up with a server job, and only reconnects (`ensure_server` reuses the job)."""
        path = self.settings.home / "clusters" / f"{self.backend.cluster_name}.recovering"
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(path, "a") as lock:
            for attempt in itertools.count():
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if not attempt:
                        log.warning("%s: another process is relaunching it: waiting for that", self.backend.where)
                    await asyncio.sleep(1.0)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    async def _relaunch(self, on_request) -> float:
        """The cluster launched again, its server ready, the models restored; returns the seconds of work trained
        again."""
        backend = self.backend
        started = time.monotonic()
        assert backend.tunnel is not None  # a started backend's
        layout = await backend.relaunch(on_request)
        self.phases["launched"] = time.monotonic() - started
        target = backend.target
        assert target is not None  # `_launch` found the new machine's
        private: list[Tunnel] = []

        def reach(port: int) -> str:
            if not private or private[-1].remote[1] != port:
                private.append(Tunnel(target, port, self.settings))
                private[-1].start()
            return private[-1].base_url

        try:
            server = await asyncio.to_thread(
                lifecycle.wait_ready,
                backend.machine_runner(),
                layout,
                timeout=self.settings.server_start_timeout,
                reach=reach,
                stop_on_timeout=False,
                waits_for_start=True,
            )
            backend.server = server
            self.phases["server ready"] = time.monotonic() - started - self.phases["launched"]
            restoring = time.monotonic()
            redone = await self._restore(private[-1].base_url)
            self.phases["models restored"] = time.monotonic() - restoring
            await asyncio.to_thread(backend.tunnel.retarget, target, server.port)
        finally:
            for tunnel in private:
                await asyncio.to_thread(tunnel.close)
        backend.tunnel.release()
        return redone

    async def _restore(self, url: str) -> float:
        """Through `url` (the private tunnel): every model registered again, restored from the store, and the kept
        steps it does not have trained again; returns their seconds."""
        backend, redone = self.backend, 0.0
        helper = Backend(url, backend.api_key, settings=self.settings)  # the loop's own client waits at the hold
        try:
            health = await backend.wait_for_nodes(await helper.check_server(), helper.server_client)
            log.info(
                "%s: the relaunched server runs art-sky %s; restoring %d model(s)",
                backend.where,
                health.version,
                len(self.models),
            )
            for model in list(self.models.values()):
                info = await helper.register(model)
                assert info is not None  # recovery keeps trainable models only, which register returns
                step = info.step
                for kept in self.kept.get(served(model), []):
                    if kept.step <= step:
                        continue
                    result = await helper.run_step(kept.model, kept.route, kept.request, False)
                    assert result.step is not None  # a step's result names it
                    step = result.step
                    if not result.replayed:
                        self.steps_replayed += 1
                        redone += kept.wall_s
                known = backend.known_step(served(model))
                known = step if known is None else known
                if step < known:
                    log.error(
                        "%s: steps %d to %d were lost with the cluster (the store did not have them and "
                        "their requests were not kept): it goes on from step %d",
                        served(model),
                        step + 1,
                        known,
                        step,
                    )
                backend.saw_step(served(model), step)
                log.info(
                    "%s: restored at step %d%s",
                    served(model),
                    step,
                    f" from {info.restored_from}" if info.restored_from else "",
                )
        finally:
            await helper.close()
        return redone

    async def _give_up(self, why: str, exc: BaseException, requests: list[str]) -> None:
        """Tear the cluster down (a half-launched one bills too) and make every waiting call raise, saying why."""
        backend = self.backend
        await _cancel(requests)
        try:
            await provisioner.down(backend.cluster_name)
            torn = "It was torn down: nothing is left running or billing"
        except Exception as down_exc:
            torn = (
                f"Tearing it down failed too ({str(down_exc).partition(chr(10))[0]}): run "
                f"`{provisioner.sky_cli()} down {backend.cluster_name}` now"
            )
        reason = str(exc).partition("\n")[0] or type(exc).__name__
        if isinstance(exc, TimeoutError):
            reason = f"not back within {self.settings.recover_timeout:.0f} s (ART_SKY_RECOVER_TIMEOUT)"
        self._failed = BackendUnavailableError(
            f"{backend.where} was lost ({why}) and could not be brought back: {reason}. {torn}. The models' steps are "
            "in the object store: fix that (another infra or region, a GPU fallback list, quota, or a larger "
            "ART_SKY_RECOVER_TIMEOUT) and call initialize_cluster again; each model resumes at the store's newest "
            "step"
        )
        log.error("%s", self._failed)
        self._save("failed", reason, self._lost_at or time.monotonic())
        if backend.tunnel is not None:
            await asyncio.to_thread(backend.tunnel.close)  # calls held there fail now, rather than wait

    def _save(self, state: str, reason: str, lost_at: float) -> None:
        """The cluster's record says what recovery is doing (`art-sky status`), and where the cluster is now."""
        backend = self.backend
        self.status = clusters.RecoveryStatus(
            state=state,
            reason=reason,
            since=time.time() - (time.monotonic() - lost_at),
            pid=os.getpid(),
            recoveries=self.recoveries,
            downtime_s=self.downtime_s,
            steps_replayed=self.steps_replayed,
            lost_gpu_hours=self.lost_gpu_hours,
        )
        home, name = self.settings.home, backend.cluster_name
        try:
            record = backend.record(name) if state == "recovered" else clusters.load(home, name)
        except ArtSkyError:
            return  # not recorded (a backend that was never saved): nothing to show
        clusters.save(home, record.model_copy(update={"recovery": self.status}))


async def _cancel(requests: list[str]) -> None:
    for request_id in requests:
        try:
            await provisioner.cancel_request(request_id)
        except Exception as exc:
            log.debug("cancelling SkyPilot request %s: %s", request_id, exc)


def _machines(backend: Relaunchable) -> int:
    """GPUs the cluster bills for (a CPU node counts as one): the accelerator's count times the nodes."""
    spec = backend.spec
    if spec is None:
        return 1
    gpu = spec.gpu[0] if isinstance(spec.gpu, list) else spec.gpu
    return (max(capacity.accelerator(gpu)[1], 1) if gpu else 1) * spec.num_nodes  # checked before it was rented
