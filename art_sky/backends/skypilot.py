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
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from art_sky import capacity, clusters
from art_sky.errors import BackendUnavailableError, ConfigError
from art_sky.layout import ServerLayout
from art_sky.provisioners import sky as provisioner
from art_sky.provisioners.sky_env import sky_cli
from art_sky.provisioners.sky_task import SERVER_DIR, ClusterSpec, render_task, validate_task
from art_sky.remote.runner import first_line
from art_sky.remote.wheel import build_wheel
from art_sky.settings import Settings, read_env_file
from art_sky.store import server_env
from art_sky.wire import HealthResponse

from .cluster import Machine
from .ssh import SSHBackend

log = logging.getLogger("art_sky")


class SkyPilotBackend(SSHBackend):
    """Use `await SkyPilotBackend.initialize_cluster(cluster_name=..., gpu=...)`. `close()` closes the tunnel and
    leaves the cluster and its server running; `down()` tears the cluster down.

    The cluster is recorded (art_sky.clusters, kind "sky", with the server's API key), so another process
    (`art-sky tunnel`, `art_sky.attach`, a second `initialize_cluster`) reuses its server.
    """

    kind = "sky"
    waits_for_start = True  # the job may still be setting up when it reads as RUNNING
    stops_its_server = False  # the job's: `force_restart` replaces it, `down()` ends it with the cluster

    def __init__(self, cluster_name: str, spec: ClusterSpec | None, *, force_restart: bool = False,
                 api_key: str | None = None, source: Path | None = None, local_port: int = 0,
                 settings: Settings | None = None):
        super().__init__(keep_server=True, api_key=api_key, local_port=local_port, name=cluster_name,
                         settings=settings)
        self.cluster_name = clusters.check_name(cluster_name)
        self.spec = spec
        self.force_restart = force_restart
        self.source = source  # build the shipped wheel from this checkout instead of this client

    @classmethod
    def for_cluster(
        cls, *, cluster_name: str, gpu: str | list[str] | None = "H100:1", infra: str | None = None,
        resources: dict[str, Any] | None = None, spot: bool = False, autostop_minutes: int | None = 60,
        env_path: str | Path | None = None, art_sky_version: str | Path | None = None, force_restart: bool = False,
        api_key: str | None = None, template: str | Path | None = None, overrides: dict[str, Any] | None = None,
        checkpoint_uri: str | None = None, settings: Settings | None = None, num_nodes: int = 1,
        base_model: str | None = None,
    ) -> SkyPilotBackend:
        """The backend `initialize_cluster` starts (and `art-sky up` uses), not started yet; arguments as there.
        What cannot train (`num_nodes` < 1, more trainer GPUs than a node has, `base_model`'s shards too big for the
        GPUs) is refused here, before anything is rented."""
        settings = settings or Settings()
        version, source = _version_or_source(art_sky_version)
        secrets = server_env(settings, checkpoint_uri) | read_env_file(env_path)
        trainer_gpus = secrets.get("ART_SKY_TRAINER_GPUS", "1")  # what the server will see: the env file's
        try:
            trainer_gpus = int(trainer_gpus)
        except ValueError:
            raise ConfigError(f"ART_SKY_TRAINER_GPUS={trainer_gpus!r} in {env_path}: give a whole number") from None
        capacity.check_before_renting(gpu, num_nodes, trainer_gpus, base_model)
        spec = ClusterSpec(
            gpu=gpu, infra=infra, num_nodes=num_nodes, resources=resources or {}, spot=spot,
            autostop_minutes=autostop_minutes, secrets=secrets, python=settings.remote_python, version=version,
            template=Path(template) if template else None, overrides=overrides or {})
        recorded_key = _recorded_key(settings.home, cluster_name)
        known_key = api_key or (settings.api_key.get_secret_value() if settings.api_key else None) or recorded_key
        return cls(cluster_name, spec, force_restart=force_restart or known_key is None, api_key=known_key,
                   source=source, settings=settings)

    @classmethod
    async def initialize_cluster(cls, *, cluster_name: str, **arguments: Any) -> SkyPilotBackend:
        """Reuse the UP cluster `cluster_name` or launch it, make sure its server job runs (a new one on
        `force_restart`), tunnel to it and wait until it is healthy; record it.

        `gpu`: an accelerator with its count ("H100:1"; "H100:8": vLLM on 7 GPUs, the trainer on the 8th, see
        cluster/node/placement.py) or a list tried in order; None with `resources={"cpus": ...}` runs the portable
        engine. `num_nodes`: nodes of that many GPUs each (SkyPilot's multi-node launch): the server on the head,
        an engine replica on every node, the trainer's ranks over every node's trainer GPUs (ART_SKY_TRAINER_GPUS
        per node; nodes without GPUs: ART_SKY_TRAINER_CPU_RANKS gloo ranks each). `base_model`: the model you will
        train, checked against the GPUs before anything is rented.
        `infra`: SkyPilot's selector (aws, gcp/us-central1, k8s/<context>, slurm/<cluster>).
        `spot`, `autostop_minutes` (None keeps it up), `resources` (more SkyPilot resource fields).
        `env_path`: a .env file whose variables reach the server as SkyPilot secrets. `art_sky_version`: install
        that release from PyPI, or build the wheel from that source checkout; default: this client's own build.
        `checkpoint_uri`: the object store the server mirrors checkpoints to (default ART_SKY_CHECKPOINT_URI); it
        and the store credentials set here travel as SkyPilot secrets, and a new cluster resumes from the store.
        `api_key`: the server's key (default ART_SKY_API_KEY, then the cluster's record); a reused server whose
        key this process does not know is restarted with a fresh one. `template`, `overrides`: the task YAML.
        """
        backend = cls.for_cluster(cluster_name=cluster_name, **arguments)
        await backend._ensure_started()
        clusters.save(backend.settings.home, backend.record(cluster_name))
        return backend

    async def check_server(self) -> HealthResponse:
        """As every backend's, and on several nodes, until every node's replica has joined the head's fleet. A node
        that never joins (lost during `up`) has the whole cluster torn down: nothing is left billing for a cluster
        that cannot work."""
        health = await super().check_server()
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
                    "for fewer nodes")
            await asyncio.sleep(5)
            health = HealthResponse.model_validate(await self._request("GET", "/health"))
        return health

    @property
    def where(self) -> str:
        return f"SkyPilot cluster {self.cluster_name}"

    async def _launch(self, api_key: str) -> ServerLayout:
        """Make sure the cluster's server job runs, then read where its files are (`~/art-sky` of the job)."""
        if self.spec is None:
            raise ConfigError(f"no task for {self.cluster_name}: use SkyPilotBackend.initialize_cluster(...)")
        with tempfile.TemporaryDirectory(prefix="art-sky-wheel-") as tmp:
            spec = self.spec
            if spec.python is None and spec.version is None:
                wheel = await asyncio.to_thread(build_wheel, Path(tmp), self.source)
                spec = spec.model_copy(update={"wheel": wheel})
            task = validate_task(render_task(spec, SecretStr(api_key)))
            await provisioner.ensure_server(self.cluster_name, task, force_restart=self.force_restart,
                                            timeout=self.settings.server_start_timeout)
        self.target = await provisioner.ssh_target(self.cluster_name)

        home = await asyncio.to_thread(self.machine_runner().run, f'echo "$HOME/{SERVER_DIR}"', timeout=30)
        return ServerLayout.under(home.stdout.strip())

    async def _end(self, layout: ServerLayout, state: str | None) -> str:
        await provisioner.down(self.cluster_name)
        return "SkyPilot cluster torn down"

    async def down(self, force: bool = False) -> str:
        """Tear the cluster down (its VM, pod or Slurm job goes away) once every checkpoint is in the store;
        `force=True` tears it down anyway. A cluster that no longer exists is only forgotten. Its record is
        removed."""
        state = await provisioner.cluster_status(self.cluster_name)
        if state is None:
            done = "the SkyPilot cluster no longer exists"
        elif self.server is None:  # never started here: nothing to flush, nothing to ask
            done = await self._end(ServerLayout.under(SERVER_DIR), None)
        elif state != "UP" and not force:
            raise ConfigError(f"{self.where} is {state}: `{sky_cli()} start {self.cluster_name}` so that its "
                              "checkpoints can reach the store first, or tear it down as it is with `art-sky down "
                              f"{self.cluster_name} --force`")
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
        except Exception as exc:  # noqa: BLE001 (status is a report: say why SkyPilot could not be asked)
            return Machine(where=self.where, note=f"SkyPilot could not be asked: {first_line(str(exc))}")
        row = rows.get(self.cluster_name)
        if row is None:
            return Machine(where=self.where, state="gone", note="not in `sky status`")
        return Machine(where=row.infra, state=row.status, uptime_s=row.uptime_s, hourly_cost=row.hourly_cost,
                       accelerators=", ".join(f"{k}:{v:g}" for k, v in (row.accelerators or {}).items()) or "CPUs")

    async def _provider_price(self) -> float | None:
        """SkyPilot's price of the cluster (its launched resources), for each step's cost."""
        try:
            rows = {row.name: row for row in await provisioner.status()}
        except Exception as exc:  # noqa: BLE001 (the price is a report: steps go on without it)
            log.warning("no price for %s: SkyPilot could not be asked (%s); steps are not costed", self.cluster_name,
                        exc)
            return None
        row = rows.get(self.cluster_name)
        return row.hourly_cost if row is not None else None

    @classmethod
    def from_record(cls, record: clusters.ClusterRecord, *, local_port: int = 0,
                    settings: Settings | None = None) -> SkyPilotBackend:
        backend = cls(record.name, None, local_port=local_port, settings=settings)
        backend.target = record.target
        return backend._attached(record)


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


def _recorded_key(home: Path, cluster_name: str) -> str | None:
    """The API key `art-sky up` (or another process) recorded for this SkyPilot cluster, if any."""
    if cluster_name not in clusters.all_names(home):
        return None
    record = clusters.load(home, cluster_name)
    if record.kind != "sky":
        raise ConfigError(f"the name {cluster_name!r} is taken by a {record.kind} cluster on {record.where}: "
                          f"`art-sky down {cluster_name}` first, or pick another cluster_name")
    return record.api_key.get_secret_value()
