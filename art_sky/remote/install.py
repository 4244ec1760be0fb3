"""Install this client's own build on a machine reached by a command runner (an SSH host): ship the wheel, make a
venv unless a prepared Python is named, install. Layout of `remote_dir` there, shared by the host's clusters:

    venv/                     the dependencies, made once (unless `python` names a prepared interpreter);
                              complete once `venv/.art-sky-ready` is there (an unmarked venv is made again)
    art/                      checkpoints (`art_path`), shared by the host's servers as `.art` is on a laptop
    clusters/<name>/wheels/   the build shipped for cluster `name`
    clusters/<name>/lib/      that build, installed (shadows any other art_sky)
    clusters/<name>/run/      that cluster's server: server.log, server.pid, port.json (art_sky.layout)

Each cluster name has its own build and server files, so clusters of one host run side by side and stopping or
reinstalling one never touches another. A failed install leaves nothing the next one trips on: a venv it was making
is removed (and one it could not remove, killed first, is unmarked: the next install makes it again), and so is the
folder of a cluster whose first install failed.
"""

from __future__ import annotations

import contextlib
import posixpath
import shlex
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from art_sky.errors import SSHError
from art_sky.gpu_stack import constraint_lines
from art_sky.layout import ServerLayout

from .runner import CommandRunner, env_stdin

_NO_PYTHON = 42  # exit code of the preflight script when the interpreter is missing or too old
VENV_READY = "venv/.art-sky-ready"  # written once the venv's install succeeded


class BootstrapOptions(BaseModel):
    """Where and how the server runs on the remote machine."""

    remote_dir: str = Field(".art-sky/server", description="relative paths are under the login directory")
    python: str | None = Field(
        None,
        description="a prepared interpreter that already has art-sky[cluster]'s dependencies; the venv step is skipped",
    )
    venv_python: str = Field("python3", description="interpreter that creates the venv when `python` is unset")
    system_site_packages: bool = Field(False, description="the venv sees the host's packages (a preinstalled torch)")
    extras: Literal["cluster", "gpu"] = Field(
        "cluster", description="art-sky extras installed in the venv; gpu installs the tested GPU stack"
    )
    constraints: list[str] = Field(
        default_factory=list,
        description="pip constraints for the venv install "
        "(e.g. torch==2.13.0: a CPU build), added to "
        "the tested GPU stack's with extras=gpu",
    )
    port: int = Field(0, ge=0, le=65535, description="the server's port on the remote machine; 0 picks a free one")
    art_path: str = Field("art", description="checkpoint root, relative to remote_dir unless absolute")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="extra environment of the server (ART_SKY_*, store credentials); sent over stdin",
    )

    @field_validator("remote_dir")
    @classmethod
    def _home_relative(cls, value: str) -> str:
        return value.removeprefix("~/") or "."

    @field_validator("env")
    @classmethod
    def _one_line_values(cls, value: dict[str, str]) -> dict[str, str]:
        env_stdin(value)  # refuses what the server's environment cannot carry
        return value


class Installed(BaseModel):
    """What `install` left on the machine: the server's layout and the interpreter that runs it."""

    layout: ServerLayout
    python: str
    pythonpath: str  # the installed build, ahead of anything else named art_sky


def cluster_dir(remote_dir: str, name: str) -> str:
    """The directory of cluster `name` under a host's art-sky directory: its build and its server's run files."""
    return posixpath.join(remote_dir, "clusters", name)


def install(runner: CommandRunner, wheel: Path, options: BootstrapOptions, timeout: float, *, name: str) -> Installed:
    """Upload the wheel and install it for cluster `name` (venv first unless `options.python`); idempotent. When it
    fails, the cluster's folder is removed if this install made it."""
    q = shlex.quote
    own = cluster_dir(options.remote_dir, name)
    made, remote_dir = runner.run(
        f"if [ -d {q(own)} ]; then echo kept; else echo made; fi\n"
        f"mkdir -p {q(own)}/wheels && cd {q(options.remote_dir)} && pwd",
        timeout=60,
    ).stdout.split("\n", 1)
    remote_dir = remote_dir.strip()
    try:
        return _install(runner, wheel, options, timeout, remote_dir, cluster_dir(remote_dir, name))
    except BaseException:
        tidy = [f"rm -rf {q(cluster_dir(remote_dir, name))}"] if made == "made" else []
        if options.python is None:  # a venv this install was making (a complete one is marked)
            tidy.append(f"[ -f {q(remote_dir)}/{VENV_READY} ] || rm -rf {q(remote_dir)}/venv")
        if tidy:
            with contextlib.suppress(Exception):  # the install's own error is the one to report
                runner.run("\n".join(tidy), timeout=120, check=False)
        raise


def _install(
    runner: CommandRunner, wheel: Path, options: BootstrapOptions, timeout: float, remote_dir: str, own: str
) -> Installed:
    q = shlex.quote
    python = options.python or f"{remote_dir}/venv/bin/python"
    bootstrap_python = options.python or options.venv_python
    preflight = runner.run(
        f"{q(bootstrap_python)} -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 3)' >/dev/null 2>&1"
        f" || exit {_NO_PYTHON}",
        timeout=60,
        check=False,
    )
    if preflight.exit_code == _NO_PYTHON:
        raise SSHError(
            f"no Python >= 3.11 at {bootstrap_python!r} on {runner.where}: install one there, or "
            "name it with python= (a prepared environment) or venv_python="
        )
    remote_wheel = f"{own}/wheels/{wheel.name}"
    runner.upload(wheel, remote_wheel)
    steps = []
    if options.python is None:
        site = " --system-site-packages" if options.system_site_packages else ""
        constraints = options.constraints + (constraint_lines() if options.extras == "gpu" else [])
        pins = ""
        if constraints:
            runner.run(
                f"cat >{q(own)}/wheels/constraints.txt",
                timeout=60,
                stdin="".join(f"{line}\n" for line in constraints).encode(),
            )
            pins = f" -c {q(own)}/wheels/constraints.txt"
        # A venv without the mark is half made (an install that failed or was killed): made again, and removed
        # when its first install fails.
        steps += [
            f"fresh=; if [ ! -f {VENV_READY} ]; then rm -rf venv; fresh=1; "
            f"{q(options.venv_python)} -m venv{site} venv || {{ rm -rf venv; exit 1; }}; fi",
            (
                f"venv/bin/python -m pip install --quiet --disable-pip-version-check{pins} "
                f"{q(f'{remote_wheel}[{options.extras}]')}"
                ' || { code=$?; [ -z "$fresh" ] || rm -rf venv; exit $code; }'
            ),
            f"touch {VENV_READY}",
        ]
    steps.append(
        f"{q(python)} -m pip install --quiet --disable-pip-version-check --no-deps --upgrade "
        f"--target {q(own)}/lib {q(remote_wheel)}"
    )
    runner.run(f"set -e\ncd {q(remote_dir)}\n" + "\n".join(steps), timeout=timeout)
    layout = ServerLayout(run_dir=posixpath.join(own, "run"), art_path=posixpath.join(remote_dir, options.art_path))
    return Installed(layout=layout, python=python, pythonpath=posixpath.join(own, "lib"))
