"""The `art-sky` CLI as a separate process (what a user's shell runs), with output that can be waited on."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading

import pytest

# Runs argv[1:] with SIGINT at its default. A test run started in the background (`nohup bash tests/run.sh &`)
# ignores SIGINT, children inherit that, and Python then installs no KeyboardInterrupt: a test's Ctrl-C would be
# lost. exec keeps a default disposition; unlike `preexec_fn`, this is safe with the tests' reader threads.
_DEFAULT_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
)


def python_command(*args: str) -> list[str]:
    """`python ARGS` (this interpreter) with SIGINT at its default, whoever started the test run."""
    return [sys.executable, "-c", _DEFAULT_SIGINT, sys.executable, *args]


def art_sky_cli(*args: str) -> subprocess.Popen:
    """`art-sky ARGS` in a child process with this environment (ART_SKY_HOME included) and SIGINT at its default
    (the tests send it Ctrl-C); output merged."""
    return subprocess.Popen(
        python_command("-m", "art_sky.cli", *args),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=os.environ.copy(),
    )


class Lines:
    """A process's output lines, read in a thread so that waiting for one can time out."""

    def __init__(self, process: subprocess.Popen):
        self.seen: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self._queue.put(line) for line in process.stdout], daemon=True).start()

    def next(self, timeout: float, waiting_for: str) -> str:
        try:
            line = self._queue.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no {waiting_for} within {timeout}s; got {self.seen}")
        self.seen.append(line)
        return line

    def until(self, prefix: str, timeout: float) -> dict[str, str]:
        """KEY=VALUE lines up to the one whose key is `prefix`."""
        found: dict[str, str] = {}
        while True:
            key, _, value = self.next(timeout, f"{prefix} line").strip().partition("=")
            found[key] = value
            if key == prefix:
                return found

    def containing(self, text: str, timeout: float) -> str:
        """The first line containing `text`."""
        while text not in (line := self.next(timeout, repr(text))):
            pass
        return line

    def rest(self) -> str:
        while not self._queue.empty():
            self.seen.append(self._queue.get())
        return "".join(self.seen)


def ssh_and_follow(name: str) -> str:
    """`art-sky ssh NAME -- cmd` runs there with the system's ssh (returns what it printed: the directory of the
    server's files, then "done"); `art-sky logs --follow` streams the server's log."""
    ssh = art_sky_cli("ssh", "--name", name, "--", "sh", "-c", "cd art-sky 2>/dev/null; pwd; echo done")
    output, _ = ssh.communicate(timeout=120)
    assert ssh.returncode == 0 and "done" in output, output
    follow = art_sky_cli("logs", "--name", name, "--lines", "500", "--follow")
    try:
        Lines(follow).containing("listening on 127.0.0.1", timeout=120)
    finally:
        follow.terminate()
        follow.wait(10)
    return output
