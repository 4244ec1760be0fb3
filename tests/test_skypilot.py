"""SkyPilotBackend and `art-sky up` on real SkyPilot clusters: SkyPilot 0.14.1's Slurm infra pointed at a
single-node Slurm on this machine (tests/slurm_harness.py). Two launches in all (each ~45-80 s on 2 cores): one for
the Python API (launch, reuse, restart, down), one for the CLI."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pty
import re
import secrets
import select
import subprocess
import sys
import time
from pathlib import Path

import paramiko
import pytest
import slurm_harness
from loop import rollout_and_train
from processes import ssh_and_follow
from typer.testing import CliRunner

import art_sky
from art_sky import clusters
from art_sky.backends.skypilot import SkyPilotBackend
from art_sky.cli import app
from art_sky.cli.errors import console
from art_sky.errors import ConfigError
from art_sky.provisioners import sky as provisioner
from art_sky.settings import Settings

PREFIX = f"art-sky-test-{secrets.token_hex(3)}"  # every cluster this run launches; torn down at the end
CLUSTER = f"{PREFIX}-api"
CLI_CLUSTER = f"{PREFIX}-cli"
API_KEY = secrets.token_urlsafe(24)
STORE_SECRET = f"store-{secrets.token_hex(12)}"  # a store key from env_path=, as the server's secrets carry it
CANARY = f"canary-{secrets.token_hex(12)}"  # a plain task env: SkyPilot shows it where task secrets used to show
LIMIT = 600  # seconds any one step may take before the test fails instead of hanging


@pytest.fixture(scope="module")
def prepared_python(sky_slurm, tmp_path_factory):
    """The cluster job runs this interpreter (it has art-sky and torch): no install on the "node". Cluster
    records go to a private ART_SKY_HOME."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ART_SKY_REMOTE_PYTHON", sys.executable)
        patch.setenv("ART_SKY_SERVER_START_TIMEOUT", "300")
        # Each SSH connection to a job is an `srun ... sshd -i` through the API server: on 2 loaded cores its banner
        # has taken over 20 s.
        patch.setenv("ART_SKY_SSH_CONNECT_TIMEOUT", "90")
        patch.setenv("ART_SKY_HOME", str(tmp_path_factory.mktemp("art-sky-home")))
        patch.delenv("ART_SKY_API_KEY", raising=False)
        yield sys.executable


@pytest.fixture(scope="module")
def cluster(sky_slurm, prepared_python):
    """The module's cluster names; whatever happens, they are torn down at the end."""
    yield CLUSTER
    slurm_harness.down_clusters(PREFIX)


async def initialize(**kwargs) -> SkyPilotBackend:
    arguments = (
        dict(
            cluster_name=CLUSTER,
            gpu=None,
            infra=slurm_harness.INFRA,
            resources={"cpus": 1, "memory": 1},
            autostop_minutes=None,
            api_key=API_KEY,
        )
        | kwargs
    )
    return await asyncio.wait_for(SkyPilotBackend.initialize_cluster(**arguments), LIMIT)


def assert_secrets_only_in_their_file(home: Path, hidden: list[str]) -> None:
    """On the node (the local Slurm's host0 is this machine): the secrets in no process's command line, no shell
    history and no SkyPilot job file, only in the server's 0600 secrets file. CANARY, a plain task env, shows in the
    job file and the history as task secrets did: the search looks where they would be."""
    commands = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            commands.append(cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:  # a process that ended meanwhile
            pass
    files = [home / ".bash_history", Path.home() / ".bash_history", *(home / ".sky" / "sky_app").glob("sky_job_*")]
    texts = {str(f): f.read_text(errors="replace") for f in files if f.is_file()}
    assert any(CANARY in texts.get(str(f), "") for f in files[2:]) and CANARY in texts[str(files[0])], sorted(texts)
    for secret in hidden:
        assert not [c for c in commands if secret in c], "a secret in a command line"
        assert not [f for f, text in texts.items() if secret in text], "a secret in a history or job file"
    secrets_file = home / "art-sky" / "secrets.env"
    assert secrets_file.stat().st_mode & 0o777 == 0o600
    assert all(secret in secrets_file.read_text() for secret in hidden)


async def server_jobs() -> list[dict]:
    return await provisioner.server_jobs(CLUSTER)


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
    probe = "import asyncio; from art_sky.provisioners import sky; asyncio.run(sky.cluster_status('c1'))"
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"SKYPILOT_API_SERVER_ENDPOINT": "http://127.0.0.1:9"},
    )
    assert result.returncode != 0
    assert re.search(
        r"BackendUnavailableError: cannot start or reach the SkyPilot API server .*run `\S*/sky api "
        r"start`",
        result.stderr,
    ), result.stderr[-2000:]


async def test_an_infra_that_is_not_enabled_says_what_to_run(sky_slurm, prepared_python):
    with pytest.raises(ConfigError, match=r"aws is not enabled in SkyPilot .*run `\S*/sky check aws`"):
        await initialize(cluster_name="art-sky-test-never", infra="aws")
    assert not slurm_harness.slurm_jobs("art-sky-test-never")


@pytest.mark.slow
async def test_launch_serve_train_reuse_restart_and_down(cluster, tmp_path):
    (tmp_path / "store.env").write_text(f"TEST_STORE_SECRET={STORE_SECRET}\n")
    backend = await initialize(env_path=tmp_path / "store.env", overrides={"envs": {"TEST_CANARY": CANARY}})
    home = Path(backend.server.layout.run_dir).parent.parent  # the job's HOME (~/.sky_clusters/<name>)
    try:
        assert_secrets_only_in_their_file(home, [API_KEY, STORE_SECRET])
        # Reached the SkyPilot way: through its ProxyCommand into the Slurm job, the job's HOME set by SetEnv.
        assert backend.target.proxy_command and "slurm-job-ssh-proxy" in backend.target.proxy_command
        assert "/.sky_clusters/" in backend.server.layout.run_dir
        (slurm_job,) = slurm_harness.slurm_jobs(CLUSTER)
        assert (await backend.health()).version == art_sky.__version__
        await rollout_and_train(backend, project="sky", limit=LIMIT)
        record = clusters.load(backend.settings.home, CLUSTER)  # so that other processes reuse the server with its key
        assert record.kind == "sky" and record.api_key.get_secret_value() == API_KEY
        assert record.target == backend.target and record.port == backend.server.port
        first_pid = backend.server.pid
        (first_job,) = await server_jobs()
        (row,) = [c for c in await provisioner.status() if c.name == CLUSTER]
        assert (row.status, row.infra, row.hourly_cost) == ("UP", "Slurm/localcluster", 0.0) and row.uptime_s > 0
    finally:
        await backend.close()

    # The UP cluster and its running server are reused, with the key from the cluster's record.
    again = await initialize(api_key=None)
    try:
        assert again.server.pid == first_pid and await server_jobs() == [first_job]
        assert slurm_harness.slurm_jobs(CLUSTER) == [slurm_job] and again.api_key == API_KEY
        model = art_sky.TrainableModel(name="agent", project="sky", base_model="art-sky/tiny")
        await model.register(again)
        assert await model.get_step() == 1
    finally:
        await again.close()
    attached = art_sky.attach(CLUSTER)  # what `art-sky tunnel` does: a tunnel to the recorded server
    try:
        assert [(m.name, m.step) for m in await attached.models()] == [("agent", 1)]
        assert "listening on 127.0.0.1" in await attached.logs(200)
    finally:
        await attached.close()

    restarted = await initialize(force_restart=True)  # a new server job on the same cluster
    try:
        assert restarted.server.pid != first_pid
        assert_secrets_only_in_their_file(home, [API_KEY])  # `exec` ships no file mounts: sent over SSH's stdin
        (job,) = await server_jobs()
        assert job["job_id"] > first_job["job_id"] and job["status"] == "RUNNING"
        assert slurm_harness.slurm_jobs(CLUSTER) == [slurm_job]
        model = art_sky.TrainableModel(name="agent", project="sky", base_model="art-sky/tiny")
        await model.register(restarted)
        assert await model.get_step() == 1  # the checkpoint on the cluster's disk survived the restart

        target = restarted.target  # plain paramiko through the same ProxyCommand
        client = paramiko.SSHClient()
        client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
        client.connect(
            target.host,
            target.port,
            target.user,
            key_filename=str(target.key_path),
            timeout=30,
            sock=paramiko.ProxyCommand(target.proxy_command),
            allow_agent=False,
            look_for_keys=False,
        )
        _, out, _ = client.exec_command("echo ok", timeout=30)
        assert out.read().decode().strip() == "ok"
        client.close()
    finally:
        await asyncio.wait_for(restarted.down(), LIMIT)
    assert not slurm_harness.slurm_jobs(CLUSTER)
    assert await provisioner.cluster_status(CLUSTER) is None
    assert CLUSTER not in clusters.all_names(restarted.settings.home)


@dataclasses.dataclass
class Answered:
    returncode: int
    output: str


def answered_in_terminal(argv: list[str], question: str, answer: str, timeout: float = LIMIT) -> Answered:
    """Run `argv` on a pseudo-terminal (a user at a prompt), type `answer` once `question` shows, read the rest."""
    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")} | {"TERM": "dumb", "COLUMNS": "200"}
    process = subprocess.Popen(argv, stdin=follower, stdout=follower, stderr=follower, env=env, close_fds=True)
    os.close(follower)
    output, deadline, typed = b"", time.monotonic() + timeout, False
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed: the process is done
                break
            if not chunk:
                break
            output += chunk
            if not typed and question.encode() in output:
                os.write(leader, f"{answer}\n".encode())
                typed = True
        else:
            pytest.fail(f"{argv} did not end within {timeout:.0f}s (typed: {typed}):\n{output.decode()}")
        return Answered(process.wait(60), output.decode(errors="replace").replace("\r\n", "\n"))
    finally:
        os.close(leader)
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow
def test_cli_up_train_through_the_tunnel_status_logs_down(cluster, monkeypatch):
    monkeypatch.setattr(console, "width", 200)
    runner = CliRunner()
    up = [
        "up",
        CLI_CLUSTER,
        "--infra",
        slurm_harness.INFRA,
        "--gpu",
        "none",
        "--cpus",
        "1",
        "--memory",
        "1",
        "--autostop",
        "0",
    ]
    # Before renting, `up` says what it would launch, with SkyPilot's choice and price, and asks: in a terminal
    # "no" launches nothing; where there is no terminal to ask on (here: CliRunner's stdin) it refuses at once.
    plan = [
        f"SkyPilot cluster '{CLI_CLUSTER}' is not up: launching it rents",
        "  GPUs:     none (CPUs only)",
        "  nodes:    1",
        "  spot:     no (on-demand)",
        "  where:    Slurm (localcluster)",
        "  price:    $0.00/hour (SkyPilot's price)",
        f"  autostop: off: it runs, and bills, until `art-sky down {CLI_CLUSTER}`",
    ]
    asked = answered_in_terminal([sys.executable, "-m", "art_sky.cli", *up], "Launch it? [y/N]:", "n")
    assert all(line in asked.output.splitlines() for line in plan), asked.output
    assert asked.returncode == 1 and "not launched: nothing was rented" in asked.output, asked.output
    refused = runner.invoke(app, up)
    assert refused.exit_code == 1, refused.output
    assert all(line in refused.stdout.splitlines() for line in plan), refused.output
    assert refused.stderr == (
        f"error: not launching '{CLI_CLUSTER}': art-sky asks before it rents a cluster, and there is no terminal to "
        "ask on (stdin is not one): pass --yes to launch without asking\n"
    )
    assert not slurm_harness.slurm_jobs(CLI_CLUSTER)
    assert asyncio.run(provisioner.cluster_status(CLI_CLUSTER)) is None

    up.append("--yes")
    for _ in range(6):  # the one local node may be full of other test runs' clusters for a while
        result = runner.invoke(app, up)
        if "found no resources" not in result.output:
            break
        time.sleep(20)
    assert result.exit_code == 0, result.output
    assert f"cluster '{CLI_CLUSTER}' up" in result.output
    (slurm_job,) = slurm_harness.slurm_jobs(CLI_CLUSTER)

    async def train_from_python() -> None:  # a script after `art-sky up`: attach by name, roll out, train
        backend = art_sky.attach(CLI_CLUSTER)
        try:
            await rollout_and_train(backend, project="cli", limit=LIMIT)
        finally:
            await backend.close()

    asyncio.run(asyncio.wait_for(train_from_python(), LIMIT))
    result = runner.invoke(app, up)  # again: the same cluster and server, reused with the recorded key
    assert result.exit_code == 0, result.output
    assert slurm_harness.slurm_jobs(CLI_CLUSTER) == [slurm_job]

    result = runner.invoke(app, ["status"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    (line,) = [line for line in lines if line.split()[:1] == [CLI_CLUSTER]]  # the cluster's row
    assert all(
        part in line for part in ("sky", "Slurm/localcluster (UP)", "CPUs", "$0.00/h", "ok, portable", "agent (1)")
    ), result.output
    (model,) = [line for line in lines if line.startswith(f"{CLI_CLUSTER}/agent ")]  # then the model's
    assert model.split()[1] == "1", result.output
    result = runner.invoke(app, ["logs", CLI_CLUSTER, "--lines", "200"])
    assert result.exit_code == 0 and "listening on 127.0.0.1" in result.output, result.output
    assert "/.sky_clusters/" in ssh_and_follow(CLI_CLUSTER)  # into the Slurm job, its HOME set

    result = runner.invoke(app, ["down", CLI_CLUSTER])
    assert result.exit_code == 0 and "torn down" in result.output, result.output
    assert not slurm_harness.slurm_jobs(CLI_CLUSTER)
    assert asyncio.run(provisioner.cluster_status(CLI_CLUSTER)) is None
    assert CLI_CLUSTER not in clusters.all_names(Settings().home)
