"""The SkyPilot provisioner: launch or reuse a cluster that runs the server task, and say how to reach it by SSH.

Every SkyPilot call is blocking (it talks to SkyPilot's API server, starting one when none runs), so each runs in
a thread. The server itself is the task's `run:` job (templates/cluster.yaml); `ensure_server` makes sure exactly
that job runs. SSH details come from the ssh-config file that SkyPilot's own `sky status` writes, ProxyCommand and
all, so reaching a Slurm job or a Kubernetes pod works as `ssh <cluster>` does.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import paramiko
from pydantic import BaseModel

from art_sky.errors import BackendUnavailableError, ConfigError
from art_sky.remote.ssh import SSHTarget

log = logging.getLogger("art_sky")

SERVER_JOB = "art-sky-server"  # the template's task name, so the job's name in `sky queue`
_ACTIVE = ("INIT", "PENDING", "SETTING_UP", "RUNNING")


class ClusterInfo(BaseModel):
    """One row of `art-sky status`."""

    name: str
    status: str
    infra: str
    resources: str
    accelerators: dict[str, float] | None
    uptime_s: float | None
    hourly_cost: float | None  # None where SkyPilot knows no price


def _sdk():
    from sky.client import sdk

    return sdk


async def _call(what: str, request, *args, stream: bool = False, output: TextIO | None = None,
                on_request: Callable[[str], None] | None = None, **kwargs) -> Any:
    """Run one SkyPilot SDK request in a thread and wait for its result, translating SkyPilot's errors.

    `stream` relays the request's log (to `output`, default stdout); `on_request` gets its id (to cancel it).
    """
    from sky import exceptions

    sdk = _sdk()

    def blocking():
        request_id = request(*args, **kwargs)
        if on_request is not None:
            on_request(request_id)
        return sdk.stream_and_get(request_id, output_stream=output) if stream else sdk.get(request_id)

    try:
        return await asyncio.to_thread(blocking)
    except exceptions.ApiServerConnectionError as exc:
        raise BackendUnavailableError(
            f"cannot start or reach the SkyPilot API server while trying to {what} ({exc}): run `sky api start` "
            "and read `sky api logs`") from None
    except exceptions.ResourcesUnavailableError as exc:
        raise BackendUnavailableError(
            f"SkyPilot found no resources to {what}: {exc}. Try another infra or region, a GPU fallback list "
            "(gpu=[...]), or spot=False") from None
    except exceptions.NotSupportedError as exc:
        raise ConfigError(f"SkyPilot cannot {what} as asked: {exc}. On infra without autostop (e.g. Slurm without "
                          "containers), pass autostop_minutes=None (`art-sky ci run`: --no-autodown)") from None


async def check_infra(task) -> None:
    """Refuse early, saying what to run, when the task's cloud (or any cloud) is not enabled in SkyPilot."""
    enabled = {c.lower() for c in await _call("list the enabled clouds", _sdk().enabled_clouds)}
    if not enabled:
        raise ConfigError("no cloud or infra is enabled in SkyPilot: set up credentials (a cloud account, a "
                          "kubeconfig, ~/.slurm/config, ...) and run `sky check`")
    missing = sorted({str(r.cloud).lower() for r in task.resources if r.cloud is not None} - enabled)
    if missing:
        cloud = missing[0]
        raise ConfigError(f"{cloud} is not enabled in SkyPilot (enabled: {', '.join(sorted(enabled))}): set up its "
                          f"credentials and run `sky check {cloud}`, or pick an enabled infra")


async def cluster_status(cluster_name: str) -> str | None:
    """The cluster's status (UP, INIT, STOPPED), or None when there is no such cluster."""
    records = await _call(f"look up {cluster_name}", _sdk().status, [cluster_name])
    return records[0]["status"].value if records else None


async def ensure_server(cluster_name: str, task, *, force_restart: bool, timeout: float) -> None:
    """Launch the cluster with the server task, or on an UP cluster make sure the server job runs (a new one on
    `force_restart`); return once the job runs."""
    sdk = _sdk()
    await check_infra(task)
    if await cluster_status(cluster_name) != "UP":
        if task.num_nodes > 1:  # a node lost on the way leaves the others billing: tear them all down
            try:
                job_id, _ = await _call(f"launch {cluster_name}", sdk.launch, task, cluster_name=cluster_name,
                                        stream=True)
                await _wait_running(cluster_name, job_id, timeout)
            except BaseException as exc:
                await _down_after(cluster_name, exc)
                raise
            return
        job_id, _ = await _call(f"launch {cluster_name}", sdk.launch, task, cluster_name=cluster_name, stream=True)
    else:
        jobs = [j for j in await _call(f"list the jobs of {cluster_name}", sdk.queue, cluster_name,
                                       skip_finished=True)
                if j["job_name"] == SERVER_JOB and j["status"].value in _ACTIVE]
        if jobs and not force_restart:
            job_id = max(j["job_id"] for j in jobs)
        else:
            if jobs:
                await _call(f"stop the server on {cluster_name}", sdk.cancel, cluster_name,
                            job_ids=[j["job_id"] for j in jobs])
            job_id, _ = await _call(f"start the server on {cluster_name}", sdk.exec, task, cluster_name=cluster_name,
                                    stream=True)
    await _wait_running(cluster_name, job_id, timeout)


async def _down_after(cluster_name: str, exc: BaseException) -> None:
    """Tear down a multi-node cluster whose launch failed; the launch's error stays the one raised."""
    log.warning("launching %s failed (%s): tearing it down so that no node is left billing", cluster_name, exc)
    try:
        await asyncio.shield(down(cluster_name))
    except Exception as down_exc:  # noqa: BLE001 (the launch's error is what the caller sees; say this one too)
        log.error("could not tear %s down (%s): run `sky down %s` now", cluster_name, down_exc, cluster_name)
    if isinstance(exc, Exception):
        exc.add_note(f"{cluster_name} was torn down: a multi-node launch that fails leaves no node running")


async def _wait_running(cluster_name: str, job_id: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        name = await job_state(cluster_name, job_id)
        if name == "RUNNING":
            return
        if name not in _ACTIVE:
            raise BackendUnavailableError(f"the server job {job_id} on {cluster_name} is {name}: read "
                                          f"`sky logs {cluster_name} {job_id}`, then retry with force_restart=True")
        if time.monotonic() > deadline:
            raise BackendUnavailableError(f"the server job {job_id} on {cluster_name} was still {name} after "
                                          f"{timeout:.0f}s: read `sky logs {cluster_name} {job_id}`")
        await asyncio.sleep(2)


async def job_state(cluster_name: str, job_id: int) -> str:
    """A job's status on the cluster (PENDING, SETTING_UP, RUNNING, SUCCEEDED, FAILED_SETUP, ...), or UNKNOWN."""
    statuses = await _call(f"check job {job_id} on {cluster_name}", _sdk().job_status, cluster_name,
                           job_ids=[job_id])
    status = statuses.get(job_id) or statuses.get(str(job_id))
    return status.value if status is not None else "UNKNOWN"


async def launch_job(cluster_name: str, task, output: TextIO, on_request: Callable[[str], None]) -> tuple[int, Any]:
    """Launch a new cluster with `task` as its first job, SkyPilot's launch log going to `output`; return once the
    job is submitted: (job id, handle). `on_request` gets the launch request's id, for `cancel_request`."""
    await check_infra(task)
    return await _call(f"launch {cluster_name}", _sdk().launch, task, cluster_name=cluster_name, stream=True,
                       output=output, on_request=on_request)


async def cancel_request(request_id: str) -> None:
    """Abort a request still running on the API server (a launch being torn down)."""
    await _call("cancel a request", _sdk().api_cancel, request_id, silent=True)


async def follow_job(cluster_name: str, job_id: int, output: TextIO) -> None:
    """Write the job's log (setup and run) to `output` as it comes, until the job ends."""
    await asyncio.to_thread(_sdk().tail_logs, cluster_name, job_id, follow=True, output_stream=output)


async def ssh_target(cluster_name: str) -> SSHTarget:
    """How to reach the cluster's head node: the entry `sky status <cluster>` writes to
    ~/.sky/generated/ssh/<cluster>, including its ProxyCommand and the environment it sets (SetEnv)."""
    command = [sys.executable, "-m", "sky.client.cli.command", "status", cluster_name]
    try:
        result = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise BackendUnavailableError(f"`sky status {cluster_name}` took over 120s: run `sky api status`") from None
    path = Path.home() / ".sky" / "generated" / "ssh" / cluster_name
    if result.returncode != 0 or not path.exists():
        raise BackendUnavailableError(f"SkyPilot recorded no SSH entry for {cluster_name} (`sky status` exited "
                                      f"{result.returncode}: {result.stderr.strip()[-500:]}): is it UP? "
                                      f"`sky status {cluster_name}`")
    return parse_ssh_config(path.read_text(), cluster_name)


def parse_ssh_config(text: str, host: str) -> SSHTarget:
    """An SSHTarget from an ssh-config entry (HostName, Port, User, IdentityFile, ProxyCommand, SetEnv)."""
    entry = paramiko.SSHConfig.from_text(text).lookup(host)
    env = dict(item.split("=", 1) for item in entry.get("setenv", "").split() if "=" in item)
    keys = entry.get("identityfile") or [None]
    return SSHTarget(host=entry.get("hostname", host), port=int(entry.get("port", 22)), user=entry["user"],
                     key_path=Path(keys[0]).expanduser() if keys[0] else None,
                     proxy_command=entry.get("proxycommand"), env=env)


async def down(cluster_name: str) -> None:
    """Tear the cluster down (its Slurm job, VM or pod goes away); a cluster that does not exist is fine."""
    from sky import exceptions

    try:
        await _call(f"tear down {cluster_name}", _sdk().down, cluster_name)
    except exceptions.ClusterDoesNotExist:
        pass


async def status() -> list[ClusterInfo]:
    """The user's clusters, for `art-sky status`."""
    records = await _call("list clusters", _sdk().status, None)
    now = time.time()
    return [ClusterInfo(
        name=r["name"], status=r["status"].value,
        infra=f"{r.get('cloud') or '-'}{'/' + r['region'] if r.get('region') else ''}",
        resources=r.get("resources_str") or "-", accelerators=r.get("accelerators") or None,
        uptime_s=now - r["launched_at"] if r.get("launched_at") else None,
        hourly_cost=_hourly_cost(r)) for r in records]


def _hourly_cost(record) -> float | None:
    return hourly_cost(record.get("handle"))


def hourly_cost(handle) -> float | None:
    """What the cluster costs an hour, or None where SkyPilot knows no price."""
    try:
        return handle.launched_resources.get_cost(3600) * handle.launched_nodes
    except Exception:  # SkyPilot has no price for this infra or handle
        return None
