"""The SkyPilot provisioner: launch or reuse a cluster that runs the server task, and say how to reach it by SSH.

SkyPilot runs in its own environment (sky_env.py): each call here runs sky_driver.py with that interpreter, one
SkyPilot SDK request per process (it talks to SkyPilot's API server, starting one when none runs), relaying its log
and reading back its result. A task is its YAML config (a dict, checked by SkyPilot's schema in `validate_task`).
The server itself is the task's `run:` job (templates/cluster.yaml); `ensure_server` makes sure exactly that job
runs. SSH details come from the ssh-config file that SkyPilot's own `sky status` writes, ProxyCommand and all, so
reaching a Slurm job or a Kubernetes pod works as `ssh <cluster>` does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import paramiko
from pydantic import BaseModel

from art_sky.errors import BackendUnavailableError, ConfigError
from art_sky.remote.reasons import reason
from art_sky.remote.ssh import SSHTarget

from . import sky_driver
from .sky_env import sky_cli, sky_python

log = logging.getLogger("art_sky")

SERVER_JOB = "art-sky-server"  # the template's task name, so the job's name in `sky queue`
_ACTIVE = ("INIT", "PENDING", "SETTING_UP", "RUNNING")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # SkyPilot colours its messages for a terminal; ours are plain text


class Output(Protocol):
    """Where SkyPilot's log goes: a text stream (stdout, a file) or `art-sky ci`'s line printer."""

    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...


class ClusterInfo(BaseModel):
    """One row of `art-sky status`."""

    name: str
    status: str
    infra: str
    resources: str
    accelerators: dict[str, float] | None
    uptime_s: float | None
    hourly_cost: float | None  # None where SkyPilot knows no price


class Launched(BaseModel):
    """A launched cluster's first job: its id, what the cluster costs an hour (None: SkyPilot knows no price) and
    its accelerator ("A100:1", or "none (2 CPUs)")."""

    job_id: int
    hourly_cost: float | None
    accelerator: str


class SkyError(Exception):
    """What sky_driver.py reported: SkyPilot's error, by kind."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


async def _call(
    what: str, op: str, output: Output | None = None, on_request: Callable[[str], None] | None = None, **args: Any
) -> Any:
    """Run one SkyPilot request (sky_driver.py's `op`) in SkyPilot's environment and return its result, relaying
    its log to `output` (default stdout) and translating SkyPilot's errors; `on_request` gets its id (to cancel)."""
    python = await asyncio.to_thread(sky_python)
    process = await asyncio.create_subprocess_exec(  # -u: the driver passes SkyPilot's log lines on as they come
        str(python),
        "-u",
        "-P",
        sky_driver.__file__,
        op,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        limit=1 << 24,
    )
    assert process.stdin is not None and process.stdout is not None  # both are pipes
    process.stdin.write(json.dumps(args).encode())
    process.stdin.close()
    reply, log = None, []
    try:
        async for raw in process.stdout:
            line = raw.decode(errors="replace")
            if line.startswith(sky_driver.MARK):
                message = json.loads(line[len(sky_driver.MARK) :])
                if "request_id" in message and on_request is not None:
                    on_request(message["request_id"])
                reply = message if "request_id" not in message else reply
            else:
                log.append(line)
                stream = output or sys.stdout
                stream.write(line)
                stream.flush()  # a job's output streams as it runs (`art-sky ci run`), not when it ends
        await process.wait()
    except asyncio.CancelledError:
        process.kill()
        raise
    if reply is None:
        tail = "".join(log[-20:]).strip()[-1500:]
        raise BackendUnavailableError(
            f"SkyPilot ({python}) stopped while trying to {what} (exit {process.returncode}): "
            f"{reason(tail) or 'it wrote no error'}\n{tail}"
        )
    if "error" in reply:
        raise _translate(what, SkyError(reply["error"], _ANSI.sub("", reply["message"])))
    return reply["result"]


def _translate(what: str, exc: SkyError) -> Exception:
    sky = sky_cli()
    if exc.kind == "api_server":
        return BackendUnavailableError(
            f"cannot start or reach the SkyPilot API server while trying to {what} ({exc}): run `{sky} api start` "
            f"and read `{sky} api logs`"
        )
    if exc.kind == "resources":
        return BackendUnavailableError(
            f"SkyPilot found no resources to {what}: {exc}. Try another infra or region, a GPU fallback list "
            "(gpu=[...]), or spot=False"
        )
    if exc.kind == "not_supported":
        return ConfigError(
            f"SkyPilot cannot {what} as asked: {exc}. On infra without autostop (e.g. Slurm without "
            "containers), pass autostop_minutes=None (`art-sky ci run`: --no-autodown)"
        )
    if exc.kind == "invalid":
        return ConfigError(f"SkyPilot refuses to {what}: {exc}")
    return exc


def validate(config: dict[str, Any]) -> dict[str, Any]:
    """Check a task's config with SkyPilot's task schema (blocking) and say what SkyPilot made of it (name, run,
    setup, envs, secrets by name, file mounts, resources in order, what it stores); SkyError("invalid") names what
    is wrong."""
    python = sky_python()
    result = subprocess.run(
        [str(python), "-P", sky_driver.__file__, "validate"],
        input=json.dumps({"config": config}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    replies = [
        json.loads(line[len(sky_driver.MARK) :])
        for line in result.stdout.splitlines()
        if line.startswith(sky_driver.MARK)
    ]
    if not replies:
        tail = (result.stdout + result.stderr).strip()[-1500:]
        raise BackendUnavailableError(
            f"SkyPilot ({python}) could not check the task (exit {result.returncode}): "
            f"{reason(tail) or 'it wrote no error'}\n{tail}"
        )
    if "error" in replies[-1]:
        raise SkyError(replies[-1]["error"], replies[-1]["message"])
    return replies[-1]["result"]


async def check_infra(task: dict[str, Any]) -> None:
    """Refuse early, saying what to run, when the task's cloud (or any cloud) is not enabled in SkyPilot."""
    found = await _call("list the enabled clouds", "check_infra", config=task)
    enabled = {c.lower() for c in found["enabled"]}
    if not enabled:
        raise ConfigError(
            "no cloud or infra is enabled in SkyPilot: set up credentials (a cloud account, a "
            f"kubeconfig, ~/.slurm/config, ...) and run `{sky_cli()} check`"
        )
    missing = sorted({c.lower() for c in found["wanted"]} - enabled)
    if missing:
        cloud = missing[0]
        raise ConfigError(
            f"{cloud} is not enabled in SkyPilot (enabled: {', '.join(sorted(enabled))}): set up its "
            f"credentials and run `{sky_cli()} check {cloud}`, or pick an enabled infra"
        )


async def cluster_status(cluster_name: str, refresh: bool = False) -> str | None:
    """The cluster's status (UP, INIT, STOPPED), or None when there is no such cluster. `refresh` asks the infra
    (a preempted or ended cluster is then gone, or INIT with a node lost) rather than SkyPilot's table."""
    records = await _call(f"look up {cluster_name}", "status", names=[cluster_name], refresh=refresh)
    return records[0]["status"] if records else None


async def ensure_server(
    cluster_name: str,
    task: dict[str, Any],
    *,
    force_restart: bool,
    timeout: float,
    send_secrets: Callable[[], Awaitable[None]],
    on_request: Callable[[str], None] | None = None,
) -> int:
    """Launch the cluster with the server task, or on an UP cluster make sure the server job runs (a new one on
    `force_restart`); return the job's id once it runs. `send_secrets` puts the task's secrets file on the UP
    cluster before a new job starts there (`exec` ships no file mounts). `on_request` gets the launch request's id
    (to cancel it)."""
    await check_infra(task)
    if await cluster_status(cluster_name) != "UP":
        if task.get("num_nodes", 1) > 1:  # a node lost on the way leaves the others billing: tear them all down
            try:
                job_id = (
                    await _call(
                        f"launch {cluster_name}", "launch", on_request=on_request, config=task, cluster=cluster_name
                    )
                )["job_id"]
                await _wait_running(cluster_name, job_id, timeout)
            except BaseException as exc:
                await _down_after(cluster_name, exc)
                raise
            return job_id
        job_id = (
            await _call(f"launch {cluster_name}", "launch", on_request=on_request, config=task, cluster=cluster_name)
        )["job_id"]
    else:
        jobs = [j for j in await server_jobs(cluster_name) if j["status"] in _ACTIVE]
        if jobs and not force_restart:
            job_id = max(j["job_id"] for j in jobs)
        else:
            if jobs:
                await _call(
                    f"stop the server on {cluster_name}",
                    "cancel",
                    cluster=cluster_name,
                    job_ids=[j["job_id"] for j in jobs],
                )
            await send_secrets()  # a restart may bring a new key
            job_id = (await _call(f"start the server on {cluster_name}", "exec", config=task, cluster=cluster_name))[
                "job_id"
            ]
    await _wait_running(cluster_name, job_id, timeout)
    return job_id


async def server_jobs(cluster_name: str) -> list[dict[str, Any]]:
    """The cluster's unfinished server jobs: job_id, job_name, status (PENDING, RUNNING, ...)."""
    jobs = await _call(f"list the jobs of {cluster_name}", "queue", cluster=cluster_name)
    return [j for j in jobs if j["job_name"] == SERVER_JOB]


async def _down_after(cluster_name: str, exc: BaseException) -> None:
    """Tear down a multi-node cluster whose launch failed; the launch's error stays the one raised."""
    log.warning("launching %s failed (%s): tearing it down so that no node is left billing", cluster_name, exc)
    try:
        await asyncio.shield(down(cluster_name))
    except Exception as down_exc:
        log.error("could not tear %s down (%s): run `%s down %s` now", cluster_name, down_exc, sky_cli(), cluster_name)
    if isinstance(exc, Exception):
        exc.add_note(f"{cluster_name} was torn down: a multi-node launch that fails leaves no node running")


async def _wait_running(cluster_name: str, job_id: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        name = await job_state(cluster_name, job_id)
        if name == "RUNNING":
            return
        if name not in _ACTIVE:
            raise BackendUnavailableError(
                f"the server job {job_id} on {cluster_name} is {name}: read "
                f"`{sky_cli()} logs {cluster_name} {job_id}`, then retry with "
                "force_restart=True"
            )
        if time.monotonic() > deadline:
            raise BackendUnavailableError(
                f"the server job {job_id} on {cluster_name} was still {name} after "
                f"{timeout:.0f}s: read `{sky_cli()} logs {cluster_name} {job_id}`"
            )
        await asyncio.sleep(2)


async def job_state(cluster_name: str, job_id: int) -> str:
    """A job's status on the cluster (PENDING, SETTING_UP, RUNNING, SUCCEEDED, FAILED_SETUP, ...), or UNKNOWN."""
    return await _call(f"check job {job_id} on {cluster_name}", "job_status", cluster=cluster_name, job_id=job_id)


async def launch_job(
    cluster_name: str, task: dict[str, Any], output: Output, on_request: Callable[[str], None]
) -> Launched:
    """Launch a new cluster with `task` as its first job, SkyPilot's launch log going to `output`; return once the
    job is submitted. `on_request` gets the launch request's id, for `cancel_request`."""
    await check_infra(task)
    return Launched(
        **await _call(
            f"launch {cluster_name}", "launch", output=output, on_request=on_request, config=task, cluster=cluster_name
        )
    )


async def plan(cluster_name: str, task: dict[str, Any]) -> str:
    """SkyPilot's optimizer table for launching `task` (what `sky launch` shows before it asks): its candidates,
    their prices and its choice (sky_plan.py reads it). Nothing is launched."""
    await check_infra(task)
    table = _Text()
    await _call(f"plan a launch of {cluster_name}", "plan", output=table, config=task)
    return "".join(table.parts)


class _Text:
    """An Output that keeps what it is given."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def write(self, text: str, /) -> int:
        self.parts.append(text)
        return len(text)

    def flush(self) -> None:
        pass


async def cancel_request(request_id: str) -> None:
    """Abort a request still running on the API server (a launch being torn down)."""
    await _call("cancel a request", "api_cancel", request_id=request_id)


async def follow_job(cluster_name: str, job_id: int, output: Output) -> None:
    """Write the job's log (setup and run) to `output` as it comes, until the job ends."""
    await _call(
        f"follow job {job_id} on {cluster_name}", "tail_logs", output=output, cluster=cluster_name, job_id=job_id
    )


async def ssh_target(cluster_name: str) -> SSHTarget:
    """How to reach the cluster's head node: the entry `sky status <cluster>` writes to
    ~/.sky/generated/ssh/<cluster>, including its ProxyCommand and the environment it sets (SetEnv)."""
    command = [str(await asyncio.to_thread(sky_python)), "-m", "sky.client.cli.command", "status", cluster_name]
    try:
        result = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise BackendUnavailableError(
            f"`sky status {cluster_name}` took over 120s: run `{sky_cli()} api status`"
        ) from None
    path = Path.home() / ".sky" / "generated" / "ssh" / cluster_name
    if result.returncode != 0 or not path.exists():
        raise BackendUnavailableError(
            f"SkyPilot recorded no SSH entry for {cluster_name} (`sky status` exited "
            f"{result.returncode}: {reason(result.stderr) or 'no error'}): is it UP? "
            f"`{sky_cli()} status {cluster_name}`"
        )
    return parse_ssh_config(path.read_text(), cluster_name)


def parse_ssh_config(text: str, host: str) -> SSHTarget:
    """An SSHTarget from an ssh-config entry (HostName, Port, User, IdentityFile, ProxyCommand, SetEnv)."""
    entry = paramiko.SSHConfig.from_text(text).lookup(host)
    env = dict(item.split("=", 1) for item in entry.get("setenv", "").split() if "=" in item)
    keys = entry.get("identityfile") or [None]
    return SSHTarget(
        host=entry.get("hostname", host),
        port=int(entry.get("port", 22)),
        user=entry["user"],
        key_path=Path(keys[0]).expanduser() if keys[0] else None,
        proxy_command=entry.get("proxycommand"),
        env=env,
    )


async def down(cluster_name: str) -> None:
    """Tear the cluster down (its Slurm job, VM or pod goes away); a cluster that does not exist is fine."""
    try:
        await _call(f"tear down {cluster_name}", "down", cluster=cluster_name)
    except SkyError as exc:
        if exc.kind != "no_cluster":
            raise


async def status() -> list[ClusterInfo]:
    """The user's clusters, for `art-sky status`."""
    return [ClusterInfo(**record) for record in await _call("list clusters", "status", names=None)]
