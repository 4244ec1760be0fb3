"""Interrupts and failures leave an SSH box clean: a remote command's process group ends with its session (a
timeout, Ctrl-C here, a lost connection), a failed `up` leaves nothing the next one trips on, `down` says what stays
and `down --purge` removes it. Against the real test sshd on 127.0.0.1."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
from sshd import art_sky_home, sshd  # noqa: F401 (fixtures)

from art_sky.errors import SSHError
from art_sky.remote.groups import GRACE
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
