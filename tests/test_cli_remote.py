"""`art-sky up --host / --local`, `status / logs / tunnel / down` against a real sshd on this machine, with a
rollout and a training step through each cluster (the SkyPilot path is in test_skypilot.py). The SSH test spells
the name `--name NAME` (the alias), the local one `NAME` (the first argument)."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from pathlib import Path

import httpx
import pytest
from loop import rollout_and_train
from processes import Lines, art_sky_cli, ssh_and_follow
from sshd import art_sky_home, sshd  # noqa: F401 (fixtures)
from typer.testing import CliRunner

import art_sky
from art_sky import clusters
from art_sky.cli import app
from art_sky.cli.errors import console
from art_sky.errors import ConfigError
from art_sky.provisioners.sky_task import parse_gpus

BASE_PYTHON = sys.executable  # a prepared interpreter: the tests' own venv


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """Tables and messages on one line each, as in a wide terminal, so the assertions can read them."""
    monkeypatch.setattr(console, "width", 200)


@pytest.fixture
def home(art_sky_home):
    """A private ART_SKY_HOME; a server a failed test left up is stopped with `art-sky down`."""
    yield art_sky_home
    for name in clusters.all_names(art_sky_home):
        CliRunner().invoke(app, ["down", name, "--force"])


def assert_lines(stderr: str, patterns: list[str]) -> None:
    """`stderr`'s lines are timestamped and match `patterns` in order."""
    lines = stderr.strip().splitlines()
    assert len(lines) == len(patterns), stderr
    for line, pattern in zip(lines, patterns, strict=True):
        assert re.fullmatch(rf"\[\d\d:\d\d:\d\d\] {pattern}", line), (line, pattern)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def attached_round(name: str, project: str) -> None:
    """What a Python script does after `art-sky up`: attach by name, roll out, train a step; the server stays."""
    backend = art_sky.attach(name)
    try:
        model = await rollout_and_train(backend, project=project)
        assert await model.get_step() >= 1
        assert (await backend.list_checkpoints(model))[-1].step >= 1  # written after train() returns: listing waits
    finally:
        await backend.close()


@pytest.mark.slow
def test_up_status_logs_tunnel_down(sshd, tmp_path, home):
    runner = CliRunner()
    host = f"{sshd.target().user}@127.0.0.1:{sshd.port}"
    up = [
        "up",
        "--host",
        host,
        "--key",
        str(sshd.client_key),
        "--name",
        "box",
        "--python",
        BASE_PYTHON,
        "--remote-dir",
        str(tmp_path / "remote"),
    ]
    result = runner.invoke(app, up)
    assert result.exit_code == 0, result.output
    assert "cluster 'box' up" in result.stdout
    # Each phase as it happened, on stderr: a timestamp, what, its time; the venv is the prepared one (--python).
    timed = r" \.\.\. (?:\d+\.\ds|\d+m\d\ds)"
    assert_lines(
        result.stderr,
        [
            rf"connecting to {re.escape(host)}{timed}",
            rf"Python {re.escape(sys.version.split()[0])} at {re.escape(BASE_PYTHON)}",
            rf"building this client's wheel{timed}",
            rf"uploading art_sky-\S+\.whl \(\d+\.\d MB\){timed}",
            rf"installing this build of art-sky{timed}",
            rf"starting the cluster server on {re.escape(host)}{timed}",
            rf"waiting until the server answers{timed}",
            rf"cluster server ready on {re.escape(host)}, port \d+ there, in \d+\.\ds",
        ],
    )
    record = home / "clusters" / "box.json"
    assert record.stat().st_mode & 0o777 == 0o600

    result = runner.invoke(app, up)
    assert result.exit_code == 0 and "already up" in result.output, result.output
    result = runner.invoke(app, ["up", "--host", f"{sshd.target().user}@localhost:{sshd.port}", "--name", "box"])
    assert result.exit_code == 1 and "runs on" in result.output and "`art-sky down box` first" in result.output

    asyncio.run(attached_round("box", "cli-ssh"))
    result = runner.invoke(app, ["status"])
    assert result.exit_code == 0, result.output
    assert "box" in result.output and "ok, portable on cpu" in result.output and "agent (1)" in result.output, (
        result.output
    )
    result = runner.invoke(app, ["logs", "--name", "box"])
    assert result.exit_code == 0 and "listening on 127.0.0.1" in result.output, result.output
    assert "done" in ssh_and_follow("box")

    tunnel = art_sky_cli("tunnel", "--name", "box")
    try:
        output = Lines(tunnel)
        printed = output.until("ART_SKY_API_KEY", timeout=60)
        assert printed["ART_SKY_API_KEY"] in record.read_text()
        health = httpx.get(f"{printed['ART_SKY_BASE_URL']}/health", timeout=10)
        assert health.status_code == 200 and health.json()["version"] == art_sky.__version__
        tunnel.send_signal(signal.SIGINT)
        assert tunnel.wait(20) == 0, output.rest()
    finally:
        if tunnel.poll() is None:
            tunnel.kill()
            tunnel.wait(10)

    pid = clusters.load(home, "box").pid
    result = runner.invoke(app, ["down", "--name", "box"])
    assert result.exit_code == 0 and "server stopped" in result.output, result.output
    assert not alive(pid)
    assert not record.exists()
    assert "no clusters" in runner.invoke(app, ["status"]).output
    result = runner.invoke(app, ["down", "--name", "box"])  # stopped: says again what stays, and how to purge it
    assert result.exit_code == 0 and "left on " in result.output and "down box --purge" in result.output, result.output
    result = runner.invoke(app, ["down", "--name", "box", "--purge", "--yes"])
    assert result.exit_code == 0 and "removed from " in result.output, result.output
    result = runner.invoke(app, ["down", "--name", "box"])
    assert result.exit_code == 1 and "no cluster named 'box'" in result.output, result.output


@pytest.mark.slow
def test_up_local_is_a_detached_server_that_down_stops(home, tmp_path, monkeypatch):
    """`up --local` keeps the model's files where `art.LocalBackend()` does: ./.art of the working directory."""
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    result = runner.invoke(app, ["up", "here", "--local"])
    assert result.exit_code == 0 and "up on this machine" in result.output, result.output
    record = home / "clusters" / "here.json"
    pid = clusters.load(home, "here").pid
    assert alive(pid) and record.stat().st_mode & 0o777 == 0o600
    assert "already up" in runner.invoke(app, ["up", "here", "--local"]).output
    result = runner.invoke(app, ["up", "here", "--host", "someone@example.invalid"])
    assert result.exit_code == 1 and "runs on this machine (local)" in result.output, result.output

    asyncio.run(attached_round("here", "cli-local"))
    assert art_sky.LocalBackend().path == tmp_path / ".art"
    assert (tmp_path / ".art" / "cli-local" / "models" / "agent" / "checkpoints" / "0001" / "manifest.json").exists()
    assert (tmp_path / ".art" / "run" / "here" / "server.log").exists()
    result = runner.invoke(app, ["status"])
    assert result.exit_code == 0 and "this machine" in result.output and "agent (1)" in result.output, result.output
    result = runner.invoke(app, ["logs", "here", "--lines", "200"])
    assert result.exit_code == 0 and "listening on 127.0.0.1" in result.output, result.output
    result = runner.invoke(app, ["ssh", "here"])
    assert result.exit_code == 1 and "runs on this machine" in result.output

    result = runner.invoke(app, ["down", "here"])
    assert result.exit_code == 0 and "server stopped" in result.output, result.output
    assert not alive(pid) and not record.exists()


def test_gpu_lists():
    assert parse_gpus(["H100:1"]) == "H100:1"
    assert parse_gpus(["H100:1", "A100-80GB:1,L40S"]) == ["H100:1", "A100-80GB:1", "L40S"]
    assert parse_gpus(["none"]) is None
    with pytest.raises(ConfigError, match="`none` alone"):
        parse_gpus(["H100", "none"])


@pytest.mark.parametrize("command", ["up", "down", "status", "logs", "tunnel", "ssh"])
def test_every_command_has_help(command):
    result = CliRunner().invoke(app, [command, "--help"])
    assert result.exit_code == 0 and "Usage" in result.output


def test_bad_host_spec(art_sky_home):
    result = CliRunner().invoke(app, ["up", "--host", "no-user-here"])
    assert result.exit_code == 1 and "write it as user@host" in result.output
