"""`art-sky up --host / status / logs / tunnel / down` against a real sshd on this machine."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from sshd import art_sky_home, sshd  # noqa: F401 (fixtures)
from typer.testing import CliRunner

import art_sky
from art_sky.cli import app

BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)


class Lines:
    """A process's output lines, read in a thread so that waiting for one can time out."""

    def __init__(self, process: subprocess.Popen):
        self.seen: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self._queue.put(line) for line in process.stdout], daemon=True).start()

    def until(self, prefix: str, timeout: float) -> dict[str, str]:
        """KEY=VALUE lines up to the one whose key is `prefix`."""
        found: dict[str, str] = {}
        while True:
            try:
                line = self._queue.get(timeout=timeout)
            except queue.Empty:
                pytest.fail(f"no {prefix} line within {timeout}s; got {self.seen}")
            self.seen.append(line)
            key, _, value = line.strip().partition("=")
            found[key] = value
            if key == prefix:
                return found

    def rest(self) -> str:
        while not self._queue.empty():
            self.seen.append(self._queue.get())
        return "".join(self.seen)


@pytest.mark.slow
def test_up_status_logs_tunnel_down(sshd, tmp_path, art_sky_home):  # noqa: F811
    runner = CliRunner()
    host = f"{sshd.target().user}@127.0.0.1:{sshd.port}"
    up = ["up", "--host", host, "--key", str(sshd.client_key), "--name", "box", "--python", BASE_PYTHON,
          "--remote-dir", str(tmp_path / "remote")]
    result = runner.invoke(app, up)
    assert result.exit_code == 0, result.output
    assert "cluster 'box' up" in result.output
    record = art_sky_home / "clusters" / "box.json"
    assert record.stat().st_mode & 0o777 == 0o600

    result = runner.invoke(app, up)
    assert result.exit_code == 0 and "already up" in result.output, result.output
    result = runner.invoke(app, ["up", "--host", f"{sshd.target().user}@localhost:{sshd.port}", "--name", "box"])
    assert result.exit_code == 1 and "runs on" in result.output and "art-sky down --name box" in result.output

    result = runner.invoke(app, ["status"])
    assert result.exit_code == 0 and "box" in result.output and "listening" in result.output, result.output
    result = runner.invoke(app, ["logs", "--name", "box"])
    assert result.exit_code == 0 and "listening on 127.0.0.1" in result.output, result.output

    tunnel = subprocess.Popen([sys.executable, "-m", "art_sky.cli", "tunnel", "--name", "box"], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ.copy())
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

    result = runner.invoke(app, ["down", "--name", "box"])
    assert result.exit_code == 0 and "server stopped" in result.output, result.output
    assert not record.exists()
    assert "no clusters" in runner.invoke(app, ["status"]).output
    result = runner.invoke(app, ["down", "--name", "box"])
    assert result.exit_code == 1 and "no cluster named 'box'" in result.output


@pytest.mark.parametrize("command", ["up", "down", "status", "logs", "tunnel", "ssh"])
def test_every_command_has_help(command):
    result = CliRunner().invoke(app, [command, "--help"])
    assert result.exit_code == 0 and "Usage" in result.output


def test_bad_host_spec(art_sky_home):  # noqa: F811
    result = CliRunner().invoke(app, ["up", "--host", "no-user-here"])
    assert result.exit_code == 1 and "write it as user@host" in result.output
