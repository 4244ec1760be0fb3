"""`Tunnel`: a local port on 127.0.0.1 forwarded over one SSH connection to a port on the cluster's head node.

Nothing on the cluster listens beyond its own 127.0.0.1. When the SSH connection drops, a watchdog reconnects
with exponential backoff; connections accepted meanwhile wait for it, and requests cut mid-flight fail with
a connection error that the HTTP client retries (idempotent ones), so a drop costs a pause, not a run.

The local port outlives the cluster behind it: while a lost cluster is replaced (art_sky/backends/recovery.py)
the tunnel is held (accepted connections wait), then `retarget` points it at the new cluster and `release` lets
them through, so a base URL handed out once (an OpenAI client's) stays valid.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import paramiko

from art_sky.errors import ConfigError, SSHError
from art_sky.redact import redact
from art_sky.settings import Settings

from .ssh import SSHTarget, connect

log = logging.getLogger("art_sky.tunnel")


class Tunnel:
    """Forward 127.0.0.1:`local_port` (0 picks a free one) to `remote_host`:`remote_port` as seen by `target`."""

    def __init__(
        self,
        target: SSHTarget,
        remote_port: int,
        settings: Settings,
        *,
        local_port: int = 0,
        remote_host: str = "127.0.0.1",
        keepalive: float = 15.0,
        reconnect_wait: float = 60.0,
        max_backoff: float = 30.0,
        refused_wait: float = 0.0,
    ):
        self.target = target
        self.settings = settings
        self.keepalive = keepalive  # seconds between liveness probes, and the wait for each answer
        self.remote = (remote_host, remote_port)
        self.reconnect_wait = reconnect_wait
        self.refused_wait = refused_wait  # how long a connection retries a remote port that refuses (a server gone,
        # whose cluster is about to be replaced: a hold begins meanwhile); 0 closes it at once
        self.max_backoff = max_backoff
        self.reconnects = 0  # how many times the SSH connection was re-established
        self._requested_port = local_port
        self._client: paramiko.SSHClient | None = None
        self._listener: socket.socket | None = None
        self._up = threading.Event()
        self._open = threading.Event()  # cleared while held: connections wait, nothing reconnects
        self._open.set()
        self._connecting = threading.Lock()  # one SSH connection made at a time (the watchdog's, or `retarget`'s)
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def local_port(self) -> int:
        if self._listener is None:
            raise ConfigError("the tunnel is not started: call start() first")
        return self._listener.getsockname()[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.local_port}"

    @property
    def connected(self) -> bool:
        transport = self._client.get_transport() if self._client else None
        return transport is not None and transport.is_active()

    def start(self) -> int:
        """Connect (raises `SSHError` if it cannot), listen, and return the local port."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind(("127.0.0.1", self._requested_port))
        except OSError as exc:
            listener.close()
            raise ConfigError(
                f"cannot listen on 127.0.0.1:{self._requested_port} for the tunnel ({exc.strerror}): "
                "pick another local port, or 0 for a free one"
            ) from exc
        listener.listen(64)
        try:
            self._connect()
        except SSHError:
            listener.close()
            raise
        self._listener = listener
        for target in (self._accept_loop, self._watchdog):
            thread = threading.Thread(target=target, name=f"art-sky-tunnel-{target.__name__}", daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("tunnel 127.0.0.1:%d -> %s -> %s:%d", self.local_port, self.target, *self.remote)
        return self.local_port

    def close(self) -> None:
        """Stop listening, drop forwarded connections and the SSH connection."""
        self._closed.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        if self._client is not None:
            self._client.close()
        for thread in self._threads:  # daemons that end within a poll (0.5 s) of `_closed`: never a long wait,
            thread.join(timeout=1)  # so Ctrl-C on `art-sky tunnel` ends it promptly even on a loaded machine

    def hold(self) -> None:
        """Connections accepted from now on wait (until `release`, or `close` drops them), and a lost SSH
        connection is not reconnected: the cluster behind the tunnel is being replaced."""
        self._open.clear()

    def retarget(self, target: SSHTarget, remote_port: int) -> None:
        """Forward to `remote_port` on `target` from now on, on the same local port: connect there (SSHError if it
        cannot) and drop the old connection."""
        with self._connecting:
            self.target, self.remote = target, (self.remote[0], remote_port)
        if not self._connect():
            raise SSHError(f"the tunnel to {target} was closed or retargeted while connecting")
        log.info("tunnel 127.0.0.1:%d now -> %s -> %s:%d", self.local_port, self.target, *self.remote)

    def release(self) -> None:
        """Let the connections waiting since `hold` through."""
        self._open.set()

    def __enter__(self) -> Tunnel:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _connect(self) -> bool:
        """Connect to the target; False when the tunnel was closed or retargeted meanwhile (that connection is
        dropped: a slow attempt to a lost cluster never holds up the switch to its replacement)."""
        target = self.target
        client = connect(target, self.settings)
        _no_delay(getattr(client.get_transport(), "sock", None))
        with self._connecting:
            if self._closed.is_set() or target is not self.target:
                client.close()
                return False
            old, self._client = self._client, client
        if old is not None:
            old.close()
        self._up.set()
        return True

    def _watchdog(self) -> None:
        """Reconnect with exponential backoff whenever the SSH connection is found dead or silent."""
        delay = 0.5
        next_probe = time.monotonic() + self.keepalive
        while not self._closed.wait(0.5):
            if not self._open.is_set():
                continue  # held: the cluster is being replaced, and `retarget` connects to the new one
            if self.connected and time.monotonic() >= next_probe:
                next_probe = time.monotonic() + self.keepalive
                if not self._answers(self.keepalive) and not self._closed.is_set():
                    log.warning(
                        "%s did not answer a keepalive within %.0fs; dropping the connection",
                        self.target,
                        self.keepalive,
                    )
                    assert self._client is not None  # `connected`: a client, never unset once made
                    self._client.close()
            if self.connected:
                continue
            self._up.clear()
            log.warning("SSH connection to %s lost; reconnecting", self.target)
            while not self._closed.is_set() and self._open.is_set():
                try:
                    if self._connect():
                        self.reconnects += 1
                        log.info("SSH connection to %s re-established", self.target)
                except SSHError as exc:
                    log.warning("reconnect to %s failed (%s); next try in %.1fs", self.target, redact(str(exc)), delay)
                    self._closed.wait(delay)
                    delay = min(delay * 2, self.max_backoff)
                    continue
                delay = 0.5
                break

    def _answers(self, timeout: float) -> bool:
        """Does the server answer a request? A connection whose peer vanished (laptop asleep, network changed)
        stays open for TCP's many minutes, and one whose ProxyCommand died (a SkyPilot cluster's proxy) never sees
        an end of file: no answer is how either is found."""
        transport = self._client.get_transport() if self._client else None
        if transport is None:
            return True  # closed meanwhile: no connection to ask, which `connected` reports
        done, answered = threading.Event(), threading.Event()

        def ask() -> None:
            try:
                transport.global_request("keepalive@openssh.com", wait=True)
                answered.set()  # a reply (OpenSSH's is a refusal) or the transport closed, which `connected` reports
            except (paramiko.SSHException, OSError, EOFError):
                pass  # the request could not be sent: its proxy command gone, its socket broken
            finally:
                done.set()

        threading.Thread(target=ask, daemon=True, name="art-sky-tunnel-keepalive").start()
        return done.wait(timeout) and answered.is_set()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # closed
            thread = threading.Thread(
                target=self._forward, args=(conn, peer), daemon=True, name="art-sky-tunnel-forward"
            )
            thread.start()

    def _open_channel(self, peer: tuple[str, int]) -> paramiko.Channel | None:
        """A channel to the remote port: after a hold (however long), and up to `reconnect_wait` for a dropped
        connection to come back; None when there is none to be had (the client sees its connection closed)."""
        deadline = time.monotonic() + self.reconnect_wait
        refused_since: float | None = None
        while not self._closed.is_set():
            if not self._open.is_set():
                self._open.wait(0.5)
                deadline, refused_since = time.monotonic() + self.reconnect_wait, None
                continue
            if not self._up.wait(0.5):
                if time.monotonic() > deadline:
                    return None
                continue
            transport = self._client.get_transport() if self._client else None
            try:
                if transport is not None:  # None: the connection is gone (the watchdog reconnects)
                    return transport.open_channel("direct-tcpip", self.remote, peer, timeout=30)
            except (paramiko.SSHException, OSError, EOFError, AttributeError) as exc:
                if transport is not None and transport.is_active():  # nothing listens at the remote port
                    refused_since = refused_since or time.monotonic()
                    if time.monotonic() - refused_since >= self.refused_wait:
                        log.warning(
                            "cannot open a channel to %s:%d on %s: %s", *self.remote, self.target, redact(repr(exc))
                        )
                        return None
            if time.monotonic() > deadline:
                return None
            time.sleep(0.5)  # the connection died under us: the watchdog notices and reconnects (or a hold begins)
        return None

    def _forward(self, conn: socket.socket, peer: tuple[str, int]) -> None:
        """One forwarded connection: this thread copies the channel to the socket, a second one the socket to the
        channel. Blocking reads on both sides, no select(): polling a paramiko channel costs a pipe write and read
        per SSH packet, and a streamed completion is one packet per token."""
        _no_delay(conn)
        channel = self._open_channel(peer)
        if channel is None:
            conn.close()  # closing the socket tells the client to retry
            return
        threading.Thread(
            target=self._to_channel, args=(conn, channel), daemon=True, name="art-sky-tunnel-upstream"
        ).start()
        try:
            while data := channel.recv(65536):  # b"" once the channel or the SSH connection closed
                conn.sendall(data)
        except (OSError, paramiko.SSHException, EOFError):
            pass
        finally:
            _close_channel(channel)
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes the upstream thread's recv
            except OSError:
                pass
            conn.close()

    @staticmethod
    def _to_channel(conn: socket.socket, channel: paramiko.Channel) -> None:
        try:
            while data := conn.recv(65536):  # b"" once the client closed its side
                channel.sendall(data)
        except (OSError, paramiko.SSHException, EOFError):
            pass
        finally:
            _close_channel(channel)  # ends the downstream loop too


def _close_channel(channel: paramiko.Channel) -> None:
    try:
        channel.close()
    except (OSError, paramiko.SSHException, EOFError):
        pass  # the connection under it is already gone


def _no_delay(sock: object) -> None:
    """Send small writes at once: with Nagle's algorithm an HTTP response written in two pieces waits for the
    peer's delayed ACK (40 ms) before its second piece leaves. asyncio sets this on its own sockets; the tunnel's
    are plain sockets (a ProxyCommand's pipe has no such option)."""
    if isinstance(sock, socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
