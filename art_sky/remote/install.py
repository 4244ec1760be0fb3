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
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, Field, field_validator

from art_sky.errors import SSHError
from art_sky.gpu_stack import constraint_lines
from art_sky.layout import ServerLayout

from .progress import PipOutput, Progress
from .runner import CommandRunner, env_stdin
from .stack import Extras, choose, probe

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
    extras: Extras = Field(
        "auto",
        description="what the venv gets: auto looks at the machine's nvidia-smi (a supported GPU: gpu; none: "
        "cluster with the CPU build of torch); gpu installs the tested GPU stack (vLLM, Unsloth, CUDA torch), "
        "cluster the portable engine and the PEFT trainer with whatever torch pip picks",
    )
    constraints: list[str] = Field(
        default_factory=list,
        description="pip constraints for the venv install, added to the tested GPU stack's with extras=gpu (and "
        "to the CPU stack's torch pin with auto, unless they pin torch themselves)",
    )
    cpu_index: str | None = Field(
        "https://download.pytorch.org/whl/cpu",  # stack.CPU_TORCH_INDEX (the docs show the value)
        description="the package index of the CPU build of torch (auto on a machine without a GPU); None: only "
        "pip's own configuration (a mirror that has it)",
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


def install(
    runner: CommandRunner,
    build: Callable[[], Path],
    options: BootstrapOptions,
    timeout: float,
    *,
    name: str,
    progress: Progress | None = None,
) -> Installed:
    """Build this client's wheel (`build`: once the machine answered, so a wrong host fails first), upload it and
    install it for cluster `name` (venv first unless `options.python`); idempotent. Each phase goes to `progress`.
    When it fails, the cluster's folder is removed if this install made it, and so is a venv it was making."""
    progress = progress or Progress(enabled=False)
    q = shlex.quote
    own = cluster_dir(options.remote_dir, name)
    with progress.phase(f"connecting to {runner.where}"):
        made, remote_dir = runner.run(
            f"if [ -d {q(own)} ]; then echo kept; else echo made; fi\n"
            f"mkdir -p {q(own)}/wheels && cd {q(options.remote_dir)} && pwd",
            timeout=60,
        ).stdout.split("\n", 1)
    remote_dir = remote_dir.strip()
    try:
        return _install(runner, build, options, timeout, remote_dir, cluster_dir(remote_dir, name), progress)
    except BaseException:
        tidy = [f"rm -rf {q(cluster_dir(remote_dir, name))}"] if made == "made" else []
        if options.python is None:  # a venv this install was making (a complete one is marked)
            tidy.append(f"[ -f {q(remote_dir)}/{VENV_READY} ] || rm -rf {q(remote_dir)}/venv")
        if tidy:
            with contextlib.suppress(Exception):  # the install's own error is the one to report
                runner.run("\n".join(tidy), timeout=120, check=False)
        raise


def _install(
    runner: CommandRunner,
    build: Callable[[], Path],
    options: BootstrapOptions,
    timeout: float,
    remote_dir: str,
    own: str,
    progress: Progress,
) -> Installed:
    q = shlex.quote
    python = options.python or f"{remote_dir}/venv/bin/python"
    version = _python_version(runner, options.python or options.venv_python)
    progress.note(f"Python {version} at {options.python or options.venv_python}")
    with progress.phase("building this client's wheel"):
        wheel = build()
    remote_wheel = f"{own}/wheels/{wheel.name}"
    with progress.phase(f"uploading {wheel.name} ({wheel.stat().st_size / 1e6:.1f} MB)"):
        runner.upload(wheel, remote_wheel)
    if options.python is None:
        _make_venv(runner, options, remote_dir, own, remote_wheel, version, timeout, progress)
    with progress.phase("installing this build of art-sky"):
        runner.run(
            f"{q(python)} -m pip install --quiet --disable-pip-version-check --no-deps --upgrade "
            f"--target {q(own)}/lib {q(remote_wheel)}",
            timeout=timeout,
        )
    layout = ServerLayout(run_dir=posixpath.join(own, "run"), art_path=posixpath.join(remote_dir, options.art_path))
    return Installed(layout=layout, python=python, pythonpath=posixpath.join(own, "lib"))


def _python_version(runner: CommandRunner, interpreter: str) -> str:
    """The interpreter's version ("3.12.3"), or an SSHError when it is missing or older than 3.11."""
    check = "import sys; print(sys.version.split()[0]); sys.exit(0 if sys.version_info >= (3, 11) else 3)"
    preflight = runner.run(
        f"{shlex.quote(interpreter)} -c {shlex.quote(check)} 2>/dev/null || exit {_NO_PYTHON}", timeout=60, check=False
    )
    found = preflight.stdout.strip()
    if preflight.exit_code == _NO_PYTHON:
        raise SSHError(
            f"no Python >= 3.11 at {interpreter!r} on {runner.where}{f' (it is {found})' if found else ''}: install "
            "one there, or name it with python= (a prepared environment) or venv_python="
        )
    return found


def _make_venv(
    runner: CommandRunner,
    options: BootstrapOptions,
    remote_dir: str,
    own: str,
    remote_wheel: str,
    version: str,
    timeout: float,
    progress: Progress,
) -> None:
    """The shared venv, with the stack that fits the machine (or the one asked for) installed into it."""
    q = shlex.quote
    stack = choose(
        probe(runner),
        options.extras,
        where=runner.where,
        python=".".join(version.split(".")[:2]),
        cpu_index=options.cpu_index,
        constraints=options.constraints,
    )
    progress.note(f"stack: {stack.label}: {stack.reason}")
    constraints = options.constraints + stack.constraints + (constraint_lines() if stack.extras == "gpu" else [])
    pins = "".join(f" --extra-index-url {q(url)}" for url in stack.index_urls)
    if constraints:
        runner.run(
            f"cat >{q(own)}/wheels/constraints.txt",
            timeout=60,
            stdin="".join(f"{line}\n" for line in constraints).encode(),
        )
        pins += f" -c {q(own)}/wheels/constraints.txt"
    venv = f"{remote_dir}/venv"
    # A venv without the mark is half made (an install that failed or was killed): made again; `install` removes
    # it when this install fails.
    if runner.run(f"[ -f {q(remote_dir)}/{VENV_READY} ]", timeout=60, check=False).exit_code != 0:
        site = " --system-site-packages" if options.system_site_packages else ""
        with progress.phase(f"creating the venv {venv}"):
            runner.run(f"rm -rf {q(venv)}\n{q(options.venv_python)} -m venv{site} {q(venv)}", timeout=timeout)
    with progress.phase(f"installing {stack.label}") as phase:
        pip = PipOutput()
        runner.run(
            f"{q(venv)}/bin/python -m pip install --disable-pip-version-check --progress-bar off{pins} "
            f"{q(f'{remote_wheel}[{stack.extras}]')}",
            timeout=timeout,
            output=phase.output(pip.line),
        )
        runner.run(f"touch {q(remote_dir)}/{VENV_READY}", timeout=60)
    if summary := pip.summary():
        progress.note(summary)
