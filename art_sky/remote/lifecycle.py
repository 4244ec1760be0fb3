"""The cluster server's one lifecycle on a machine, over a command runner (this machine, an SSH host, a SkyPilot
cluster's node): start it detached, wait until it is ready, read its log, stop its process group.

Every backend and every CLI command goes through these functions; the files they read are the server's run files
(art_sky.layout), which `python -m art_sky.cluster --run-dir` writes however it was started (here, or as a
SkyPilot task's job).
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable
from typing import Literal

import httpx
from pydantic import BaseModel

from art_sky.errors import BackendUnavailableError
from art_sky.layout import ServerLayout

from .reasons import fix, reason
from .runner import READ_ENV, CommandRunner, env_stdin

STOP_GRACE = 15.0  # seconds between SIGTERM and SIGKILL
# sh: is a pid alive? An orphan that exited may linger as a zombie (kill -0 succeeds) where nothing reaps it.
_ALIVE = """alive() { kill -0 "$1" 2>/dev/null && ! grep -qs '^[0-9]* (.*) Z' "/proc/$1/stat"; }\n"""


class ServerStatus(BaseModel):
    state: Literal["listening", "starting", "stopped"]
    port: int | None = None
    pid: int | None = None


class RemoteServer(BaseModel):
    """A running server: where its files are on its machine, its port there, its pid (its process group's)."""

    layout: ServerLayout
    port: int
    pid: int


def start(
    runner: CommandRunner,
    layout: ServerLayout,
    *,
    python: str,
    env: dict[str, str],
    port: int = 0,
    pythonpath: str | None = None,
    exit_with: int | None = None,
    args: tuple[str, ...] = (),
) -> None:
    """Stop any server of `layout.run_dir`, then start a new one detached (it outlives the runner's session; with
    `exit_with`, a pid on the server's machine, not that process). `env` (the API key among it) travels on stdin into
    the server's environment: never in argv or a file. `args` go to `python -m art_sky.cluster` (a worker node's
    `--join HEAD_URL`)."""
    stop(runner, layout)
    q = shlex.quote
    path = f"PYTHONPATH={q(pythonpath)}${{PYTHONPATH:+:$PYTHONPATH}} " if pythonpath else ""
    script = (
        f"set -e\numask 077\n{READ_ENV}{path}exec {q(python)} -m art_sky.cluster --detach --port {port} "
        f"--run-dir {q(layout.run_dir)} --art-path {q(layout.art_path)}"
        f"{f' --exit-with {exit_with}' if exit_with is not None else ''}"
        f"{''.join(' ' + q(arg) for arg in args)}\n"
    )
    started = runner.run(script, timeout=120, stdin=env_stdin(env), check=False)
    if started.exit_code != 0:  # refused before it detached (a bad setting, --port, no such python): on stderr
        output = (started.stderr.strip() or started.stdout.strip())[-2000:]
        why = reason(output) or f"it wrote no error (exit code {started.exit_code})"
        todo = f": {fix(why)}" if fix(why) else ""
        raise BackendUnavailableError(f"the cluster server on {runner.where} did not start: {why}{todo}\n{output}")


def status(runner: CommandRunner, layout: ServerLayout) -> ServerStatus:
    """Is the server of `layout` running, and on which port?"""
    q = shlex.quote
    probe = (
        f'{_ALIVE}pid=$(cat {q(layout.pid_file)} 2>/dev/null) && alive "$pid" || {{ echo stopped; exit 0; }}\n'
        f"cat {q(layout.port_file)} 2>/dev/null || echo starting"
    )
    state = runner.run(probe, timeout=30).stdout.strip()
    if state.startswith("{"):
        found = json.loads(state)
        return ServerStatus(state="listening", port=found["port"], pid=found["pid"])
    return ServerStatus(state="starting" if state == "starting" else "stopped")


def wait_ready(
    runner: CommandRunner,
    layout: ServerLayout,
    *,
    timeout: float,
    reach: Callable[[int], str],
    stop_on_timeout: bool,
    waits_for_start: bool = False,
    hint: str = "",
) -> RemoteServer:
    """The one readiness wait: until the server has written its port file and answers /health at the URL
    `reach(port)` gives (a tunnel's, for a remote machine). A server that exits, or is not ready within `timeout`,
    raises `BackendUnavailableError` (stopped first when `stop_on_timeout`): its first line says what happened, the
    reason the server wrote last in its log, what to do (`hint`) and where the log is; the log's last lines follow.

    `waits_for_start`: a stopped server is one not started yet (a SkyPilot job still setting up), not a failure.
    """
    deadline = time.monotonic() + timeout
    while True:
        state = status(runner, layout)
        if state.state == "listening":
            assert state.port is not None and state.pid is not None
            if answers_health(reach(state.port)):
                return RemoteServer(layout=layout, port=state.port, pid=state.pid)
        elif state.state == "stopped" and not waits_for_start:
            raise failure(runner, layout, "exited before it was listening", hint)
        if time.monotonic() > deadline:
            error = failure(
                runner,
                layout,
                f"was not healthy within {timeout:.0f}s (ART_SKY_SERVER_START_TIMEOUT)",
                "; ".join(["it was stopped"] * stop_on_timeout + [hint] * bool(hint)),
                going=True,
            )
            if stop_on_timeout:
                stop(runner, layout)
            raise error
        time.sleep(0.3)


def failure(
    runner: CommandRunner, layout: ServerLayout, what: str, todo: str = "", *, going: bool = False
) -> BackendUnavailableError:
    """A server that failed: one line saying what happened, the reason it wrote (its log's last error; for one
    still `going`, else what it was doing), what to do and where its log is (if it still exists); then the log's
    last lines (a command line shows them only when asked: they are detail)."""
    tail = _tail(runner, layout)
    why = reason(tail or "", any_level=going) or (
        "it wrote no error (stopped from outside, or out of memory?)" if tail else "it left no log"
    )
    todo = "; ".join(filter(None, [fix(why), todo]))
    where = f". Its log: {layout.log_file}" if tail is not None else ""
    return BackendUnavailableError(
        f"the cluster server on {runner.where} {what}: {why}{f'; {todo}' if todo else ''}{where}"
        f"\nLast lines of the log:\n{tail or '(no log)'}"
    )


def answers_health(base_url: str) -> bool:
    """Does a server at `base_url` answer /health (no key needed)?"""
    try:
        return httpx.get(f"{base_url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def log(runner: CommandRunner, layout: ServerLayout, lines: int = 30) -> str:
    """The last lines of the server's log."""
    return _tail(runner, layout, lines) or "(no log yet)"


def _tail(runner: CommandRunner, layout: ServerLayout, lines: int = 30) -> str | None:
    """The log's last lines; None when there is no log file (never written, or removed since)."""
    log_file = shlex.quote(layout.log_file)
    result = runner.run(f"[ -f {log_file} ] || exit 3\ntail -n {int(lines)} {log_file}", timeout=30, check=False)
    return None if result.exit_code == 3 else result.stdout.rstrip()


def follow_argv(runner: CommandRunner, layout: ServerLayout, lines: int) -> list[str]:
    """argv (for exec) that prints the log's last lines and then every new one, until interrupted."""
    return runner.shell_argv(["tail", "-n", str(int(lines)), "-F", layout.log_file])


def stop(runner: CommandRunner, layout: ServerLayout, grace: float = STOP_GRACE) -> bool:
    """Stop the server of `layout` (its whole process group: SIGTERM, SIGKILL after `grace`); True if one ran."""
    q = shlex.quote
    script = (
        _ALIVE
        + f"""pid=$(cat {q(layout.pid_file)} 2>/dev/null) || exit 0
rm -f {q(layout.pid_file)} {q(layout.port_file)}
alive "$pid" || exit 0
kill -s TERM -- "-$pid" 2>/dev/null || kill -s TERM "$pid"
i=0
while alive "$pid" && [ $i -lt {int(grace * 10)} ]; do sleep 0.1; i=$((i + 1)); done
kill -s KILL -- "-$pid" 2>/dev/null || kill -s KILL "$pid" 2>/dev/null || true
echo stopped
"""
    )
    return runner.run(script, timeout=grace + 30).stdout.strip() == "stopped"
