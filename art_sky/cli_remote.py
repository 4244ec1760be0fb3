"""CLI commands for clusters: up, down, status, logs, tunnel, ssh. `register(app)` mounts them.

Each command is a thin wrapper over the Python API: `up` is `SkyPilotBackend.initialize_cluster` (default),
`SSHBackend(...).health()` (`--host`) or the bootstrap's detached start on this machine (`--local`), plus a
cluster record (`art_sky.clusters`); the others read the record and use the same bootstrap, session and tunnel
code whatever the cluster's kind.
"""

from __future__ import annotations

import asyncio
import functools
import os
import secrets
import shlex
import sys
from enum import Enum
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from art_sky import bootstrap, clusters
from art_sky.backends import SkyPilotBackend, SSHBackend, attach
from art_sky.backends.ssh import parse_host
from art_sky.bootstrap import BootstrapOptions
from art_sky.errors import ArtSkyError, ConfigError
from art_sky.local_session import LocalSession, open_session
from art_sky.provisioners import sky as provisioner
from art_sky.settings import settings
from art_sky.ssh import known_hosts_file

console = Console()

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
    port: int = typer.Option(0, help="the server's port on the host (it binds 127.0.0.1 only); 0 picks a free "
                                     "one", rich_help_panel=HOST),
    force_restart: bool = typer.Option(False, help="restart the server even if one is up with this version"),
) -> None:
    """Start a cluster server: on a SkyPilot cluster (launched or reused), an SSH host, or this machine."""
    if host and local:
        raise ConfigError("--host and --local name two different machines: give one (or neither, for SkyPilot)")
    kind = "ssh" if host else "local" if local else "sky"
    target = parse_host(host, key) if host else None
    if name in clusters.all_names():
        existing = clusters.load(name)
        if existing.kind != kind or (kind == "ssh" and existing.target != target):
            raise ConfigError(f"cluster {name!r} runs on {existing.where} ({existing.kind}): `art-sky down --name "
                              f"{name}` first, or pick another --name")
        if kind != "sky" and not force_restart and _healthy(name):
            console.print(f"cluster {name!r} is already up (same version); --force-restart restarts it")
            return
    if kind == "sky":
        record = _up_sky(name, gpu=_gpus(gpu), infra=infra, spot=spot, autostop=autostop, cpus=cpus, memory=memory,
                         env_file=env_file, force_restart=force_restart)
    elif kind == "local":
        record = _up_local(name, port)
    else:
        options = BootstrapOptions(remote_dir=remote_dir, python=python, venv_python=venv_python,
                                   system_site_packages=system_site_packages, extras=extras.value, port=port)
        with console.status(f"starting the cluster server on {host} ..."):
            record = _up_ssh(name, SSHBackend(target, options=options, keep_server=True))
    clusters.save(record)
    console.print(f"cluster {name!r} up on {record.where}, server port {record.port} (127.0.0.1 there).\n"
                  f"Use it from Python with `art_sky.attach({name!r})`, or hold a tunnel with "
                  f"`art-sky tunnel --name {name}`.")


def _gpus(values: list[str]) -> str | list[str] | None:
    """`--gpu A --gpu B,C` into SkyPilot's fallback list; `none` for a CPU-only server."""
    gpus = [g.strip() for value in values for g in value.split(",") if g.strip()]
    if [g.lower() for g in gpus] == ["none"]:
        return None
    if not gpus or "none" in (g.lower() for g in gpus):
        raise ConfigError("--gpu: give accelerators (H100:1, A100-80GB:1, ...) or `none` alone for CPUs")
    return gpus[0] if len(gpus) == 1 else gpus


def _up_sky(name: str, *, gpu, infra, spot, autostop, cpus, memory, env_file, force_restart) -> clusters.ClusterRecord:
    resources = {k: v for k, v in (("cpus", cpus), ("memory", memory)) if v is not None}

    async def start() -> clusters.ClusterRecord:
        backend = await SkyPilotBackend.initialize_cluster(
            cluster_name=name, gpu=gpu, infra=infra, resources=resources, spot=spot,
            autostop_minutes=autostop or None, env_path=env_file, force_restart=force_restart)
        await backend.close()
        return clusters.load(name)  # initialize_cluster recorded it

    console.print(f"launching or reusing SkyPilot cluster {name!r} (SkyPilot's progress follows) ...")
    return asyncio.run(start())


def _up_ssh(name: str, backend: SSHBackend) -> clusters.ClusterRecord:
    async def start() -> clusters.ClusterRecord:
        try:
            await backend.health()
            return backend.record(name)
        finally:
            await backend.close()

    return asyncio.run(start())


def _up_local(name: str, port: int) -> clusters.ClusterRecord:
    """The bootstrap's detached start, on this machine with this interpreter: it outlives this command."""
    remote_dir = settings().home / "local" / name
    remote_dir.mkdir(parents=True, exist_ok=True)
    api_key = settings().api_key.get_secret_value() if settings().api_key else secrets.token_urlsafe(32)
    with console.status("starting the cluster server on this machine ..."):
        server = bootstrap.start_server(LocalSession(), str(remote_dir), sys.executable, api_key,
                                        BootstrapOptions(port=port))
    return clusters.ClusterRecord(name=name, kind="local", target=None, remote_dir=server.remote_dir,
                                  port=server.port, pid=server.pid, api_key=api_key)


def down(name: str = NAME,
         force: bool = typer.Option(False, "--force", help="stop even if checkpoints are not in the object store "
                                                           "yet, or the server cannot be reached to ask")) -> None:
    """Stop the cluster's server and forget the cluster. A SkyPilot cluster is torn down (`sky down`); an SSH host
    and its files stay. Waits first until every checkpoint is in the object store (when one is configured)."""
    record = clusters.load(name)
    if not force:
        with console.status(f"waiting until {name!r} has uploaded its checkpoints ..."):
            asyncio.run(_flush(name))
    if record.kind == "sky":
        with console.status(f"tearing down SkyPilot cluster {name!r} ..."):
            asyncio.run(provisioner.down(name))
        done = "SkyPilot cluster torn down"
    else:
        with open_session(record.target) as session:
            done = "server stopped" if bootstrap.stop_server(session, record.remote_dir) else "server was not running"
    clusters.remove(name)
    console.print(f"cluster {name!r}: {done}; record removed")


async def _flush(name: str) -> None:
    backend = attach(name)
    try:
        await backend.flush_checkpoints()
    except ArtSkyError as exc:
        raise ConfigError(f"not stopping {name!r}: {exc}. Fix it, or `art-sky down --name {name} --force`") from exc
    finally:
        await backend.close()


def status() -> None:
    """The clusters: kind, where, accelerators, uptime and cost (where SkyPilot knows the price), server health,
    models and their steps."""
    names = clusters.all_names()
    if not names:
        console.print("no clusters: start one with `art-sky up` (SkyPilot), `--host user@host` or `--local`")
        return
    records = [clusters.load(name) for name in names]
    sky_rows = _sky_rows() if any(r.kind == "sky" for r in records) else {}
    table = Table("name", "kind", "where", "accelerators", "uptime, cost", "server", "models (step)")
    for column in table.columns:
        column.overflow = "fold"  # show every character: names and hosts get copied from here
    for record in records:
        where, accelerators, cost = record.where, "-", "-"
        if isinstance(sky_rows, str) and record.kind == "sky":
            where = sky_rows
        elif record.kind == "sky" and record.name not in sky_rows:
            where = "gone (not in `sky status`)"
        elif record.kind == "sky":
            row = sky_rows[record.name]
            where = f"{row.infra} ({row.status})"
            accelerators = ", ".join(f"{k}:{v:g}" for k, v in (row.accelerators or {}).items()) or "CPUs"
            cost = _uptime_and_cost(row)
        table.add_row(record.name, record.kind, where, accelerators, cost, *_server(record.name))
    console.print(table)


def _uptime_and_cost(row: provisioner.ClusterInfo) -> str:
    """"2h05m, $3.20/h, $6.67 so far": the price where SkyPilot knows one."""
    uptime = row.uptime_s or 0.0
    minutes = int(uptime // 60)
    shown = f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m"
    if row.hourly_cost is None:
        return f"{shown}, price unknown"
    return f"{shown}, ${row.hourly_cost:.2f}/h, ${row.hourly_cost * uptime / 3600:.2f} so far"


def _sky_rows() -> dict[str, provisioner.ClusterInfo] | str:
    """SkyPilot's clusters by name, or why SkyPilot could not be asked."""
    try:
        return {row.name: row for row in asyncio.run(provisioner.status())}
    except ArtSkyError as exc:
        return f"SkyPilot unreachable: {exc}"


def _server(name: str) -> tuple[str, str]:
    """Server health and models with steps, asked through the cluster's tunnel."""

    async def ask() -> tuple[str, str]:
        backend = attach(name)
        try:
            health = await backend.health()
            models = await backend.models()
            return (f"ok, {health.engine} on {health.device}",
                    ", ".join(f"{m.name} ({m.step})" for m in models) or "none")
        except ArtSkyError as exc:
            return f"unreachable: {exc}", "-"
        finally:
            await backend.close()

    return asyncio.run(ask())


def logs(name: str = NAME, lines: int = typer.Option(50, "--lines", "-l", min=1, help="how many lines"),
         follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new lines (Ctrl-C ends)")) -> None:
    """Print the last lines of the cluster server's log, or follow it."""
    record = clusters.load(name)
    if follow:
        log = f"{record.remote_dir}/run/server.log"
        argv = ["tail", "-n", str(lines), "-F", log]
        os.execvp(*_on_machine(record, argv))
    with open_session(record.target) as session:
        text = bootstrap.server_log(session, record.remote_dir, lines)
    console.print(text, markup=False, highlight=False, soft_wrap=True)


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
    record = clusters.load(name)
    if record.target is None:
        raise ConfigError(f"cluster {name!r} runs on this machine: its files are in {record.remote_dir}")
    os.execvp(*_on_machine(record, command or []))


def _on_machine(record: clusters.ClusterRecord, command: list[str]) -> tuple[str, list[str]]:
    """execvp's arguments that run `command` (a shell when empty) on the cluster's machine: the system's ssh with
    the record's key, ProxyCommand and environment (a SkyPilot Slurm job's HOME), or directly here."""
    target = record.target
    if target is None:
        return command[0], command
    argv = ["ssh", "-p", str(target.port)]
    if target.key_path:
        argv += ["-i", str(target.key_path), "-o", "IdentitiesOnly=yes"]
    if target.proxy_command:  # as art_sky.ssh.connect: a proxied cluster's host key changes with every cluster
        argv += ["-o", f"ProxyCommand={target.proxy_command}", "-o", "StrictHostKeyChecking=no",
                 "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]
    else:  # the host key art-sky pinned when it first connected
        argv += ["-o", f"UserKnownHostsFile={known_hosts_file()}"]
    argv += [arg for k, v in target.env.items() for arg in ("-o", f"SetEnv={k}={v}")]
    argv += [f"{target.user}@{target.host}", *([shlex.join(command)] if command else [])]
    return "ssh", argv


def register(app: typer.Typer) -> None:
    """Mount these commands on the `art-sky` app."""
    for command in (up, down, status, logs, tunnel, ssh):
        app.command()(_friendly_errors(command))


def _friendly_errors(command):
    """art-sky's errors end a command with their message and exit code 1, not a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except ArtSkyError as exc:
            console.print("[red]error:[/red]", escape(str(exc)), highlight=False, soft_wrap=True)
            raise typer.Exit(1) from exc

    return wrapper


def _healthy(name: str) -> bool:
    """Is the recorded server up and of this client's version? (a shell probe first: a dead one fails fast)"""
    record = clusters.load(name)
    try:
        with open_session(record.target) as session:
            if bootstrap.server_status(session, record.remote_dir).state != "listening":
                return False
    except ArtSkyError:
        return False

    async def check() -> bool:
        backend = attach(name)
        try:
            await backend.health()
            return True
        except ArtSkyError:
            return False
        finally:
            await backend.close()

    return asyncio.run(check())
