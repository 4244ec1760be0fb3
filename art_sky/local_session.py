"""`LocalSession`: `SSHSession.run` on this machine, so the bootstrap's scripts start, probe, stop and tail a
detached server here (`art-sky up --local`) exactly as they do on an SSH host or a SkyPilot cluster.
"""

from __future__ import annotations

import subprocess

from art_sky.errors import BackendUnavailableError
from art_sky.provisioners import SSHTarget
from art_sky.ssh import CommandResult, SSHSession, first_line


class LocalSession:
    target = "this machine"

    def run(self, script: str, *, timeout: float, stdin: bytes = b"", check: bool = True) -> CommandResult:
        """Run a POSIX sh script here; secrets go in through `stdin` (not in argv), as over SSH."""
        try:
            done = subprocess.run(["sh", "-c", script], input=stdin, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise BackendUnavailableError(f"`{first_line(script)}` did not finish within {timeout:.0f}s here") \
                from exc
        result = CommandResult(exit_code=done.returncode, stdout=done.stdout.decode(errors="replace"),
                               stderr=done.stderr.decode(errors="replace"))
        if check and result.exit_code != 0:
            raise BackendUnavailableError(f"`{first_line(script)}` failed here with exit code {result.exit_code}:\n"
                                          f"{(result.stderr or result.stdout).strip()[-2000:]}")
        return result

    def close(self) -> None:
        pass

    def __enter__(self) -> LocalSession:
        return self

    def __exit__(self, *exc_info) -> None:
        pass


def open_session(target: SSHTarget | None) -> SSHSession | LocalSession:
    """A session on the cluster's machine: over SSH, or this machine when there is no target."""
    return SSHSession(target) if target else LocalSession()
