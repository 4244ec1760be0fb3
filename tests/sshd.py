"""A real OpenSSH server for the tests: 127.0.0.1, a free port, a throwaway host key, key-only login.

Use the `sshd` fixture (`pytest_plugins = ["tests.sshd"]`); `tests/setup/10-openssh.sh` installs OpenSSH.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from art_sky.remote.ssh import SSHTarget

SSHD = "/usr/sbin/sshd"
SFTP_SERVER = "/usr/lib/openssh/sftp-server"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def keygen(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True, timeout=30)
    return path


class Sshd:
    """One sshd process; `drop_connections()` kills the per-connection children, as a network drop would."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.client_key = keygen(root / "client_key")
        self.other_key = keygen(root / "other_key")  # not authorized: the wrong key
        host_key = keygen(root / "host_key")
        authorized = root / "authorized_keys"
        authorized.write_text((root / "client_key.pub").read_text())
        authorized.chmod(0o600)
        self.config = root / "sshd_config"
        self.config.write_text(f"""
ListenAddress 127.0.0.1
Port {self.port}
HostKey {host_key}
PidFile {root / "sshd.pid"}
AuthorizedKeysFile {authorized}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
AllowTcpForwarding local
Subsystem sftp {SFTP_SERVER}
LogLevel ERROR
""")
        self.log = root / "sshd.log"
        self.process: subprocess.Popen | None = None

    def target(self, key: Path | None = None) -> SSHTarget:
        return SSHTarget(host="127.0.0.1", port=self.port, user=getpass.getuser(), key_path=key or self.client_key)

    def start(self) -> None:
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [SSHD, "-D", "-e", "-f", str(self.config)], stdout=subprocess.DEVNULL, stderr=log
            )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sshd exited: {self.log.read_text()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"sshd did not listen on {self.port} within 15s: {self.log.read_text()}")

    def children(self) -> list[int]:
        assert self.process is not None
        path = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        return [int(pid) for pid in path.read_text().split()]

    def drop_connections(self) -> int:
        """SIGKILL every sshd child serving a connection; returns how many."""
        pids = self.children()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return len(pids)

    def freeze_connections(self) -> list[int]:
        """SIGSTOP the processes serving connections: the peer goes silent, TCP stays up (a sleeping laptop's
        view of a vanished network). SIGKILL the returned pids when done."""
        pids, todo = [], self.children()
        while todo:
            pid = todo.pop()
            pids.append(pid)
            todo += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        return pids

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@pytest.fixture(scope="session")
def sshd(tmp_path_factory) -> Iterator[Sshd]:
    if not (os.path.exists(SSHD) and shutil.which("ssh-keygen")):
        pytest.fail("OpenSSH is missing: run tests/setup/10-openssh.sh (tests/run.sh does)")
    server = Sshd(tmp_path_factory.mktemp("sshd"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def art_sky_home(tmp_path, monkeypatch) -> Path:
    """Keep known_hosts and cluster records of a test out of the real ~/.art-sky."""
    home = tmp_path / "art-sky-home"
    monkeypatch.setenv("ART_SKY_HOME", str(home))
    return home
