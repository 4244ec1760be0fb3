"""`art-sky ci run`: the CI entry point (mounted as `art-sky ci`). It reads the options, picks the runner
(a SkyPilot cluster, or `--host`) and leaves every guarantee to `art_sky.ci.job.run_job`."""

from __future__ import annotations

import re
import secrets
import shlex
from pathlib import Path

import typer

from art_sky.ci.job import EXIT_ERROR, Runner, SkyPilotRunner, SSHHostRunner, format_summary, run_job
from art_sky.errors import ConfigError
from art_sky.provisioners.sky_task import CIJobSpec, parse_gpus
from art_sky.remote.ssh import SSHTarget
from art_sky.settings import Settings, read_env_file

from .conventions import Command
from .errors import ErrorBoundary


class CIErrors(ErrorBoundary):
    """art-sky's own failures exit with 2, apart from the command's own exit codes."""

    exit_code = EXIT_ERROR
    prefix = "art-sky ci: "


app = typer.Typer(
    help="Run tests or a training smoke run on a fresh GPU machine, always torn down (for CI).",
    no_args_is_help=True,
    add_completion=False,
    cls=CIErrors,
)
AUTODOWN_MARGIN_MINUTES = 5  # idle minutes after the job ends (the node's own timeout ends it) before autodown


@app.command(cls=Command, context_settings={"allow_interspersed_args": False})
def run(
    command: list[str] = typer.Argument(
        ..., help='the command, after `--`; one argument runs as a shell line ("pip install . && pytest")'
    ),
    gpu: str | None = typer.Option(
        None,
        help="an accelerator (H100, H100:8) or a comma-separated fallback list "
        'tried in order ("H100,A100-80GB"); none: CPUs only',
    ),
    spot: bool = typer.Option(False, help="use spot instances"),
    timeout: str = typer.Option("45m", help="the whole job's limit (launch, setup, run): 45m, 1h30m, 600s"),
    workdir: Path = typer.Option(Path("."), help="synced to the machine (honours .skyignore, else .gitignore)"),
    env_file: Path | None = typer.Option(None, help="a .env file whose variables the command sees (as secrets)"),
    keep: bool = typer.Option(False, help="leave the machine up for debugging; prints how to attach and down it"),
    setup: str = typer.Option("", help="a shell line run before the command (installs), timed as setup"),
    host: str | None = typer.Option(None, help="user@host[:port]: run on your own machine over SSH instead"),
    key: Path | None = typer.Option(None, help="private key for --host (default: ssh-agent, ~/.ssh keys)"),
    infra: str | None = typer.Option(None, help="SkyPilot infra: aws, gcp/us-central1, k8s/<context>, slurm/<name>"),
    cpus: str | None = typer.Option(None, help="SkyPilot cpus (4, 8+)"),
    memory: str | None = typer.Option(None, help="SkyPilot memory in GB (16, 32+)"),
    autodown: bool = typer.Option(
        True,
        help="the safety net: the cluster downs itself when idle a few minutes "
        "past the timeout; --no-autodown where the infra refuses autodown",
    ),
    name: str | None = typer.Option(None, help="the cluster's name (default: art-sky-ci-<random>, unique)"),
) -> None:
    """Launch a fresh machine, sync the work dir, run COMMAND with its output streamed, exit with its exit code,
    and tear the machine down on success, failure, timeout, Ctrl-C or CI cancel (SIGTERM)."""
    runner, timeout_s = _runner(
        command,
        gpu=gpu,
        spot=spot,
        timeout=timeout,
        workdir=workdir,
        env_file=env_file,
        setup=setup,
        host=host,
        key=key,
        infra=infra,
        cpus=cpus,
        memory=memory,
        autodown=autodown,
        name=name,
    )
    summary = run_job(runner, timeout_s, keep, write=lambda line: print(line, flush=True))
    print(format_summary(summary), flush=True)
    raise typer.Exit(summary.exit_code)


def _runner(
    command: list[str], *, gpu, spot, timeout, workdir, env_file, setup, host, key, infra, cpus, memory, autodown, name
) -> tuple[Runner, int]:
    line = command[0] if len(command) == 1 else shlex.join(command)
    timeout_s = parse_duration(timeout)
    env = read_env_file(env_file)
    name = name or f"art-sky-ci-{secrets.token_hex(4)}"
    workdir = workdir.expanduser().resolve()
    if host is not None:
        asked = [
            flag
            for flag, value in (
                ("--gpu", gpu),
                ("--spot", spot),
                ("--infra", infra),
                ("--cpus", cpus),
                ("--memory", memory),
            )
            if value
        ]
        if asked:
            raise ConfigError(
                f"{', '.join(asked)} choose a SkyPilot cluster; --host runs on the machine you name "
                "with whatever it has: drop them or drop --host"
            )
        return SSHHostRunner(
            name,
            SSHTarget.parse(host, key),
            command=line,
            setup=setup,
            workdir=workdir,
            timeout_s=timeout_s,
            env=env,
            settings=Settings(),
        ), timeout_s
    spec = ci_spec(
        line,
        gpu=gpu,
        spot=spot,
        timeout_s=timeout_s,
        workdir=workdir,
        env=env,
        setup=setup,
        infra=infra,
        cpus=cpus,
        memory=memory,
        autodown=autodown,
    )
    return SkyPilotRunner(name, spec), timeout_s


def ci_spec(
    line: str,
    *,
    gpu: str | None,
    spot: bool,
    timeout_s: int,
    workdir: Path,
    env: dict[str, str],
    setup: str,
    infra: str | None,
    cpus: str | None,
    memory: str | None,
    autodown: bool,
) -> CIJobSpec:
    """The SkyPilot job the options ask for; `--gpu none` (or no --gpu) runs on CPUs."""
    if not workdir.is_dir():
        raise ConfigError(f"the work dir {workdir} is not a directory: pass --workdir with your project's root")
    resources = {k: v for k, v in (("cpus", cpus), ("memory", memory)) if v is not None}
    return CIJobSpec(
        command=line,
        setup=setup,
        workdir=workdir,
        timeout_s=timeout_s,
        gpu=parse_gpus([gpu]) if gpu else None,
        infra=infra,
        resources=resources,
        spot=spot,
        autodown_minutes=AUTODOWN_MARGIN_MINUTES if autodown else None,
        secrets=env,
    )


def parse_duration(text: str) -> int:
    """Seconds from "45m", "1h30m", "90s" or a plain number of seconds."""
    match = re.fullmatch(r"\s*(?:(\d+)h)?\s*(?:(\d+)m)?\s*(?:(\d+)s?)?\s*", text)
    if not text.strip() or not match or not any(match.groups()):
        raise ConfigError(f"cannot read the duration {text!r}: write it like 45m, 1h30m, 90s or 600")
    hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    if total <= 0:
        raise ConfigError(f"--timeout {text!r} must be positive")
    return total
