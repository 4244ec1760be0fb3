"""`art-sky status`: what each recorded cluster is doing. `cluster_statuses` gathers it as data (every cluster at
once); the table and `--json` are two renderings of that same data.

A server is looked at before it is asked: its run files on its machine say whether it runs at all, so a server
that exited is reported at once (no request, no tunnel), and only a running one is asked for its health and models.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Literal

from pydantic import BaseModel

from art_sky import clusters
from art_sky.backends import attach
from art_sky.backends.cluster import Machine
from art_sky.backends.local import pid_running
from art_sky.errors import ArtSkyError, VersionMismatchError
from art_sky.settings import Settings
from art_sky.wire import FleetReplica, ModelInfo

from . import live, table
from .errors import console


class ServerReport(BaseModel):
    state: Literal["ok", "starting", "exited", "unreachable", "error", "recovering"]
    detail: str  # "portable on cpu" when ok; else what is wrong and what to do, in one line
    engine: str | None = None
    trainer: str | None = None
    device: str | None = None
    version: str | None = None
    placement: str | None = None  # how the node's GPUs are split (cluster/node/placement.py)
    log: str | None = None  # the server log's path on its machine (`art-sky logs NAME` prints it)
    fleet: list[FleetReplica] = []  # the inference replicas behind its /v1 (cluster/inference/fleet.py)


class ClusterStatus(BaseModel):
    name: str
    kind: str  # local, ssh, sky (as the record says)
    machine: Machine
    server: ServerReport
    models: list[ModelInfo] = []  # each with what the server is doing with it (cli/live.py renders it)
    recovery: clusters.RecoveryStatus | None = None  # a SkyPilot cluster's relaunches (art_sky/backends/recovery.py)


async def cluster_status(name: str, settings: Settings) -> ClusterStatus:
    """One cluster, as its record, its machine and (if it runs) its server say."""
    try:
        backend = attach(name, settings=settings, recover=False)
    except ArtSkyError as exc:
        return ClusterStatus(
            name=name, kind="?", machine=Machine(where="?"), server=ServerReport(state="error", detail=_line(exc))
        )
    log = backend.server.layout.log_file if backend.server else None
    recovery = clusters.load(settings.home, name).recovery
    if recovery is not None and recovery.state == "recovering" and pid_running(recovery.pid):
        await backend.close()  # the record's machine is the lost one: nothing to ask there
        return ClusterStatus(
            name=name,
            kind=backend.kind,
            machine=await backend.machine(),
            recovery=recovery,
            server=ServerReport(
                state="recovering",
                log=log,
                detail=(f"recovering for {time.time() - recovery.since:.0f} s: {recovery.reason}"),
            ),
        )
    machine = await backend.machine()
    models: list[ModelInfo] = []  # each with what the server is doing with it (cli/live.py renders it)
    try:
        if machine.state not in (None, "UP"):
            server = ServerReport(state="unreachable", detail=f"the cluster is {machine.state}", log=log)
        else:
            state = (await backend.server_state()).state
            if state == "stopped":
                server = ServerReport(
                    state="exited",
                    log=log,
                    detail=f"exited: `art-sky logs {name}` shows why, `art-sky up {name}` starts it again",
                )
            elif state == "starting":
                server = ServerReport(state="starting", detail="starting", log=log)
            else:
                health = await backend.health()
                models = await backend.models()
                detail = f"{health.engine} on {health.device}"
                if health.gpu_sharing == "dedicated":  # vLLM on GPUs of its own: say which
                    detail += f", {health.placement}"
                server = ServerReport(
                    state="ok",
                    detail=detail,
                    engine=health.engine,
                    trainer=health.trainer,
                    device=health.device,
                    version=health.version,
                    placement=health.placement,
                    log=log,
                    fleet=health.fleet,
                )
    except VersionMismatchError as exc:
        server = ServerReport(state="error", detail=_line(exc), log=log)
    except ArtSkyError as exc:
        server = ServerReport(state="unreachable", detail=_line(exc), log=log)
    finally:
        await backend.close()
    if recovery is not None and server.state == "ok" and recovery.recoveries:
        server.detail += (
            f", {recovery.recoveries} recover{'y' if recovery.recoveries == 1 else 'ies'} "
            f"({recovery.downtime_s:.0f} s down)"
        )
    return ClusterStatus(name=name, kind=backend.kind, machine=machine, server=server, models=models, recovery=recovery)


async def cluster_statuses(names: list[str], settings: Settings) -> list[ClusterStatus]:
    return list(await asyncio.gather(*(cluster_status(name, settings) for name in names)))


def _line(exc: Exception) -> str:
    return str(exc).strip().partition("\n")[0]


# -- renderings ------------------------------------------------------------------------------------------------

HEADERS = ("NAME", "KIND", "WHERE", "ACCELERATORS", "UPTIME, COST", "SERVER", "MODELS (STEP)")
SHRINK = (6, 5, 4, 3, 2)  # a narrow terminal cuts models, server, cost, accelerators, where; never name, kind


def row(status: ClusterStatus) -> list[str]:
    machine, server = status.machine, status.server
    where = f"{machine.where} ({machine.state})" if machine.state else machine.where
    if machine.note:
        where += f": {machine.note}"
    health = f"ok, {server.detail}" if server.state == "ok" else server.detail
    models = ", ".join(f"{m.served or m.name} ({m.step})" for m in status.models) or (
        "none" if server.state == "ok" else "-"
    )
    return [status.name, status.kind, where, machine.accelerators or "-", uptime_and_cost(machine), health, models]


FLEET_HEADERS = ("REPLICA", "NODE", "LOAD", "SERVED", "SERVES")


def fleet_row(cluster: str, replica: FleetReplica) -> list[str]:
    """One inference replica of a cluster with several: its load, completions so far, and the step of each model
    it serves (a model it is still loading is not listed)."""
    where = "head" if replica.url == "local" else replica.url
    return [
        f"{cluster}/{where}",
        replica.node,
        f"{replica.outstanding} outstanding",
        str(replica.completions),
        ", ".join(f"{name}@{step}" for name, step in sorted(replica.steps.items())) or "loading",
    ]


def uptime_and_cost(machine: Machine) -> str:
    """ "2h05m, $3.20/h, $6.67 so far": the price where SkyPilot knows one."""
    if machine.uptime_s is None:
        return "-"
    minutes = int(machine.uptime_s // 60)
    shown = f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m"
    if machine.hourly_cost is None:
        return f"{shown}, price unknown"
    return f"{shown}, ${machine.hourly_cost:.2f}/h, ${machine.hourly_cost * machine.uptime_s / 3600:.2f} so far"


def show(statuses: list[ClusterStatus], as_json: bool) -> None:
    if as_json:
        print(json.dumps([s.model_dump(mode="json") for s in statuses], indent=2))
    else:
        table.show(HEADERS, [row(s) for s in statuses], shrink=SHRINK)
        if models := [live.row(s.name, m) for s in statuses for m in s.models]:
            console.print()
            table.show(live.HEADERS, models, shrink=live.SHRINK)
        if replicas := [fleet_row(s.name, r) for s in statuses if len(s.server.fleet) > 1 for r in s.server.fleet]:
            console.print()
            table.show(FLEET_HEADERS, replicas, shrink=(4, 3))


def status_command(names: list[str] | None, as_json: bool) -> None:
    settings = Settings()
    known = clusters.all_names(settings.home)
    if unknown := [n for n in names or [] if n not in known]:
        raise clusters.unknown(settings.home, unknown[0])
    names = list(dict.fromkeys(names or [])) or known  # each cluster once, in the order given
    if not names and not as_json:
        console.print("no clusters: start one with `art-sky up` (SkyPilot), `--host user@host` or `--local`")
        return
    show(asyncio.run(cluster_statuses(names, settings)), as_json)
