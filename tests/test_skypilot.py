"""SkyPilotBackend on real SkyPilot clusters: SkyPilot 0.14.1's Slurm infra pointed at a single-node Slurm on this
machine (tests/slurm_harness.py). One cluster serves the whole module (a launch costs ~45 s on 2 cores)."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import subprocess
import sys

import paramiko
import pytest
import slurm_harness

import art_sky
from art_sky.backends.skypilot import SkyPilotBackend
from art_sky.errors import ConfigError
from art_sky.provisioners import sky as provisioner

CLUSTER = f"art-sky-test-{secrets.token_hex(3)}"
API_KEY = secrets.token_urlsafe(24)
PROMPT = [{"role": "user", "content": "say hi"}]
LIMIT = 600  # seconds any one step may take before the test fails instead of hanging


@pytest.fixture(scope="module")
def prepared_python(sky_slurm):
    """The cluster job runs this interpreter (it has art-sky and torch): no install on the "node"."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ART_SKY_REMOTE_PYTHON", sys.executable)
        patch.setenv("ART_SKY_SERVER_START_TIMEOUT", "300")
        yield sys.executable


@pytest.fixture(scope="module")
def cluster(sky_slurm, prepared_python):
    """The module's cluster name; whatever happens, it is torn down at the end."""
    yield CLUSTER
    slurm_harness.down_clusters(CLUSTER)


async def initialize(**kwargs) -> SkyPilotBackend:
    arguments = dict(cluster_name=CLUSTER, gpu=None, infra=slurm_harness.INFRA, resources={"cpus": 1, "memory": 1},
                     autostop_minutes=None, api_key=API_KEY) | kwargs
    return await asyncio.wait_for(SkyPilotBackend.initialize_cluster(**arguments), LIMIT)


async def server_jobs() -> list[dict]:
    jobs = await provisioner._call("list jobs", provisioner._sdk().queue, CLUSTER, skip_finished=True)
    return [j for j in jobs if j["job_name"] == provisioner.SERVER_JOB]


def test_the_ssh_entry_skypilot_writes_becomes_a_target():
    entry = """# Added by sky
Host c1
  HostName 127.0.0.1
  User root
  IdentityFile ~/.sky/generated/ssh-keys/c1.key
  IdentitiesOnly yes
  Port 22
  SetEnv SKY_CLUSTER_NAME=c1-fcd1e5cf
  ProxyCommand /venv/bin/python /sky/templates/websocket_proxy.py http://127.0.0.1:46580 c1 slurm-job-ssh-proxy 0
"""
    target = provisioner.parse_ssh_config(entry, "c1")
    assert (target.host, target.port, target.user) == ("127.0.0.1", 22, "root")
    assert str(target.key_path).endswith("/.sky/generated/ssh-keys/c1.key") and "~" not in str(target.key_path)
    assert target.proxy_command.endswith("c1 slurm-job-ssh-proxy 0")
    assert target.env == {"SKY_CLUSTER_NAME": "c1-fcd1e5cf"}


def test_an_unreachable_api_server_says_what_to_run():
    """In a child process: SkyPilot caches its API server's address for the life of a process."""
    pytest.importorskip("sky", reason="the SkyPilot extra is not installed")
    probe = "import asyncio; from art_sky.provisioners import sky; asyncio.run(sky.cluster_status('c1'))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                            env=os.environ | {"SKYPILOT_API_SERVER_ENDPOINT": "http://127.0.0.1:9"})
    assert result.returncode != 0
    assert re.search(r"BackendUnavailableError: cannot start or reach the SkyPilot API server .*run `sky api start`",
                     result.stderr), result.stderr[-2000:]


async def test_an_infra_that_is_not_enabled_says_what_to_run(sky_slurm, prepared_python):
    with pytest.raises(ConfigError, match=r"aws is not enabled in SkyPilot .*run `sky check aws`"):
        await initialize(cluster_name="art-sky-test-never", infra="aws")
    assert not slurm_harness.slurm_jobs("art-sky-test-never")


@pytest.mark.slow
async def test_launch_serve_train_reuse_restart_and_down(cluster):
    backend = await initialize()
    try:
        # Reached the SkyPilot way: through its ProxyCommand into the Slurm job, the job's HOME set by SetEnv.
        assert backend.target.proxy_command and "slurm-job-ssh-proxy" in backend.target.proxy_command
        assert "/.sky_clusters/" in backend.server.remote_dir
        (slurm_job,) = slurm_harness.slurm_jobs(CLUSTER)
        model = art_sky.TrainableModel(name="agent", project="sky", base_model="art-sky/tiny")
        await model.register(backend)
        assert (await backend.health()).version == art_sky.__version__
        trajectories = []
        for reward in (0.0, 1.0):
            completion = await model.openai_client().chat.completions.create(
                model=model.get_inference_name(), messages=PROMPT, max_tokens=8, temperature=1.0)
            trajectories.append(art_sky.Trajectory(messages_and_choices=[*PROMPT, completion.choices[0]],
                                                   reward=reward))
        metrics = await asyncio.wait_for(model.train([art_sky.TrajectoryGroup(trajectories)]), LIMIT)
        assert metrics["step"] == 1.0
        first_pid = backend.server.pid
        (first_job,) = await server_jobs()
        (row,) = [c for c in await provisioner.status() if c.name == CLUSTER]
        assert (row.status, row.infra, row.hourly_cost) == ("UP", "Slurm/localcluster", 0.0) and row.uptime_s > 0
    finally:
        await backend.close()

    again = await initialize()  # the UP cluster and its running server are reused
    try:
        assert again.server.pid == first_pid and await server_jobs() == [first_job]
        assert slurm_harness.slurm_jobs(CLUSTER) == [slurm_job]
        model = art_sky.TrainableModel(name="agent", project="sky", base_model="art-sky/tiny")
        await model.register(again)
        assert await model.get_step() == 1
    finally:
        await again.close()

    restarted = await initialize(force_restart=True)  # a new server job on the same cluster
    try:
        assert restarted.server.pid != first_pid
        (job,) = await server_jobs()
        assert job["job_id"] > first_job["job_id"] and job["status"].value == "RUNNING"
        assert slurm_harness.slurm_jobs(CLUSTER) == [slurm_job]
        model = art_sky.TrainableModel(name="agent", project="sky", base_model="art-sky/tiny")
        await model.register(restarted)
        assert await model.get_step() == 1  # the checkpoint on the cluster's disk survived the restart

        target = restarted.target  # plain paramiko through the same ProxyCommand
        client = paramiko.SSHClient()
        client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
        client.connect(target.host, target.port, target.user, key_filename=str(target.key_path), timeout=30,
                       sock=paramiko.ProxyCommand(target.proxy_command), allow_agent=False, look_for_keys=False)
        _, out, _ = client.exec_command("echo ok", timeout=30)
        assert out.read().decode().strip() == "ok"
        client.close()
    finally:
        await asyncio.wait_for(restarted.down(), LIMIT)
    assert not slurm_harness.slurm_jobs(CLUSTER)
    assert await provisioner.cluster_status(CLUSTER) is None
