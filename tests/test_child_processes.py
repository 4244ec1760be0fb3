"""The one way the server stops a child it started (cluster/processes.py): vLLM's server, torchrun and its ranks each
lead a process group, and the whole group ends, politely if it can, killed if it must, and a group already gone is
no error."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from art_sky.cluster.processes import stop_group

# A child that starts a grandchild in its group, both deaf to SIGTERM (a stuck engine), then waits.
DEAF = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                        "print(flush=True); time.sleep(60)"])
time.sleep(60)
"""


def group_alive(pgid: int) -> bool:
    """A process of the group runs (a zombie does not count: here nothing may reap an orphan's)."""
    return any(
        ps.split()[1] == str(pgid) and not ps.split()[0].startswith("Z")
        for ps in subprocess.run(
            ["ps", "-eo", "stat=,pgid="], capture_output=True, text=True, check=True
        ).stdout.splitlines()
    )


def start(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE)


def test_a_group_deaf_to_sigterm_is_killed_whole_after_the_grace():
    child = start(DEAF)
    child.stdout.readline()  # the grandchild is up
    began = time.monotonic()
    stop_group(child, grace=0.5)
    assert 0.5 <= time.monotonic() - began < 5
    assert child.returncode == -signal.SIGKILL and not group_alive(child.pid)


def test_a_child_asked_to_stop_ends_on_its_own_and_is_not_signalled():
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], start_new_session=True, stdin=subprocess.PIPE
    )
    child.stdin.close()  # what "stop" is to this child
    stop_group(child, asked=True, grace=30)
    assert child.returncode == 0 and not group_alive(child.pid)


def test_what_is_left_of_a_group_whose_leader_ended_is_stopped_and_a_gone_group_is_no_error():
    leader = start(
        "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; print(flush=True); "
        "time.sleep(60)'], stdout=sys.stdout)"
    )
    leader.stdout.readline()
    leader.wait()
    assert group_alive(leader.pid)  # its child lives on in the group
    stop_group(leader, grace=5)
    assert not group_alive(leader.pid)
    stop_group(leader, grace=5)  # nothing left: no error


def test_a_child_that_ends_while_its_group_is_looked_at_is_reaped(monkeypatch):
    """The interleaving CI once met: the child dies after one check of it and before the look at its group."""
    from art_sky.cluster import processes

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"], start_new_session=True)
    looked = processes._running

    def look_once_the_child_is_a_zombie(group: int) -> bool:
        while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)
        return looked(group)

    monkeypatch.setattr(processes, "_running", look_once_the_child_is_a_zombie)
    stop_group(child, asked=True, grace=5)
    assert child.returncode == 0 and not group_alive(child.pid)


# A "server" that starts its child the one way, prints the child's pid, then waits to be killed.
SERVER = """
import sys, time
from art_sky.cluster.processes import start_child
print(start_child([sys.executable, "-c", "import time; time.sleep(60)"]).pid, flush=True)
time.sleep(60)
"""


def test_a_child_started_the_one_way_leads_its_group_and_ends_when_its_server_is_killed():
    """kill -9 of the server ends its child (the parent-death signal, set before the command runs), whatever started
    it: no engine or trainer rank outlives the server that started it."""
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        child = int(server.stdout.readline())
        assert subprocess.run(
            ["ps", "-o", "pgid=", "-p", str(child)], capture_output=True, text=True
        ).stdout.strip() == str(child)
        deadline = time.monotonic() + 10
        while (cmdline := Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0"))[
            2
        ] != b"import time; time.sleep(60)":
            assert time.monotonic() < deadline, f"the wrapper never ran the command: {cmdline}"
            time.sleep(0.05)  # the command itself, the wrapper gone (exec keeps the pid)
        assert group_alive(child)
        server.kill()
        server.wait()
        deadline = time.monotonic() + 10
        while group_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not group_alive(child), "the child outlived its killed server"
    finally:
        server.kill()
        server.wait()
