"""Start the cluster server on a machine reached over SSH: ship the wheel, install, launch detached, find its port.

The same steps serve an SSH host and a SkyPilot cluster (given the `SSHTarget` SkyPilot records). Layout of
`remote_dir` on the machine:

    wheels/   the shipped client build        lib/   that build, installed (shadows any other art_sky)
    venv/     made here unless `python` is set art/   checkpoints (--art-path)
    run/      server.log, server.pid, port.json
"""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from art_sky.errors import BackendUnavailableError, ConfigError, SSHError
from art_sky.gpu_stack import constraint_lines
from art_sky.settings import settings
from art_sky.ssh import SSHSession

_NO_PYTHON = 42  # exit code of the preflight script when the interpreter is missing or too old
# sh: is a pid alive? An orphan that exited may linger as a zombie (kill -0 succeeds) where nothing reaps it.
_ALIVE = """alive() { kill -0 "$1" 2>/dev/null && ! grep -qs '^[0-9]* (.*) Z' "/proc/$1/stat"; }\n"""


class BootstrapOptions(BaseModel):
    """Where and how the server runs on the remote machine."""

    remote_dir: str = Field(".art-sky/server", description="relative paths are under the login directory")
    python: str | None = Field(None, description="a prepared interpreter that already has art-sky[cluster]'s "
                                                 "dependencies; the venv step is skipped")
    venv_python: str = Field("python3", description="interpreter that creates the venv when `python` is unset")
    system_site_packages: bool = Field(False, description="the venv sees the host's packages (a preinstalled torch)")
    extras: Literal["cluster", "gpu"] = Field("cluster", description="art-sky extras installed in the venv; gpu "
                                                                     "installs the tested GPU stack")
    constraints: list[str] = Field(default_factory=list, description="pip constraints for the venv install "
                                                                    "(e.g. torch==2.13.0: a CPU build), added to "
                                                                    "the tested GPU stack's with extras=gpu")
    port: int = Field(0, description="the server's port on the remote machine; 0 picks a free one")
    art_path: str = Field("art", description="checkpoint root, relative to remote_dir unless absolute")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of the server (ART_SKY_*, "
                                                                   "store credentials); sent over stdin")

    @field_validator("remote_dir")
    @classmethod
    def _home_relative(cls, value: str) -> str:
        return value.removeprefix("~/") or "."

    @field_validator("env")
    @classmethod
    def _one_line_values(cls, value: dict[str, str]) -> dict[str, str]:
        for key, item in value.items():
            if not key.isidentifier() or "\n" in item:
                raise ConfigError(f"environment variable {key!r}: names must be identifiers and values one line")
        return value


class ServerStatus(BaseModel):
    state: Literal["listening", "starting", "stopped"]
    port: int | None = None
    pid: int | None = None


class RemoteServer(BaseModel):
    """A server started by `start_server`: what `stop_server`, `server_log` and a tunnel need."""

    remote_dir: str  # absolute
    port: int
    pid: int


def install(session: SSHSession, wheel: Path, options: BootstrapOptions) -> tuple[str, str]:
    """Upload the wheel and install it (venv first unless `options.python`); idempotent.

    Returns the absolute remote dir and the interpreter that runs the server.
    """
    remote_dir = session.run(f"mkdir -p {shlex.quote(options.remote_dir)}/wheels && cd "
                             f"{shlex.quote(options.remote_dir)} && pwd", timeout=60).stdout.strip()
    q = shlex.quote
    python = options.python or f"{remote_dir}/venv/bin/python"
    bootstrap_python = options.python or options.venv_python
    preflight = session.run(
        f"{q(bootstrap_python)} -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 3)' >/dev/null 2>&1"
        f" || exit {_NO_PYTHON}", timeout=60, check=False)
    if preflight.exit_code == _NO_PYTHON:
        raise SSHError(f"no Python >= 3.11 at {bootstrap_python!r} on {session.target}: install one there, or "
                       "name it with python= (a prepared environment) or venv_python=")
    remote_wheel = f"{remote_dir}/wheels/{wheel.name}"
    session.upload(wheel, remote_wheel)
    steps = []
    if options.python is None:
        site = " --system-site-packages" if options.system_site_packages else ""
        constraints = options.constraints + (constraint_lines() if options.extras == "gpu" else [])
        pins = " -c wheels/constraints.txt" if constraints else ""
        steps += [f"[ -x venv/bin/python ] || {q(options.venv_python)} -m venv{site} venv",
                  f"printf '%s\\n' {' '.join(q(c) for c in constraints)} >wheels/constraints.txt",
                  (f"venv/bin/python -m pip install --quiet --disable-pip-version-check{pins} "
                   f"{q(f'{remote_wheel}[{options.extras}]')}")]
    steps.append(f"{q(python)} -m pip install --quiet --disable-pip-version-check --no-deps --upgrade "
                 f"--target lib {q(remote_wheel)}")
    session.run(f"set -e\ncd {q(remote_dir)}\n" + "\n".join(steps), timeout=settings().remote_install_timeout)
    return remote_dir, python


def start_server(session: SSHSession, remote_dir: str, python: str, api_key: str, options: BootstrapOptions,
                 timeout: float | None = None) -> RemoteServer:
    """Stop any server in `remote_dir`, start a new one detached (it outlives the SSH session), wait for its port.

    The API key and `options.env` travel over stdin into the server's environment: never in argv or a file.
    """
    timeout = settings().server_start_timeout if timeout is None else timeout
    stop_server(session, remote_dir)
    q = shlex.quote
    script = f"""set -e
cd {q(remote_dir)}
mkdir -p run
umask 077
while IFS= read -r kv; do [ -n "$kv" ] || break; export "$kv"; done
rm -f run/port.json
[ ! -f run/server.log ] || mv run/server.log run/server.log.1
PYTHONPATH="$PWD/lib${{PYTHONPATH:+:$PYTHONPATH}}" setsid nohup {q(python)} -m art_sky.cluster \\
  --port {options.port} --art-path {q(options.art_path)} --port-file run/port.json \\
  >run/server.log 2>&1 </dev/null &
echo $! >run/server.pid
"""
    env = options.env | {"ART_SKY_API_KEY": api_key}
    session.run(script, timeout=60, stdin="".join(f"{k}={v}\n" for k, v in env.items()).encode() + b"\n")
    deadline = time.monotonic() + timeout
    while True:
        status = server_status(session, remote_dir)
        if status.state == "listening":
            assert status.port is not None and status.pid is not None
            return RemoteServer(remote_dir=remote_dir, port=status.port, pid=status.pid)
        if status.state == "stopped":
            raise BackendUnavailableError(
                f"the cluster server on {session.target} exited before it was listening. Last lines of "
                f"{remote_dir}/run/server.log:\n{server_log(session, remote_dir)}")
        if time.monotonic() > deadline:
            log_tail = server_log(session, remote_dir)
            stop_server(session, remote_dir)
            raise not_healthy(session, remote_dir, timeout, log_tail)
        time.sleep(0.5)


def server_status(session: SSHSession, remote_dir: str) -> ServerStatus:
    """Is a server started from `remote_dir` running, and on which port?"""
    probe = (f"{_ALIVE}cd {shlex.quote(remote_dir)} 2>/dev/null || {{ echo stopped; exit 0; }}\n"
             "pid=$(cat run/server.pid 2>/dev/null) && alive \"$pid\" || { echo stopped; exit 0; }\n"
             "cat run/port.json 2>/dev/null || echo starting")
    state = session.run(probe, timeout=30).stdout.strip()
    if state.startswith("{"):
        found = json.loads(state)
        return ServerStatus(state="listening", port=found["port"], pid=found["pid"])
    return ServerStatus(state="starting" if state == "starting" else "stopped")


def not_healthy(session: SSHSession, remote_dir: str, timeout: float, log_tail: str,
                stopped: bool = True) -> BackendUnavailableError:
    """The error for a server that did not get healthy in time (also raised by a backend's health wait)."""
    what = "it was stopped" if stopped else "restart it with `art-sky up --force-restart`"
    return BackendUnavailableError(
        f"the cluster server on {session.target} was not healthy within {timeout:.0f}s "
        f"(ART_SKY_SERVER_START_TIMEOUT); {what}. Last lines of {remote_dir}/run/server.log:\n{log_tail}")


def stop_server(session: SSHSession, remote_dir: str, grace: float = 15.0) -> bool:
    """Stop the server started from `remote_dir` (its whole process group); True if one was running."""
    script = _ALIVE + f"""cd {shlex.quote(remote_dir)} 2>/dev/null || exit 0
pid=$(cat run/server.pid 2>/dev/null) || exit 0
rm -f run/server.pid run/port.json
alive "$pid" || exit 0
kill -s TERM -- "-$pid" 2>/dev/null || kill -s TERM "$pid"
i=0
while alive "$pid" && [ $i -lt {int(grace * 10)} ]; do sleep 0.1; i=$((i + 1)); done
kill -s KILL -- "-$pid" 2>/dev/null || true
echo stopped
"""
    return session.run(script, timeout=grace + 30).stdout.strip() == "stopped"


def server_log(session: SSHSession, remote_dir: str, lines: int = 30) -> str:
    """The last lines of the remote server's log."""
    result = session.run(f"tail -n {int(lines)} {shlex.quote(remote_dir)}/run/server.log", timeout=30, check=False)
    return result.stdout.rstrip() or "(no log yet)"
