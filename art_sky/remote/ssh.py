"""SSH over paramiko: an `SSHTarget`, `connect()` to it, and `SSHRunner`, the command runner of an SSH host.

The runner and the tunnel both connect through `connect()`, so a host key, a key file or a ProxyCommand (what
SkyPilot records for a cluster) is handled one way, with one set of error messages.
"""

from __future__ import annotations

import codecs
import logging
import os
import re
import shlex
import time
from pathlib import Path

import paramiko
from pydantic import BaseModel

from art_sky.errors import ConfigError, SSHError
from art_sky.settings import Settings

from . import groups
from .runner import CommandResult, Output, first_line, result_of, traced, untraced

log = logging.getLogger("art_sky.ssh")


class SSHTarget(BaseModel):
    """How to reach a machine over SSH: what SkyPilot records for a cluster, or what the user gives for a host."""

    host: str
    port: int = 22
    user: str
    key_path: Path | None = None
    proxy_command: str | None = None
    env: dict[str, str] = {}  # sent with every command (ssh-config SetEnv): SkyPilot's Slurm sessions need it

    @classmethod
    def parse(cls, spec: str, key_path: str | Path | None = None) -> SSHTarget:
        """`user@host[:port]` (as `art-sky up --host` takes it)."""
        user, at, rest = spec.rpartition("@")
        host, colon, port = rest.rpartition(":") if rest.count(":") == 1 else ("", "", rest)
        host = host if colon else rest
        if not at or not user or not host or (colon and not port.isdigit()):
            raise ConfigError(f"cannot read host {spec!r}: write it as user@host or user@host:port")
        return cls(
            host=host,
            port=int(port) if colon else 22,
            user=user,
            key_path=Path(key_path).expanduser() if key_path else None,
        )

    def __str__(self) -> str:  # never includes key material
        return f"{self.user}@{self.host}:{self.port}"


def connect(target: SSHTarget, settings: Settings) -> paramiko.SSHClient:
    """An authenticated SSH connection, or an `SSHError` that says which step failed and what to check.

    Host keys: a direct host is trusted on first use and remembered in `<ART_SKY_HOME>/known_hosts` (a changed
    key is refused). A target behind a ProxyCommand (a SkyPilot cluster) is reached through a path the proxy
    already authenticated and whose host key changes with every cluster, so its key is not pinned, as
    SkyPilot's own ssh config does.
    """
    timeout = settings.ssh_connect_timeout
    key = str(target.key_path.expanduser()) if target.key_path else None
    if key is not None and not Path(key).is_file():
        raise SSHError(f"SSH key {key} for {target} does not exist: pass the private key file with --key")
    client = paramiko.SSHClient()
    client.load_system_host_keys()
    if target.proxy_command is None:
        client.load_host_keys(str(known_hosts_file(settings)))  # AutoAddPolicy saves new keys here
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    sock = paramiko.ProxyCommand(_expand_proxy_command(target)) if target.proxy_command else None
    try:
        client.connect(
            target.host,
            port=target.port,
            username=target.user,
            key_filename=key,
            timeout=timeout,
            banner_timeout=timeout,
            auth_timeout=timeout,
            channel_timeout=timeout,
            sock=sock,
            allow_agent=key is None,
            look_for_keys=key is None,
        )
    except (OSError, paramiko.SSHException, EOFError) as exc:
        client.close()
        if sock is not None:
            sock.close()  # ends the proxy process
        raise _connect_error(target, key, timeout, exc, known_hosts_file(settings)) from exc
    transport = client.get_transport()
    assert transport is not None  # connect() succeeded
    transport.set_keepalive(15)
    return client


def _connect_error(target: SSHTarget, key: str | None, timeout: float, exc: Exception, known_hosts: Path) -> SSHError:
    if isinstance(exc, paramiko.BadHostKeyException):
        return SSHError(
            f"the host key of {target} changed since art-sky first connected: if the host was "
            f"reinstalled, delete its line from {known_hosts} and retry; otherwise someone "
            "may be intercepting the connection"
        )
    if isinstance(exc, paramiko.AuthenticationException):
        return SSHError(
            f"{target} refused the login ({exc}): check the user and that the key "
            f"{key or '(agent / ~/.ssh defaults)'} is in the host's ~/.ssh/authorized_keys"
        )
    if isinstance(exc, paramiko.SSHException) and "No authentication methods available" in str(exc):  # paramiko's
        agent = "SSH_AUTH_SOCK is not set" if not os.environ.get("SSH_AUTH_SOCK") else "it holds none"
        return SSHError(
            f"no SSH key to log in to {target} with: no key file given, none in an ssh-agent ({agent}) and none of "
            "~/.ssh/id_ed25519, id_ecdsa, id_rsa exists: pass the private key whose public half is in the host's "
            "~/.ssh/authorized_keys (`--key PATH`; key_path= in Python), or `ssh-add` it"
        )
    via = f" via ProxyCommand {target.proxy_command!r}" if target.proxy_command else ""
    return SSHError(
        f"cannot reach {target}{via} within {timeout:.0f}s ({exc!r}): check the host, port and that "
        "sshd runs there (ART_SKY_SSH_CONNECT_TIMEOUT sets the wait)"
    )


class SSHRunner:
    """A `CommandRunner` over one SSH connection, opened at the first command or upload and used for the rest."""

    def __init__(self, target: SSHTarget, settings: Settings):
        self.target = target
        self.where = str(target)
        self.settings = settings
        self.known_hosts = known_hosts_file(settings)
        self._client: paramiko.SSHClient | None = None

    @property
    def client(self) -> paramiko.SSHClient:
        """The connection, (re)opened when there is none or it died (a long session outlives network drops)."""
        transport = self._client.get_transport() if self._client is not None else None
        if transport is None or not transport.is_active():
            self.close()
            self._client = connect(self.target, self.settings)
        return self._client

    def run(
        self, script: str, *, timeout: float, stdin: bytes = b"", check: bool = True, output: Output | None = None
    ) -> CommandResult:
        """Run a POSIX sh script (whatever the login shell is) and wait at most `timeout` seconds; `output` gets its
        stdout and stderr as they arrive.

        Secrets go in through `stdin`, never in `script`: the script is visible in the remote process list. The
        script runs in a process group of its own that ends with the channel (art_sky.remote.groups): an interrupt
        here (Ctrl-C, a timeout) closes the channel, a lost connection closes it there, and the box stops the group.
        """
        transport = self.client.get_transport()
        if transport is None or not transport.is_active():
            raise SSHError(f"the SSH connection to {self.target} is closed: retry the command")
        channel = None
        try:
            channel = transport.open_session(timeout=timeout)
            if self.target.env:  # SkyPilot's Slurm entries set the job's HOME this way (ssh-config SetEnv)
                channel.update_environment(self.target.env)
            channel.exec_command(groups.command(traced(script), stdin))
            if stdin:
                channel.sendall(stdin)  # and no end of file: the group lives while the channel is open
            stdout, stderr = _read_until_exit(channel, time.monotonic() + timeout, output)
        except BaseException as exc:
            if channel is not None:
                channel.close()  # the box stops the command's process group
            if isinstance(exc, TimeoutError):
                raise SSHError(
                    f"a command on {self.target} did not finish within {timeout:.0f}s: {first_line(script)}"
                ) from exc
            if isinstance(exc, OSError | paramiko.SSHException | EOFError):
                raise SSHError(
                    f"the SSH connection to {self.target} failed during a command ({exc!r}): check the host and retry"
                ) from exc
            raise
        exit_code = channel.recv_exit_status()
        channel.close()
        return result_of(script, exit_code, stdout, stderr, check=check, where=f"on {self.target}", error=SSHError)

    def upload(self, local: Path, remote: str) -> None:
        """Copy a file to `remote` (relative paths are relative to the login directory)."""
        try:
            with self.client.open_sftp() as sftp:
                sftp.put(str(local), remote)
        except (OSError, paramiko.SSHException) as exc:
            raise SSHError(
                f"uploading {local} to {self.target}:{remote} failed ({exc!r}): check the remote "
                "directory is writable and the disk not full"
            ) from exc

    def shell_argv(self, command: list[str]) -> list[str]:
        """The system's ssh with the target's key, ProxyCommand and environment (a SkyPilot Slurm job's HOME)."""
        target = self.target
        argv = ["ssh", "-p", str(target.port)]
        if target.key_path:
            argv += ["-i", str(target.key_path), "-o", "IdentitiesOnly=yes"]
        if target.proxy_command:  # as connect(): a proxied cluster's host key changes with every cluster
            argv += [
                "-o",
                f"ProxyCommand={target.proxy_command}",
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                "UserKnownHostsFile=/dev/null",
                "-o",
                "LogLevel=ERROR",
            ]
        else:  # the host key art-sky pinned when it first connected
            argv += ["-o", f"UserKnownHostsFile={self.known_hosts}"]
        argv += [arg for k, v in target.env.items() for arg in ("-o", f"SetEnv={k}={v}")]
        return argv + [f"{target.user}@{target.host}", *([shlex.join(command)] if command else [])]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> SSHRunner:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _read_until_exit(channel: paramiko.Channel, deadline: float, output: Output | None) -> tuple[str, str]:
    stdout, stderr = bytearray(), bytearray()
    decoders = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in range(2)]
    shown = [output, untraced(output)] if output is not None else [None, None]  # stderr without the trace
    while True:
        busy = False
        for kept, ready, recv, decoder, show in (
            (stdout, channel.recv_ready, channel.recv, decoders[0], shown[0]),
            (stderr, channel.recv_stderr_ready, channel.recv_stderr, decoders[1], shown[1]),
        ):
            if ready():
                chunk = recv(65536)
                kept += chunk
                busy = True
                if show is not None:
                    show(decoder.decode(chunk))
        if not busy and channel.exit_status_ready() and channel.eof_received:
            if shown[1] is not None:
                shown[1]("")
            return stdout.decode(errors="replace"), stderr.decode(errors="replace")
        if channel.closed and not busy:
            raise EOFError("the channel closed before the command exited")
        if time.monotonic() > deadline:
            channel.close()
            raise TimeoutError
        if not busy:
            time.sleep(0.02)


def _expand_proxy_command(target: SSHTarget) -> str:
    """OpenSSH's tokens in a ProxyCommand: %h host, %p port, %r user, %% a percent sign."""
    values = {"h": target.host, "p": str(target.port), "r": target.user, "%": "%"}
    return re.sub(r"%([hpr%])", lambda m: values[m.group(1)], target.proxy_command or "")


def known_hosts_file(settings: Settings) -> Path:
    path = settings.home / "known_hosts"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)
    return path
