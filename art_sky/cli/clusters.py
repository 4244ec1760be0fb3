"""CLI commands for clusters: up, down, status, logs, tunnel, ssh (mounted by art_sky.cli).

Each command is a thin wrapper over the backends: `up` builds the backend its flags ask for (a SkyPilot cluster by
default, `--host`, or `--local`), starts it and records it; the others `attach` to the record (the one place its
kind picks a backend) and call the same methods whatever the kind.
"""

from __future__ import annotations

import asyncio
import os
from enum import Enum
from pathlib import Path

import typer
from rich.table import Table

from art_sky import clusters
from art_sky.backends import ClusterBackend, LocalBackend, SkyPilotBackend, SSHBackend, attach
from art_sky.errors import ArtSkyError, ConfigError
from art_sky.provisioners.sky_task import parse_gpus
from art_sky.remote.install import BootstrapOptions
from art_sky.settings import Settings
from art_sky.wire import ModelInfo

from . import live
from .errors import console

SKY, HOST = "SkyPilot cluster (default)", "SSH host (--host) and this machine (--local)"


class Extras(str, Enum):
    cluster = "cluster"
    gpu = "gpu"


NAME = typer.Option("art", "--name", "-n", help="the cluster's name (its record: ~/.art-sky/clusters/NAME.json; "
                                                 "a SkyPilot cluster's name too)")


def up(
    name: str = NAME,
    host: str | None = typer.Option(None, "--host", help="user@host[:port] of a machine you can ssh into, instead "
                                                        "of a SkyPilot cluster", rich_help_panel=HOST),
    local: bool = typer.Option(False, "--local", help="run the server detached on this machine instead",
                               rich_help_panel=HOST),
    infra: str | None = typer.Option(None, help="SkyPilot infra: aws, gcp/us-central1, k8s/<context>, "
                                                "slurm/<cluster>; default: any enabled one", rich_help_panel=SKY),
    gpu: list[str] = typer.Option(["H100:1"], help="accelerator, e.g. H100:1; repeat it or give a comma list for "
                                                   "fallbacks tried in order; `none` for CPUs only",
                                  rich_help_panel=SKY),
    spot: bool = typer.Option(False, help="use spot instances", rich_help_panel=SKY),
    autostop: int = typer.Option(60, min=0, help="tear the cluster down after this many idle minutes; 0 never "
                                                 "(needed where the infra has no autostop, e.g. plain Slurm)",
                                 rich_help_panel=SKY),
    cpus: str | None = typer.Option(None, help="vCPUs, e.g. 4 or 8+", rich_help_panel=SKY),
    memory: str | None = typer.Option(None, help="memory in GB, e.g. 16 or 32+", rich_help_panel=SKY),
    env_file: Path | None = typer.Option(None, help="a .env file whose variables reach the server as SkyPilot "
                                                    "secrets (object store keys)", rich_help_panel=SKY),
    key: Path | None = typer.Option(None, "--key", help="private key file (default: ssh-agent, ~/.ssh keys)",
                                    rich_help_panel=HOST),
    python: str | None = typer.Option(None, help="a prepared interpreter on the host that already has the "
                                                 "dependencies of art-sky's cluster extra: skips venv and installs",
                                      rich_help_panel=HOST),
    venv_python: str = typer.Option("python3", help="interpreter on the host that creates the venv",
                                    rich_help_panel=HOST),
    system_site_packages: bool = typer.Option(False, help="the venv sees the host's packages (a preinstalled "
                                                          "torch)", rich_help_panel=HOST),
    extras: Extras = typer.Option(Extras.cluster, help="extras installed in the venv: cluster, or gpu for vLLM "
                                                       "and Unsloth", rich_help_panel=HOST),
    remote_dir: str = typer.Option(".art-sky/server", help="working directory on the host (relative: under home)",
                                   rich_help_panel=HOST),
    path: Path = typer.Option(Path(".art"), help="--local: the checkpoint root (ART's .art, as LocalBackend's)",
                              rich_help_panel=HOST),
    port: int = typer.Option(0, help="the server's port on the host (it binds 127.0.0.1 only); 0 picks a free "
                                     "one", rich_help_panel=HOST),
    force_restart: bool = typer.Option(False, help="restart the server even if one is up with this version"),
) -> None:
    """Start a cluster server: on a SkyPilot cluster (launched or reused), an SSH host, or this machine."""
    if host and local:
        raise ConfigError("--host and --local name two different machines: give one (or neither, for SkyPilot)")
    settings = Settings()
    if host:
        options = BootstrapOptions(remote_dir=remote_dir, python=python, venv_python=venv_python,
                                   system_site_packages=system_site_packages, extras=extras.value, port=port)
        backend: ClusterBackend = SSHBackend(host, key_path=key, options=options, keep_server=True, settings=settings)
    elif local:
        backend = LocalBackend(path=path, name=name, port=port, keep_server=True, settings=settings)
    else:
        backend = SkyPilotBackend.for_cluster(
            cluster_name=name, gpu=parse_gpus(gpu), infra=infra, spot=spot, autostop_minutes=autostop or None,
            resources={k: v for k, v in (("cpus", cpus), ("memory", memory)) if v is not None}, env_path=env_file,
            force_restart=force_restart, settings=settings)
    if name in clusters.all_names(settings.home):
        existing = clusters.load(settings.home, name)
        if (existing.kind, existing.where) != (backend.kind, backend.where):
            raise ConfigError(f"cluster {name!r} runs on {existing.where} ({existing.kind}): `art-sky down --name "
                              f"{name}` first, or pick another --name")
        if not force_restart and asyncio.run(_answers(attach(name, settings=settings))):
            console.print(f"cluster {name!r} is already up (same version); --force-restart restarts it")
            return
    console.print(f"starting the cluster server on {backend.where} ...")  # (SkyPilot streams its own progress)
    record = asyncio.run(_start(backend, name))
    console.print(f"cluster {name!r} up on {record.where}, server port {record.port} (127.0.0.1 there).\n"
                  f"Use it from Python with `art_sky.attach({name!r})`, or hold a tunnel with "
                  f"`art-sky tunnel --name {name}`.")


async def _start(backend: ClusterBackend, name: str) -> clusters.ClusterRecord:
    try:
        await backend.health()
        record = backend.record(name)
        clusters.save(backend.settings.home, record)
        return record
    finally:
        await backend.close()


async def _answers(backend: ClusterBackend) -> bool:
    """Is the recorded server up and of this client's version?"""
    try:
        await backend.health()
        return True
    except ArtSkyError:
        return False
    finally:
        await backend.close()


def down(name: str = NAME,
         force: bool = typer.Option(False, "--force", help="stop even if checkpoints are not in the object store "
                                                           "yet, or the server cannot be reached to ask")) -> None:
    """Stop the cluster's server and forget the cluster. A SkyPilot cluster is torn down (`sky down`); an SSH host
    and its files stay. Waits first until every checkpoint is in the object store (when one is configured)."""
    settings = Settings()
    backend = attach(name, settings=settings)
    with console.status(f"waiting until {name!r} has its checkpoints in the store, then stopping it ..."):
        done = asyncio.run(backend.down(force=force))
    clusters.remove(settings.home, name)
    console.print(f"cluster {name!r}: {done}; record removed")


def status() -> None:
    """The clusters: kind, where, accelerators, uptime and cost (where SkyPilot knows the price), server health,
    models and their steps."""
    settings = Settings()
    names = clusters.all_names(settings.home)
    if not names:
        console.print("no clusters: start one with `art-sky up` (SkyPilot), `--host user@host` or `--local`")
        return
    table = Table("name", "kind", "where", "accelerators", "uptime, cost", "server", "models (step)")
    models = Table(*live.HEADERS)
    for column in (*table.columns, *models.columns):
        column.overflow = "fold"  # show every character: names and hosts get copied from here
    for name in names:
        backend = attach(name, settings=settings)
        machine, health, infos = asyncio.run(_describe(backend))
        table.add_row(name, backend.kind, machine["where"], machine.get("accelerators", "-"),
                      machine.get("cost", "-"), health,
                      ", ".join(f"{m.name} ({m.step})" for m in infos) or ("none" if health.startswith("ok") else "-"))
        for info in infos:
            models.add_row(*live.row(name, info))
    console.print(table)
    if models.rows:
        console.print(models)


async def _describe(backend: ClusterBackend) -> tuple[dict[str, str], str, list[ModelInfo]]:
    """The machine, the server's health, and its models with what the server is doing with each."""
    machine = await backend.machine()
    try:
        health = await backend.health()
        return machine, f"ok, {health.engine} on {health.device}", await backend.models()
    except ArtSkyError as exc:
        return machine, f"unreachable: {exc}", []
    finally:
        await backend.close()


def logs(name: str = NAME, lines: int = typer.Option(50, "--lines", "-l", min=1, help="how many lines"),
         follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new lines (Ctrl-C ends)")) -> None:
    """Print the last lines of the cluster server's log, or follow it."""
    backend = attach(name)
    if follow:
        argv = backend.follow_argv(lines)
        os.execvp(argv[0], argv)
    console.print(asyncio.run(backend.logs(lines)), markup=False, highlight=False, soft_wrap=True)


def tunnel(name: str = NAME, local_port: int = typer.Option(0, help="local port on 127.0.0.1; 0 picks one")) -> None:
    """Hold a tunnel to the cluster's server in the foreground (Ctrl-C ends it); prints base URL and API key."""
    backend = attach(name, local_port=local_port)

    async def hold() -> None:
        try:
            await backend.health()
            console.print(f"ART_SKY_BASE_URL={backend.base_url}\nART_SKY_API_KEY={backend.api_key}\n"
                          f"OpenAI-compatible endpoint: {backend.inference_base_url}  (Ctrl-C closes the tunnel)",
                          markup=False, highlight=False, soft_wrap=True)
            await asyncio.Event().wait()
        finally:
            await backend.close()

    try:
        asyncio.run(hold())
    except KeyboardInterrupt:
        console.print("tunnel closed")


def ssh(name: str = NAME, command: list[str] | None = typer.Argument(None, help="a command to run instead of a shell"),
        ) -> None:
    """Open a shell (or run a command) on the cluster's machine with the system's ssh client."""
    argv = attach(name).shell_argv(command or [])
    os.execvp(argv[0], argv)
