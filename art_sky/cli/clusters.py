"""CLI commands for clusters: up, status, logs, tunnel, ssh (mounted by art_sky.cli; down is cli/down.py).

Each takes the cluster's name as its first argument (`art-sky down box`, as `sky down box`), `--name` as an
alias, `art` by default. Each command is a thin wrapper over the backends: `up` builds the backend its flags ask
for (a SkyPilot cluster by default, `--host`, or `--local`), starts it and records it; the others `attach` to the
record (the one place its kind picks a backend) and call the same methods whatever the kind.
"""

from __future__ import annotations

import asyncio
import os
from enum import StrEnum
from pathlib import Path
from typing import NoReturn

import typer
from typer._click import Context  # typer's vendored click: what a command's methods get (typer.Context subclasses it)
from typer._click.core import ParameterSource

from art_sky import clusters
from art_sky.backends import ClusterBackend, LocalBackend, SkyPilotBackend, SSHBackend, attach
from art_sky.errors import ArtSkyError, ConfigError
from art_sky.provisioners.sky_task import parse_gpus
from art_sky.remote.install import BootstrapOptions
from art_sky.remote.progress import Progress
from art_sky.settings import Settings

from .conventions import Command
from .errors import console
from .launch import confirm_launch
from .status import status_command

SKY, HOST = "SkyPilot cluster (default)", "SSH host (--host) and this machine (--local)"


class Extras(StrEnum):
    auto = "auto"
    cluster = "cluster"
    gpu = "gpu"


# Flags that apply to one kind of target only: given for another, they are an error rather than ignored.
_SKY_ONLY = (
    "infra",
    "gpu",
    "nodes",
    "model",
    "spot",
    "recover",
    "recover_from_scratch",
    "autostop",
    "cpus",
    "memory",
    "env_file",
)
_HOST_ONLY = ("key", "python", "venv_python", "system_site_packages", "extras", "remote_dir")
_LOCAL_ONLY = ("path",)


DEFAULT_NAME = "art"
NAME = typer.Argument(
    None,
    metavar="NAME",
    show_default=False,
    help=f"the cluster's name (default: {DEFAULT_NAME}); its record is "
    "~/.art-sky/clusters/NAME.json, and a SkyPilot cluster has this name too",
)
NAME_OPTION = typer.Option(None, "--name", "-n", metavar="NAME", show_default=False, help="the same as NAME")


def cluster_name(argument: str | None, option: str | None) -> str:
    """The cluster a command is about: NAME, or `--name` (its older spelling), or the default."""
    if argument and option and argument != option:
        raise ConfigError(f"two cluster names, {argument!r} and --name {option!r}: give one")
    return clusters.check_name(argument or option or DEFAULT_NAME)


class CommandAfterDashes(Command):
    """`art-sky ssh NAME -- COMMAND...`: everything after `--` is the command, so `art-sky ssh -- ls` runs `ls` on
    the default cluster rather than taking `ls` for a cluster's name."""

    def parse_args(self, ctx: Context, args: list[str]) -> list[str]:
        if "--" not in args:
            return super().parse_args(ctx, args)
        split = args.index("--")
        rest = super().parse_args(ctx, args[:split])
        ctx.params["command"] = args[split + 1 :]
        return rest


def up(
    ctx: typer.Context,
    name: str | None = NAME,
    name_option: str | None = NAME_OPTION,
    host: str | None = typer.Option(
        None,
        "--host",
        help="user@host[:port] of a machine you can ssh into, instead of a SkyPilot cluster",
        rich_help_panel=HOST,
    ),
    local: bool = typer.Option(
        False, "--local", help="run the server detached on this machine instead", rich_help_panel=HOST
    ),
    infra: str | None = typer.Option(
        None,
        help="SkyPilot infra: aws, gcp/us-central1, k8s/<context>, slurm/<cluster>; default: any enabled one",
        rich_help_panel=SKY,
    ),
    gpu: list[str] | None = typer.Option(
        None,
        show_default="H100:1",
        help="accelerator and count, e.g. H100:1, or H100:8 (vLLM on 7 GPUs, "
        "the trainer on one); repeat it or give a comma list for "
        "fallbacks tried in order; `none` for CPUs only",
        rich_help_panel=SKY,
    ),
    nodes: int = typer.Option(
        1,
        "--nodes",
        min=1,
        help="nodes, each with --gpu: the server on the head, an engine replica and trainer ranks on every node",
        rich_help_panel=SKY,
    ),
    model: str | None = typer.Option(
        None,
        "--model",
        help="the base model you will train: refused before renting if its shards do not fit the GPUs",
        rich_help_panel=SKY,
    ),
    spot: bool = typer.Option(False, help="use spot instances", rich_help_panel=SKY),
    recover: bool | None = typer.Option(
        None,
        "--recover/--no-recover",
        show_default="on with --spot and an object store",
        help="relaunch the cluster when it is lost (preempted, stopped) and "
        "go on from the object store, in the process whose loop uses it (attach)",
        rich_help_panel=SKY,
    ),
    recover_from_scratch: bool = typer.Option(
        False,
        "--recover-from-scratch",
        rich_help_panel=SKY,
        help="with --recover and no object store: relaunch from step 0 anyway",
    ),
    autostop: int = typer.Option(
        60,
        min=0,
        help="tear the cluster down after this many idle minutes; 0 never "
        "(needed where the infra has no autostop, e.g. plain Slurm)",
        rich_help_panel=SKY,
    ),
    cpus: str | None = typer.Option(None, help="vCPUs, e.g. 4 or 8+", rich_help_panel=SKY),
    memory: str | None = typer.Option(None, help="memory in GB, e.g. 16 or 32+", rich_help_panel=SKY),
    env_file: Path | None = typer.Option(
        None,
        help="a .env file whose variables reach the server in a 0600 file (object store keys)",
        rich_help_panel=SKY,
    ),
    key: Path | None = typer.Option(
        None, "--key", help="private key file (default: ssh-agent, ~/.ssh keys)", rich_help_panel=HOST
    ),
    python: str | None = typer.Option(
        None,
        help="a prepared interpreter on the host that already has the "
        "dependencies of art-sky's cluster extra: skips venv and installs",
        rich_help_panel=HOST,
    ),
    venv_python: str = typer.Option(
        "python3", help="interpreter on the host that creates the venv", rich_help_panel=HOST
    ),
    system_site_packages: bool = typer.Option(
        False, help="the venv sees the host's packages (a preinstalled torch)", rich_help_panel=HOST
    ),
    extras: Extras = typer.Option(
        Extras.auto,
        help="what the venv gets: auto looks at the host's nvidia-smi (a supported GPU: gpu, none: cluster with "
        "the CPU build of torch); gpu for vLLM, Unsloth and CUDA torch; cluster for the portable engine",
        rich_help_panel=HOST,
    ),
    remote_dir: str = typer.Option(
        ".art-sky/server",
        help="art-sky's directory on the host (relative: under home), "
        "shared by its clusters; each has its own clusters/NAME "
        "there",
        rich_help_panel=HOST,
    ),
    path: Path = typer.Option(
        Path(".art"), help="--local: the checkpoint root (ART's .art, as LocalBackend's)", rich_help_panel=HOST
    ),
    port: int = typer.Option(
        0,
        min=0,
        max=65535,
        help="the server's port on the host (it binds 127.0.0.1 only); 0 picks a free one",
        rich_help_panel=HOST,
    ),
    force_restart: bool = typer.Option(False, help="restart the server even if one is up with this version"),
    yes: bool = typer.Option(
        False,
        "--yes",
        "-y",
        help="launch without asking first (needed where stdin is no terminal: CI, scripts)",
        rich_help_panel=SKY,
    ),
) -> None:
    """Start a cluster server: on a SkyPilot cluster (launched or reused), an SSH host, or this machine."""
    name = cluster_name(name, name_option)
    if host and local:
        raise ConfigError("--host and --local name two different machines: give one (or neither, for SkyPilot)")
    check_flags(ctx, "--host" if host else "--local" if local else None)
    settings = Settings()
    if host:
        options = BootstrapOptions(
            remote_dir=remote_dir,
            python=python,
            venv_python=venv_python,
            system_site_packages=system_site_packages,
            extras=extras.value,
            port=port,
        )
        backend: ClusterBackend = SSHBackend(
            host, key_path=key, options=options, keep_server=True, name=name, settings=settings
        )
    elif local:
        backend = LocalBackend(path=path, name=name, port=port, keep_server=True, settings=settings)
    else:
        backend = SkyPilotBackend.for_cluster(
            cluster_name=name,
            gpu=parse_gpus(gpu or ["H100:1"]),
            infra=infra,
            spot=spot,
            autostop_minutes=autostop or None,
            resources={k: v for k, v in (("cpus", cpus), ("memory", memory)) if v is not None},
            env_path=env_file,
            force_restart=force_restart,
            settings=settings,
            num_nodes=nodes,
            base_model=model,
            recover="from-scratch" if recover_from_scratch else recover,
        )
    if name in clusters.all_names(settings.home):
        existing = clusters.load(settings.home, name)
        if (existing.kind, existing.where) != (backend.kind, backend.where):
            raise ConfigError(
                f"cluster {name!r} runs on {existing.where} ({existing.kind}): `art-sky down {name}` "
                "first, or pick another name"
            )
        if not force_restart and asyncio.run(_answers(attach(name, settings=settings, recover=False))):
            console.print(f"cluster {name!r} is already up (same version); --force-restart restarts it")
            return
    if isinstance(backend, SkyPilotBackend):
        confirm_launch(backend, yes)  # what it would rent, asked before renting
        console.print(f"starting the cluster server on {backend.where} ...")  # (SkyPilot streams its own progress)
    backend.progress = Progress(verbose=bool(ctx.find_root().params.get("verbose")))  # each phase, on stderr
    record = asyncio.run(_start(backend, name))
    console.print(
        f"cluster {name!r} up on {record.where}, server port {record.port} (127.0.0.1 there).\n"
        f"Use it from Python with `art_sky.attach({name!r})`, or hold a tunnel with "
        f"`art-sky tunnel {name}`."
    )


def check_flags(ctx: Context, target: str | None) -> None:
    """Refuse flags given on the command line that do not apply to `target` (--host, --local, None: SkyPilot)."""
    given = {p.name: p.opts[0] for p in ctx.command.params if p.name and p.opts}
    given = {k: v for k, v in given.items() if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}
    groups = [
        (_SKY_ONLY, "a SkyPilot cluster", target is not None),
        (_HOST_ONLY, "--host", target != "--host"),
        (_LOCAL_ONLY, "--local", target != "--local"),
    ]
    for names, owner, misplaced in groups:
        wrong = [given[n] for n in names if n in given and misplaced]
        if wrong:
            one = len(wrong) == 1
            machine = "this machine's" if target == "--local" else "the host's"
            why = f" ({machine} own GPUs are used as they are)" if "--gpu" in wrong and target else ""
            raise ConfigError(
                f"{', '.join(wrong)} {'does' if one else 'do'} not apply to {target or 'a SkyPilot cluster'}: "
                f"{'it is' if one else 'they are'} for {owner}{why}; drop {'it' if one else 'them'}"
            )


async def _start(backend: ClusterBackend, name: str) -> clusters.ClusterRecord:
    try:
        await backend.health()
        record = backend.record(name)
        clusters.save(backend.settings.home, record)
        clusters.forget_stopped(backend.settings.home, name)  # up again: its files are in use
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


def status(
    names: list[str] | None = typer.Argument(
        None, metavar="NAME", show_default=False, help="only these clusters (default: every one)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print JSON for scripts: a list with one object per cluster"),
) -> None:
    """The clusters: kind, where, accelerators, uptime and cost (where SkyPilot knows the price), server state,
    models and their steps. One line per cluster; a narrow terminal cuts other columns, never names."""
    status_command(names, as_json)


def logs(
    name: str | None = NAME,
    name_option: str | None = NAME_OPTION,
    lines: int = typer.Option(50, "--lines", "-l", min=1, help="how many lines"),
    follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new lines (Ctrl-C ends)"),
) -> None:
    """Print the last lines of the cluster server's log (it need not be running), or follow it."""
    backend = attach(cluster_name(name, name_option), recover=False)
    if follow:
        _exec(backend.follow_argv(lines))
    console.print(asyncio.run(_logs(backend, lines)), markup=False, highlight=False, soft_wrap=True)


async def _logs(backend: ClusterBackend, lines: int) -> str:
    try:
        return await backend.logs(lines)
    finally:
        await backend.close()


def tunnel(
    name: str | None = NAME,
    name_option: str | None = NAME_OPTION,
    local_port: int = typer.Option(0, min=0, max=65535, help="local port on 127.0.0.1; 0 picks one"),
) -> None:
    """Hold a tunnel to the cluster's server in the foreground (Ctrl-C ends it); prints base URL and API key."""
    backend = attach(cluster_name(name, name_option), local_port=local_port, recover=False)

    async def hold() -> None:
        try:
            await backend.health()
            console.print(
                f"ART_SKY_BASE_URL={backend.base_url}\nART_SKY_API_KEY={backend.api_key}\n"
                f"OpenAI-compatible endpoint: {backend.inference_base_url}  (Ctrl-C closes the tunnel)",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            await asyncio.Event().wait()
        finally:
            await backend.close()

    try:
        asyncio.run(hold())
    except KeyboardInterrupt:
        console.print("tunnel closed")


def ssh(
    name: str | None = NAME,
    command: list[str] | None = typer.Argument(
        None, metavar="COMMAND", show_default=False, help="a command to run instead of a shell, after `--`"
    ),
    name_option: str | None = NAME_OPTION,
) -> None:
    """Open a shell (or run a command: `art-sky ssh NAME -- COMMAND...`) on the cluster's machine with the system's
    ssh client."""
    _exec(attach(cluster_name(name, name_option), recover=False).shell_argv(command or []))


def _exec(argv: list[str]) -> NoReturn:
    """Become `argv` (ssh, tail): its output, its Ctrl-C and its exit code are the command's."""
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        raise ConfigError(f"cannot run {argv[0]!r} ({exc.strerror}): install it (OpenSSH's client for `ssh`)") from exc
