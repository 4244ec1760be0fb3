"""`SkyPilotBackend`: the cluster server as the job of a SkyPilot cluster (any cloud, Kubernetes, Slurm), reached
through the same SSH tunnel as an SSH host.

The server runs as the task's `run:` job (templates/cluster.yaml, which starts it with `python -m art_sky.cluster
--run-dir`, the layout every other kind uses), not as a process started over SSH: on Slurm or Kubernetes a process
left behind by an SSH session is reaped, a job is not, and SkyPilot's autostop sees it.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import SecretStr

from art_sky import capacity, clusters
from art_sky.errors import BackendUnavailableError, ConfigError
from art_sky.layout import ServerLayout
from art_sky.provisioners import sky as provisioner
from art_sky.provisioners.sky_env import sky_cli
from art_sky.provisioners.sky_plan import LaunchPlan, chosen_row
from art_sky.provisioners.sky_task import SECRETS_FILE, SERVER_DIR, ClusterSpec, render_task, validate_task
from art_sky.remote.runner import first_line
from art_sky.remote.wheel import build_wheel
from art_sky.server_client import ServerClient
from art_sky.settings import Settings, read_env_file
from art_sky.store import server_env
from art_sky.wire import HealthResponse, SFTRequest, TrainProgress, TrainRequest

from .cluster import Machine
from .recovery import Recovery
from .ssh import SSHBackend

if TYPE_CHECKING:
    from art_sky.client import Model, TrainableModel

log = logging.getLogger("art_sky")


class SkyPilotBackend(SSHBackend):
    """Use `await SkyPilotBackend.initialize_cluster(cluster_name=..., gpu=...)`. `close()` closes the tunnel and
    leaves the cluster and its server running; `down()` tears the cluster down.

    The cluster is recorded (art_sky.clusters, kind "sky", with the server's API key), so another process
    (`art-sky tunnel`, `art_sky.attach`, a second `initialize_cluster`) reuses its server.

    With `recover` (recovery.py) a lost cluster is launched again and the loop goes on: the tunnel's local port
    (the OpenAI base URL) stays, the models are restored from the object store, a step in flight is trained once.
    """

    kind = "sky"
    waits_for_start = True  # the job may still be setting up when it reads as RUNNING
    stops_its_server = False  # the job's: `force_restart` replaces it, `down()` ends it with the cluster

    def __init__(
        self,
        cluster_name: str,
        spec: ClusterSpec | None,
        *,
        force_restart: bool = False,
        api_key: str | None = None,
        source: Path | None = None,
        local_port: int = 0,
        settings: Settings | None = None,
        recover: bool | Literal["from-scratch"] = False,
    ):
        super().__init__(keep_server=True, api_key=api_key, local_port=local_port, name=cluster_name, settings=settings)
        self.cluster_name = clusters.check_name(cluster_name)
        self.spec = spec
        self.force_restart = force_restart
        self.source = source  # build the shipped wheel from this checkout instead of this client
        self.recover = recover
        self.server_job: int | None = None  # the SkyPilot job that runs the server (a relaunch runs another)
        self.recovery = Recovery(self) if recover and spec is not None else None
        if self.recovery is not None:  # a server that refuses is one being replaced: its calls wait for the hold
            self.tunnel_refused_wait = 60.0

    @classmethod
    def for_cluster(
        cls,
        *,
        cluster_name: str,
        gpu: str | list[str] | None = "H100:1",
        infra: str | None = None,
        resources: dict[str, Any] | None = None,
        spot: bool = False,
        autostop_minutes: int | None = 60,
        env_path: str | Path | None = None,
        art_sky_version: str | Path | None = None,
        force_restart: bool = False,
        api_key: str | None = None,
        template: str | Path | None = None,
        overrides: dict[str, Any] | None = None,
        checkpoint_uri: str | None = None,
        settings: Settings | None = None,
        num_nodes: int = 1,
        base_model: str | None = None,
        recover: bool | Literal["from-scratch"] | None = None,
    ) -> SkyPilotBackend:
        """The backend `initialize_cluster` starts (and `art-sky up` uses), not started yet; arguments as there.
        What cannot train (`num_nodes` < 1, more trainer GPUs than a node has, `base_model`'s shards too big for the
        GPUs) or recover (no object store) is refused here, before anything is rented."""
        settings = settings or Settings()
        version, source = _version_or_source(art_sky_version)
        secrets = server_env(settings, checkpoint_uri) | read_env_file(env_path)
        recover = recovery_mode(recover, spot, secrets.get("ART_SKY_CHECKPOINT_URI"))
        given = secrets.get("ART_SKY_TRAINER_GPUS", "1")  # what the server will see: the env file's
        try:
            trainer_gpus = int(given)
        except ValueError:
            raise ConfigError(f"ART_SKY_TRAINER_GPUS={given!r} in {env_path}: give a whole number") from None
        capacity.check_before_renting(gpu, num_nodes, trainer_gpus, base_model)
        spec = ClusterSpec(
            gpu=gpu,
            infra=infra,
            num_nodes=num_nodes,
            resources=resources or {},
            spot=spot,
            autostop_minutes=autostop_minutes,
            secrets=secrets,
            python=settings.remote_python,
            version=version,
            template=Path(template) if template else None,
            overrides=overrides or {},
        )
        recorded_key = _recorded_key(settings.home, cluster_name)
        known_key = api_key or (settings.api_key.get_secret_value() if settings.api_key else None) or recorded_key
        return cls(
            cluster_name,
            spec,
            force_restart=force_restart or known_key is None,
            api_key=known_key,
            source=source,
            settings=settings,
            recover=recover,
        )

    @classmethod
    async def initialize_cluster(
        cls,
        *,
        cluster_name: str,
        gpu: str | list[str] | None = "H100:1",
        infra: str | None = None,
        resources: dict[str, Any] | None = None,
        spot: bool = False,
        autostop_minutes: int | None = 60,
        env_path: str | Path | None = None,
        art_sky_version: str | Path | None = None,
        force_restart: bool = False,
        api_key: str | None = None,
        template: str | Path | None = None,
        overrides: dict[str, Any] | None = None,
        checkpoint_uri: str | None = None,
        settings: Settings | None = None,
        num_nodes: int = 1,
        base_model: str | None = None,
        recover: bool | Literal["from-scratch"] | None = None,
    ) -> SkyPilotBackend:
        """Reuse the UP cluster `cluster_name` or launch it, make sure its server job runs (a new one on
        `force_restart`), tunnel to it and wait until it is healthy; record it (`art.attach(cluster_name)` and the
        CLI reach it by name).

        Args:
            cluster_name: the SkyPilot cluster's name, and its record's (`~/.art-sky/clusters/<name>.json`).
            gpu: an accelerator with its count ("H100:1"; "H100:8": vLLM on 7 GPUs, the trainer on the 8th, see
                cluster/node/placement.py) or a list tried in order; None with `resources={"cpus": ...}` runs the
                portable engine on CPUs.
            infra: SkyPilot's selector (`aws`, `gcp/us-central1`, `k8s/<context>`, `slurm/<cluster>`); None: any
                enabled.
            resources: more SkyPilot resource fields (`{"disk_size": 512, "cpus": "8+"}`).
            spot: spot instances.
            autostop_minutes: torn down after this many idle minutes; None keeps it up.
            env_path: a .env file whose variables reach the server in its secrets file (0600 on the node).
            art_sky_version: install that release from PyPI, or build the wheel from that source checkout;
                default: this client's own build.
            force_restart: replace the server job (a new job on the same cluster).
            api_key: the server's key (default ART_SKY_API_KEY, then the cluster's record); a reused server whose
                key this process does not know is restarted with a fresh one.
            template: the task YAML to start from (default templates/cluster.yaml).
            overrides: deep-merged into the task last (None deletes a key).
            checkpoint_uri: the object store the server mirrors checkpoints to (default ART_SKY_CHECKPOINT_URI);
                it and the store credentials set here travel in the secrets file, and a new cluster resumes from it.
            settings: this process's settings (default: read from the environment and .env).
            num_nodes: nodes of `gpu` each (SkyPilot's multi-node launch): the server on the head, an engine
                replica on every node, the trainer's ranks over every node's trainer GPUs (ART_SKY_TRAINER_GPUS per
                node; nodes without GPUs: ART_SKY_TRAINER_CPU_RANKS gloo ranks each).
            base_model: the model you will train, checked against the GPUs before anything is rented.
            recover: relaunch the cluster when it is lost and go on (recovery.py); default on with `spot=True`
                where there is an object store. It needs one (the new cluster resumes from it): True without one is
                refused, "from-scratch" relaunches anyway, from step 0.
        """
        backend = cls.for_cluster(
            cluster_name=cluster_name,
            gpu=gpu,
            infra=infra,
            resources=resources,
            spot=spot,
            autostop_minutes=autostop_minutes,
            env_path=env_path,
            art_sky_version=art_sky_version,
            force_restart=force_restart,
            api_key=api_key,
            template=template,
            overrides=overrides,
            checkpoint_uri=checkpoint_uri,
            settings=settings,
            num_nodes=num_nodes,
            base_model=base_model,
            recover=recover,
        )
        await backend.ensure_started()
        clusters.save(backend.settings.home, backend.record(cluster_name))
        return backend

    async def check_server(self) -> HealthResponse:
        """As every backend's, and on several nodes, until every node's replica has joined the head's fleet. Then,
        with recovery on, the cluster is watched."""
        health = await self.wait_for_nodes(await super().check_server(), self.server_client)
        if self.recovery is not None:
            self.recovery.watch()
        return health

    async def wait_for_nodes(self, health: HealthResponse, server: ServerClient) -> HealthResponse:
        """`health`, or `server`'s again every few seconds, once every node's replica has joined the head's fleet. A
        node that never joins (lost during `up`) has the whole cluster torn down: nothing is left billing for a
        cluster that cannot work."""
        nodes = self.spec.num_nodes if self.spec is not None else 1
        deadline = asyncio.get_running_loop().time() + self.settings.server_start_timeout
        while nodes > 1:
            joined = 1 + sum(replica.url != "local" for replica in health.fleet)  # the head, and each worker
            if joined >= nodes:
                return health
            if asyncio.get_running_loop().time() > deadline:
                await provisioner.down(self.cluster_name)  # not `down()`: its checkpoints-first rules need a server
                raise BackendUnavailableError(
                    f"{self.where}: {joined} of its {nodes} nodes joined within "
                    f"{self.settings.server_start_timeout:.0f} s (ART_SKY_SERVER_START_TIMEOUT), so it was torn "
                    f"down: nothing is left billing. Read `sky logs {self.cluster_name}` of a new launch, or ask "
                    "for fewer nodes"
                )
            await asyncio.sleep(5)
            health = await server.health()
        return health

    async def register(self, model: TrainableModel):
        info = await super().register(model)
        if self.recovery is not None and info is not None:
            self.recovery.registered(model)  # registered again, restored from the store, on a relaunched cluster
        return info

    async def run_step(
        self, model: Model, route: str, request: TrainRequest | SFTRequest, verbose: bool
    ) -> TrainProgress:
        """As every backend's; with recovery on, the request is kept until the store has its step (to train it
        again on a relaunched cluster) and the result says what recovery did (`cluster/*` metrics)."""
        if self.recovery is None:
            return await super().run_step(model, route, request, verbose)
        request_id = request.request_id or uuid.uuid4().hex
        request = request.model_copy(update={"request_id": request_id})
        sent = time.monotonic()
        self.recovery.sent(request_id)
        try:
            result = await super().run_step(model, route, request, verbose)
        finally:
            self.recovery.done(request_id)
        self.recovery.trained(model, route, request, result, time.monotonic() - sent)
        return result.model_copy(update={"metrics": result.metrics | self.recovery.metrics()})

    async def _recovered(self, cause: Exception) -> bool:
        return self.recovery is not None and await self.recovery.lost(cause)

    async def close(self, force: bool = False) -> None:
        if self.recovery is not None:
            await self.recovery.stop()
        await super().close(force)

    @property
    def where(self) -> str:
        return f"SkyPilot cluster {self.cluster_name}"

    async def relaunch(self, on_request: Callable[[str], None]) -> ServerLayout:
        """The lost cluster launched again under its name (recovery's): a new cluster, its server a new job."""
        assert self.api_key is not None  # a started backend's
        self.force_restart = False
        self.forget_machine()  # the old cluster's SSH connection
        return await self._launch(self.api_key, on_request=on_request)

    async def _launch(self, api_key: str, on_request: Callable[[str], None] | None = None) -> ServerLayout:
        """Make sure the cluster's server job runs, then read where its files are (`~/art-sky` of the job).
        `on_request` gets SkyPilot's launch request id (to cancel it)."""
        if self.spec is None:
            raise ConfigError(f"no task for {self.cluster_name}: use SkyPilotBackend.initialize_cluster(...)")
        # A private folder (0700) for the wheel and the secrets file, which the launch ships and then needs no more
        with tempfile.TemporaryDirectory(prefix="art-sky-launch-") as tmp:
            spec = self.spec
            if spec.python is None and spec.version is None:
                wheel = await asyncio.to_thread(build_wheel, Path(tmp), self.source)
                spec = spec.model_copy(update={"wheel": wheel})
            secrets = Path(tmp) / "secrets.env"
            task = validate_task(render_task(spec, SecretStr(api_key), secrets))
            self.server_job = await provisioner.ensure_server(
                self.cluster_name,
                task,
                force_restart=self.force_restart,
                timeout=self.settings.server_start_timeout,
                send_secrets=lambda: self._send_secrets(secrets.read_bytes()),
                on_request=on_request,
            )
        self.target = await provisioner.ssh_target(self.cluster_name)

        home = await asyncio.to_thread(self.machine_runner().run, f'echo "$HOME/{SERVER_DIR}"', timeout=30)
        return ServerLayout.under(home.stdout.strip())

    async def _send_secrets(self, text: bytes) -> None:
        """The secrets file onto the UP cluster, as a launch's file mount would put it: through SSH's stdin into a
        file made 0600 (umask 077), never on a command line."""
        self.target = await provisioner.ssh_target(self.cluster_name)
        new = f"{SECRETS_FILE}.new"
        script = f"umask 077 && mkdir -p ~/{SERVER_DIR} && cat > {new} && mv -f {new} {SECRETS_FILE}"

        def send() -> None:
            with self.runner() as runner:
                runner.run(script, stdin=text, timeout=60)

        await asyncio.to_thread(send)

    async def launch_plan(self) -> LaunchPlan | None:
        """What starting this backend would rent (the ask, SkyPilot's choice and its price), or None where nothing
        new is rented: the cluster is up (its server is reused or restarted)."""
        if self.spec is None or await provisioner.cluster_status(self.cluster_name) == "UP":
            return None
        # The optimizer reads the resources only: no wheel built, no secret sent, a placeholder install.
        spec = self.spec.model_copy(update={"secrets": {}, "python": self.spec.python or "python3"})
        with tempfile.TemporaryDirectory(prefix="art-sky-plan-") as tmp:
            task = await asyncio.to_thread(validate_task, render_task(spec, SecretStr("unused"), Path(tmp) / "s.env"))
            table = await provisioner.plan(self.cluster_name, task)
        gpus = [spec.gpu] if isinstance(spec.gpu, str) else spec.gpu
        return LaunchPlan(
            cluster=self.cluster_name,
            gpus=gpus,
            nodes=spec.num_nodes,
            spot=spec.spot,
            infra=spec.infra,
            autostop_minutes=spec.autostop_minutes,
            chosen=chosen_row(table),
            table=table,
        )

    def _leftovers(self, runner, layout: ServerLayout) -> tuple[list, list[str]]:
        return [], []  # `down` tears the cluster down: nothing stays (checkpoints are in the store, if one is set)

    async def _end(self, layout: ServerLayout, state: str | None) -> str:
        await provisioner.down(self.cluster_name)
        return "SkyPilot cluster torn down"

    async def down(self, force: bool = False) -> str:
        """Tear the cluster down (its VM, pod or Slurm job goes away) once every checkpoint is in the store;
        `force=True` tears it down anyway. A cluster that no longer exists is only forgotten. Its record is
        removed."""
        if self.recovery is not None:
            await self.recovery.stop()  # torn down on purpose: not lost
        state = await provisioner.cluster_status(self.cluster_name)
        if state is None:
            done = "the SkyPilot cluster no longer exists"
        elif self.server is None:  # never started here: nothing to flush, nothing to ask
            done = await self._end(ServerLayout.under(SERVER_DIR), None)
        elif state != "UP" and not force:
            raise ConfigError(
                f"{self.where} is {state}: `{sky_cli()} start {self.cluster_name}` so that its "
                "checkpoints can reach the store first, or tear it down as it is with `art-sky down "
                f"{self.cluster_name} --force`"
            )
        elif state != "UP":
            done = await self._end(self._layout(), None)
        else:
            done = await super().down(force)
        clusters.remove(self.settings.home, self.cluster_name)
        return done

    async def machine(self) -> Machine:
        """The cluster as SkyPilot lists it: infra and state, accelerators, uptime and price."""
        try:
            rows = {row.name: row for row in await provisioner.status()}
        except Exception as exc:
            return Machine(where=self.where, note=f"SkyPilot could not be asked: {first_line(str(exc))}")
        row = rows.get(self.cluster_name)
        if row is None:
            return Machine(where=self.where, state="gone", note="not in `sky status`")
        return Machine(
            where=row.infra,
            state=row.status,
            uptime_s=row.uptime_s,
            hourly_cost=row.hourly_cost,
            accelerators=", ".join(f"{k}:{v:g}" for k, v in (row.accelerators or {}).items()) or "CPUs",
        )

    async def _provider_price(self) -> float | None:
        """SkyPilot's price of the cluster (its launched resources), for each step's cost."""
        try:
            rows = {row.name: row for row in await provisioner.status()}
        except Exception as exc:
            log.warning(
                "no price for %s: SkyPilot could not be asked (%s); steps are not costed", self.cluster_name, exc
            )
            return None
        row = rows.get(self.cluster_name)
        return row.hourly_cost if row is not None else None

    def record(self, name: str) -> clusters.ClusterRecord:
        """As every kind's, with the task (what recovery relaunches, in this or another process) and recovery's."""
        return (
            super()
            .record(name)
            .model_copy(
                update={
                    "spec": self.spec,
                    "recover": self.recover,
                    "server_job": self.server_job,
                    "recovery": self.recovery.status if self.recovery is not None else None,
                }
            )
        )

    @classmethod
    def from_record(
        cls, record: clusters.ClusterRecord, *, local_port: int = 0, settings: Settings | None = None
    ) -> SkyPilotBackend:
        backend = cls(record.name, record.spec, local_port=local_port, settings=settings, recover=record.recover)
        backend.target, backend.server_job = record.target, record.server_job
        return backend._attached(record)


def recovery_mode(recover: bool | str | None, spot: bool, store: str | None) -> bool | Literal["from-scratch"]:
    """Whether a lost cluster is relaunched: as asked, else with spot instances (where it is safe: a store to
    resume from). Recovery without a store would start the new cluster from step 0: refused unless asked so."""
    if recover == "from-scratch":
        return "from-scratch"
    if recover not in (None, True, False):
        raise ConfigError(
            f"recover={recover!r}: give True, False, None (on with spot=True and an object store) or 'from-scratch'"
        )
    if recover is None:
        if spot and not store:
            log.warning(
                "spot=True without an object store (ART_SKY_CHECKPOINT_URI): a preempted cluster is not "
                "relaunched, since a new one would start from step 0. Set a store to have it recovered"
            )
        return bool(spot and store)
    if recover and not store:
        raise ConfigError(
            "recover=True needs an object store: a relaunched cluster resumes from it, without one it "
            "would start from step 0. Set ART_SKY_CHECKPOINT_URI (or checkpoint_uri=...), or pass "
            "recover='from-scratch' to relaunch from step 0 anyway"
        )
    return recover


def _version_or_source(value: str | Path | None) -> tuple[str | None, Path | None]:
    if value is None:
        return None, None
    path = Path(value).expanduser()
    if isinstance(value, Path) or path.is_dir():
        if not (path / "pyproject.toml").is_file():
            raise ConfigError(
                f"art_sky_version={value!r} is not an art-sky source checkout (no pyproject.toml): "
                "give a release like '0.1.0' or the checkout's directory"
            )
        return None, path
    return str(value), None


def _recorded_key(home: Path, cluster_name: str) -> str | None:
    """The API key `art-sky up` (or another process) recorded for this SkyPilot cluster, if any."""
    if cluster_name not in clusters.all_names(home):
        return None
    record = clusters.load(home, cluster_name)
    if record.kind != "sky":
        raise ConfigError(
            f"the name {cluster_name!r} is taken by a {record.kind} cluster on {record.where}: "
            f"`art-sky down {cluster_name}` first, or pick another cluster_name"
        )
    return record.api_key.get_secret_value()
