"""CLI commands for clusters on SSH hosts: up, down, status, logs, tunnel, ssh. `register(app)` mounts them.

Each command is a thin wrapper: `up` is `SSHBackend(...).health()` plus a cluster record; the others read the
record (`art_sky.clusters`) and use the same bootstrap and tunnel functions as the Python API.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shlex
from enum import Enum
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from art_sky import bootstrap, clusters
from art_sky.backends.ssh import SSHBackend, parse_host
from art_sky.bootstrap import BootstrapOptions
from art_sky.errors import ArtSkyError, ConfigError
from art_sky.ssh import SSHSession

console = Console()


class Extras(str, Enum):
    cluster = "cluster"
    gpu = "gpu"


NAME = typer.Option("default", "--name", "-n", help="the cluster's name (its record: ~/.art-sky/clusters/NAME.json)")


def up(
    host: str = typer.Option(..., "--host", help="user@host[:port] of a machine you can ssh into"),
    key: Path | None = typer.Option(None, "--key", help="private key file (default: ssh-agent, ~/.ssh keys)"),
    name: str = NAME,
    python: str | None = typer.Option(None, help="a prepared interpreter on the host that already has the "
                                                "dependencies of art-sky's cluster extra: skips venv and installs"),
    venv_python: str = typer.Option("python3", help="interpreter on the host that creates the venv"),
    system_site_packages: bool = typer.Option(False, help="the venv sees the host's packages (a preinstalled torch)"),
    extras: Extras = typer.Option(Extras.cluster, help="extras installed in the venv: cluster, or gpu for vLLM "
                                                       "and Unsloth"),
    remote_dir: str = typer.Option(".art-sky/server", help="working directory on the host (relative: under home)"),
    port: int = typer.Option(0, help="the server's port on the host (it binds 127.0.0.1 only); 0 picks a free one"),
    force_restart: bool = typer.Option(False, help="restart the server even if one is up with this version"),
) -> None:
    """Start the cluster server on your own machine over SSH: ship this client's build, install, start it."""
    target = parse_host(host, key)
    if name in clusters.all_names():
        existing = clusters.load(name)
        if existing.target != target:
            raise ConfigError(f"cluster {name!r} runs on {existing.target}: `art-sky down --name {name}` first, "
                              "or pick another --name")
        if not force_restart and _healthy(name):
            console.print(f"cluster {name!r} is already up (same version); --force-restart restarts it")
            return
    options = BootstrapOptions(remote_dir=remote_dir, python=python, venv_python=venv_python,
                               system_site_packages=system_site_packages, extras=extras.value, port=port)
    backend = SSHBackend(target, options=options, keep_server=True)

    async def start() -> clusters.ClusterRecord:
        try:
            await backend.health()
            return backend.record(name)
        finally:
            await backend.close()

    with console.status(f"starting the cluster server on {host} ..."):
        record = asyncio.run(start())
    clusters.save(record)
    console.print(f"cluster {name!r} up on {record.target}, server port {record.port} (127.0.0.1 there).\n"
                  f"Use it from Python with `art_sky.SSHBackend.attach({name!r})`, or hold a tunnel with "
                  f"`art-sky tunnel --name {name}`.")


def down(name: str = NAME) -> None:
    """Stop the cluster's server and forget the cluster (the host and its files stay)."""
    record = clusters.load(name)
    with SSHSession(record.target) as session:
        stopped = bootstrap.stop_server(session, record.remote_dir)
    clusters.remove(name)
    console.print(f"cluster {name!r}: server {'stopped' if stopped else 'was not running'}; record removed")


def status() -> None:
    """List the clusters and whether each one's server runs."""
    table = Table("name", "host", "server", "remote dir")
    for name in clusters.all_names():
        record = clusters.load(name)
        try:
            with SSHSession(record.target) as session:
                state = bootstrap.server_status(session, record.remote_dir)
            shown = f"{state.state} (port {state.port})" if state.port else state.state
        except ArtSkyError as exc:
            shown = f"unreachable: {exc}"
        table.add_row(name, str(record.target), shown, record.remote_dir)
    console.print(table if table.row_count else "no clusters: start one with `art-sky up --host user@host`")


def logs(name: str = NAME, lines: int = typer.Option(50, "--lines", "-l", min=1, help="how many lines")) -> None:
    """Print the last lines of the cluster server's log."""
    record = clusters.load(name)
    with SSHSession(record.target) as session:
        text = bootstrap.server_log(session, record.remote_dir, lines)
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def tunnel(name: str = NAME, local_port: int = typer.Option(0, help="local port on 127.0.0.1; 0 picks one")) -> None:
    """Hold a tunnel to the cluster's server in the foreground (Ctrl-C ends it); prints base URL and API key."""
    backend = SSHBackend.attach(name, local_port=local_port)

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
    target = clusters.load(name).target
    argv = ["ssh", "-p", str(target.port)]
    if target.key_path:
        argv += ["-i", str(target.key_path), "-o", "IdentitiesOnly=yes"]
    if target.proxy_command:
        argv += ["-o", f"ProxyCommand={target.proxy_command}"]
    argv += [f"{target.user}@{target.host}", *([shlex.join(command)] if command else [])]
    os.execvp("ssh", argv)


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
            console.print("[red]error:[/red]", escape(str(exc)), highlight=False)
            raise typer.Exit(1) from exc

    return wrapper


def _healthy(name: str) -> bool:
    """Is the recorded server up and of this client's version? (an SSH probe first: a dead one fails fast)"""
    record = clusters.load(name)
    try:
        with SSHSession(record.target) as session:
            if bootstrap.server_status(session, record.remote_dir).state != "listening":
                return False
    except ArtSkyError:
        return False

    async def check() -> bool:
        backend = SSHBackend.attach(name)
        try:
            await backend.health()
            return True
        except ArtSkyError:
            return False
        finally:
            await backend.close()

    return asyncio.run(check())
