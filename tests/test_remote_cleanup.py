"""Interrupts and failures leave an SSH box clean: a remote command's process group ends with its session (a
timeout, Ctrl-C here, a lost connection), a failed `up` leaves nothing the next one trips on, `down` says what stays
and `down --purge` removes it. Against the real test sshd on 127.0.0.1."""

from __future__ import annotations

import getpass
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from processes import art_sky_cli
from sshd import art_sky_home, sshd  # noqa: F401 (fixtures)
from typer.testing import CliRunner

import art_sky
from art_sky import clusters
from art_sky.cli import app
from art_sky.cli.errors import console
from art_sky.errors import SSHError
from art_sky.remote.groups import GRACE
from art_sky.remote.install import VENV_READY, BootstrapOptions
from art_sky.remote.ssh import SSHRunner
from art_sky.settings import Settings


def processes_with(text: str) -> list[int]:
    """Pids of this machine's processes whose command line contains `text` (the box is this machine)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def gone_within(text: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while processes_with(text):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture
def runner(sshd, art_sky_home):
    with SSHRunner(sshd.target(), Settings()) as runner:
        yield runner


def test_stdin_and_exit_codes_reach_the_script_unchanged(runner):
    text = b"A=1\nB=two words\n\n\nlast line without newline"
    assert runner.run("cat", timeout=30, stdin=text).stdout.encode() == text
    assert runner.run("cat", timeout=30).stdout == ""  # no stdin: end of file at once
    result = runner.run("echo out; echo err >&2; exit 7", timeout=30, check=False)
    assert (result.exit_code, result.stdout, result.stderr) == (7, "out\n", "err\n")
    with pytest.raises(ValueError, match="NUL"):
        runner.run("cat", timeout=30, stdin=b"a\0b")


def test_a_timed_out_command_is_stopped_with_its_children(runner):
    with pytest.raises(SSHError, match="did not finish within 1s"):
        runner.run("sleep 3011 & sleep 3012; wait", timeout=1)
    assert gone_within("sleep 301", GRACE + 10), processes_with("sleep 301")
    assert runner.run("echo still usable", timeout=30).stdout == "still usable\n"


def test_ctrl_c_stops_the_remote_command(runner):
    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.5)
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.run("sh -c 'sleep 3021' & sleep 3022; wait", timeout=120)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert gone_within("sleep 302", GRACE + 10), processes_with("sleep 302")


def test_a_lost_connection_stops_the_remote_command(runner, sshd):
    errors: list[BaseException] = []

    def run() -> None:
        try:
            runner.run("sleep 3031 & sleep 3032; wait", timeout=120)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while len(processes_with("sleep 303")) < 2:
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.1)
    assert sshd.drop_connections() >= 1
    thread.join(60)
    assert errors and isinstance(errors[0], SSHError), errors
    assert gone_within("sleep 303", GRACE + 10), processes_with("sleep 303")


# -- up, down and what stays, through the CLI and the Python backend ------------------------------------------------

BASE_PYTHON = sys.executable  # a prepared interpreter (the tests' venv): skips the venv where it is not the test


def up_args(sshd, remote_dir: Path, name: str, *extra: str) -> list[str]:
    host = f"{sshd.target().user}@127.0.0.1:{sshd.port}"
    return ["up", name, "--host", host, "--key", str(sshd.client_key), "--remote-dir", str(remote_dir), *extra]


def invoke(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def box_processes(remote_dir: Path) -> list[str]:
    """The box user's processes that name the art-sky directory (as `ps` there shows them): the bootstrap's."""
    listing = subprocess.run(["ps", "-ww", "-u", getpass.getuser(), "-o", "pid=,args="], capture_output=True, text=True)
    return [line for line in listing.stdout.splitlines() if str(remote_dir) in line and "ps -ww" not in line]


@pytest.fixture
def cli_home(art_sky_home, monkeypatch):
    monkeypatch.setattr(console, "width", 300)  # each message on one line
    yield art_sky_home
    for name in clusters.all_names(art_sky_home):
        CliRunner().invoke(app, ["down", name, "--force"])


def test_down_says_what_stays_and_purge_removes_it(sshd, tmp_path, cli_home):
    remote_dir = tmp_path / "remote"
    invoke(*up_args(sshd, remote_dir, "box", "--python", BASE_PYTHON))
    invoke(*up_args(sshd, remote_dir, "other", "--python", BASE_PYTHON))
    (remote_dir / "art" / "p" / "models" / "m").mkdir(parents=True)  # a model's lineage: whose, nothing says
    (remote_dir / "art" / "p" / "models" / "m" / "weights").write_bytes(b"\0" * 2_000_000)

    output = invoke("down", "box")
    host = f"{sshd.target().user}@127.0.0.1:{sshd.port}"
    assert "cluster 'box': server stopped; record removed" in output
    assert re.search(rf"left on {re.escape(host)}: checkpoints 2\.\d MB, clusters/box \d+(\.\d)? [KM]B ", output)
    assert (
        "(`art-sky down box --purge` removes clusters/box; checkpoints stays: cluster other of this host uses it)"
    ) in output, output

    result = CliRunner().invoke(app, ["down", "box", "--purge"])  # no terminal to ask on, no --yes
    assert result.exit_code == 1 and "pass --yes to purge without asking" in result.output, result.output
    assert (remote_dir / "clusters" / "box").is_dir()

    output = invoke("down", "other", "--purge", "--yes")
    assert "removed from" in output and "clusters/other" in output
    assert "kept checkpoints (2.0 MB): cluster box of this host uses it" in output, output
    assert (remote_dir / "art" / "p").is_dir() and not (remote_dir / "clusters" / "other").exists()

    output = invoke("down", "box", "--purge", "--yes")  # its record is gone, its files are not
    assert re.search(r"removed from .*: checkpoints 2\.\d MB, clusters/box", output), output
    assert not remote_dir.exists()  # as before the first up
    result = CliRunner().invoke(app, ["down", "box", "--purge", "--yes"])
    assert result.exit_code == 1 and "no cluster named 'box'" in result.output


async def test_a_failed_first_up_leaves_nothing(sshd, tmp_path, art_sky_home):
    remote_dir = tmp_path / "remote"
    # A constraint no release meets: pip fails in the venv's first install.
    options = BootstrapOptions(remote_dir=str(remote_dir), venv_python=BASE_PYTHON, constraints=["torch==0.0.1"])
    backend = art_sky.SSHBackend(sshd.target(), options=options, name="box")
    with pytest.raises(SSHError, match="exit code"):
        await backend.health()
    await backend.close()
    assert sorted(p.name for p in remote_dir.iterdir()) == ["clusters"]
    assert list((remote_dir / "clusters").iterdir()) == []  # no half-made venv, no cluster folder
    # The next up (a prepared Python: the venv is not what is tested here) works.
    options = BootstrapOptions(remote_dir=str(remote_dir), python=BASE_PYTHON)
    backend = art_sky.SSHBackend(sshd.target(), options=options, name="box")
    try:
        assert (await backend.health()).version == art_sky.__version__
    finally:
        await backend.close()


@pytest.mark.slow
def test_ctrl_c_during_the_install_stops_it_on_the_box(sshd, tmp_path, cli_home):
    remote_dir = tmp_path / "remote"
    up = art_sky_cli(*up_args(sshd, remote_dir, "box", "--venv-python", BASE_PYTHON))
    try:
        deadline = time.monotonic() + 400  # the wheel's build, then the venv's (ensurepip): a minute when idle
        while not any("-m pip install" in line for line in box_processes(remote_dir)):
            assert up.poll() is None, up.stdout.read()
            assert time.monotonic() < deadline, "pip never ran on the box"
            time.sleep(0.2)
        up.send_signal(signal.SIGINT)  # Ctrl-C
        output, _ = up.communicate(timeout=60)
        assert up.returncode != 0, output
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
    deadline = time.monotonic() + GRACE + 15
    while box_processes(remote_dir):
        assert time.monotonic() < deadline, box_processes(remote_dir)
        time.sleep(0.2)
    assert not (remote_dir / "venv").exists() or not (remote_dir / VENV_READY).exists()  # none, or made again
    assert list((remote_dir / "clusters").iterdir()) == []  # its first up: its folder went with it

    output = invoke(*up_args(sshd, remote_dir, "box", "--python", BASE_PYTHON))  # at once, nothing in the way
    assert "cluster 'box' up" in output
    output = invoke("down", "box", "--purge", "--yes")
    assert re.search(r"removed from .*: clusters/box \d", output), output
    assert not remote_dir.exists()  # as before the first up
