"""The tunnel against a real sshd: forwarding, reconnect after a dropped connection, ProxyCommand, bad input."""

from __future__ import annotations

import os
import signal
import socket
import socketserver
import threading
import time

import pytest
from sshd import art_sky_home, free_port, sshd  # noqa: F401 (fixtures)

from art_sky.errors import ConfigError, SSHError
from art_sky.remote.ssh import SSHRunner
from art_sky.remote.tunnel import Tunnel
from art_sky.settings import Settings


class _Echo(socketserver.BaseRequestHandler):
    def handle(self):
        while data := self.request.recv(65536):
            self.request.sendall(data.upper())


@pytest.fixture(scope="module")
def echo_port():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def roundtrip(port: int, payload: bytes = b"hello") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.settimeout(10)
        sock.sendall(payload)
        received = b""
        while len(received) < len(payload):
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
        return received


def test_forwards_to_the_remote_port(sshd, echo_port, art_sky_home):
    with Tunnel(sshd.target(), echo_port, Settings()) as tunnel:
        assert tunnel.base_url == f"http://127.0.0.1:{tunnel.local_port}"
        assert roundtrip(tunnel.local_port) == b"HELLO"
        big = bytes(range(97, 123)) * 40000  # 1 MB: many SSH packets, window adjustments
        assert roundtrip(tunnel.local_port, big) == big.upper()
    assert (art_sky_home / "known_hosts").read_text().startswith(f"[127.0.0.1]:{sshd.port} ssh-ed25519 ")


def test_reconnects_after_the_connection_drops(sshd, echo_port, art_sky_home):
    with Tunnel(sshd.target(), echo_port, Settings()) as tunnel:
        assert roundtrip(tunnel.local_port) == b"HELLO"
        assert sshd.drop_connections() >= 1
        deadline = time.monotonic() + 15
        while tunnel.reconnects == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tunnel.reconnects == 1
        assert roundtrip(tunnel.local_port, b"again") == b"AGAIN"


def test_reconnects_when_the_server_goes_silent(sshd, echo_port, art_sky_home):
    with Tunnel(sshd.target(), echo_port, Settings(), keepalive=1.0) as tunnel:
        assert roundtrip(tunnel.local_port) == b"HELLO"
        frozen = sshd.freeze_connections()
        try:
            assert frozen
            deadline = time.monotonic() + 15
            while tunnel.reconnects == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert tunnel.reconnects == 1
            assert roundtrip(tunnel.local_port, b"awake") == b"AWAKE"
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGKILL)


class _Reverse(socketserver.BaseRequestHandler):
    def handle(self):
        while data := self.request.recv(65536):
            self.request.sendall(data[::-1])


def test_a_held_tunnel_keeps_its_port_and_forwards_to_its_new_target_once_released(
    sshd,
    echo_port,
    art_sky_home,
):
    """As a relaunched cluster is reached: the local port stays, connections made meanwhile wait and then reach
    the new remote port."""
    other = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Reverse)
    other.daemon_threads = True
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        with Tunnel(sshd.target(), echo_port, Settings(), reconnect_wait=1.0) as tunnel:
            port = tunnel.local_port
            assert roundtrip(port) == b"HELLO"
            tunnel.hold()
            answer: list[bytes] = []
            waiting = threading.Thread(target=lambda: answer.append(roundtrip(port, b"held")))
            waiting.start()
            waiting.join(3)  # longer than reconnect_wait: a hold is not a dropped connection that times out
            assert waiting.is_alive() and not answer
            tunnel.retarget(sshd.target(), other.server_address[1])
            tunnel.release()
            waiting.join(10)
            assert answer == [b"dleh"] and tunnel.local_port == port
            assert roundtrip(port, b"new") == b"wen"
    finally:
        other.shutdown()
        other.server_close()


def proxied(sshd):
    """The sshd's target reached as SkyPilot's clusters are: ProxyCommand with %h/%p, here an `ssh -W` through the
    same sshd."""
    proxy = (
        f"ssh -i {sshd.client_key} -p {sshd.port} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
        f"-o BatchMode=yes -W %h:%p {sshd.target().user}@127.0.0.1"
    )
    return sshd.target().model_copy(update={"proxy_command": proxy})


def test_through_a_proxy_command(sshd, echo_port, art_sky_home):
    with Tunnel(proxied(sshd), echo_port, Settings()) as tunnel:
        assert roundtrip(tunnel.local_port) == b"HELLO"
    assert not (art_sky_home / "known_hosts").exists()  # a proxied host's key is not pinned


def test_a_proxy_command_that_dies_is_started_again_and_no_thread_ends_in_a_traceback(
    sshd, echo_port, art_sky_home, monkeypatch
):
    """As when a lost SkyPilot cluster's websocket proxy exits: the keepalive finds the connection dead without a
    thread dying of it, and the tunnel reconnects through a new proxy."""
    died: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(f"{args.thread.name}: {args.exc_value!r}"))
    with Tunnel(proxied(sshd), echo_port, Settings(), keepalive=0.2) as tunnel:
        assert roundtrip(tunnel.local_port) == b"HELLO"
        tunnel._client.get_transport().sock.process.kill()  # the proxy command's process
        deadline = time.monotonic() + 15
        while tunnel.reconnects == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tunnel.reconnects == 1
        assert roundtrip(tunnel.local_port, b"again") == b"AGAIN"
    assert died == []


def test_remote_port_with_nothing_listening_closes_the_connection(sshd, art_sky_home):
    """The client sees its connection closed (EOF or reset), at once, rather than a hang."""
    with Tunnel(sshd.target(), free_port(), Settings()) as tunnel:
        try:
            assert roundtrip(tunnel.local_port) == b""
        except ConnectionResetError:
            pass


def test_local_port_in_use(sshd, echo_port, art_sky_home):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(ConfigError, match="cannot listen on 127.0.0.1:.*pick another local port"):
            Tunnel(sshd.target(), echo_port, Settings(), local_port=busy.getsockname()[1]).start()


def test_wrong_key(sshd, echo_port, art_sky_home):
    with pytest.raises(SSHError, match="refused the login.*authorized_keys"):
        Tunnel(sshd.target(key=sshd.other_key), echo_port, Settings()).start()


def test_missing_key_file(sshd, tmp_path, art_sky_home):
    with pytest.raises(SSHError, match="does not exist"):
        SSHRunner(sshd.target(key=tmp_path / "nope"), Settings()).run("true", timeout=10)


def test_unreachable_host(sshd, art_sky_home):
    target = sshd.target().model_copy(update={"port": free_port()})
    started = time.monotonic()
    with pytest.raises(SSHError, match="cannot reach .*check the host, port"):
        SSHRunner(target, Settings(ssh_connect_timeout=5)).run("true", timeout=10)
    assert time.monotonic() - started < 10


def test_changed_host_key_is_refused(sshd, art_sky_home):
    known_hosts = art_sky_home / "known_hosts"
    with SSHRunner(sshd.target(), Settings()) as runner:
        runner.run("true", timeout=10)
    line = known_hosts.read_text().split()
    other = (sshd.root / "other_key.pub").read_text().split()
    known_hosts.write_text(f"{line[0]} {other[0]} {other[1]}\n")
    with pytest.raises(SSHError, match="host key of .* changed"):
        SSHRunner(sshd.target(), Settings()).run("true", timeout=10)


def test_run_captures_output_exit_code_and_stdin(sshd, art_sky_home):
    with SSHRunner(sshd.target(), Settings()) as session:
        result = session.run(
            "read -r secret; echo out-$secret; echo err >&2; exit 3", timeout=10, stdin=b"s3cret\n", check=False
        )
        assert (result.exit_code, result.stdout, result.stderr) == (3, "out-s3cret\n", "err\n")
        with pytest.raises(SSHError, match="exit code 3"):
            session.run("exit 3", timeout=10)
        started = time.monotonic()
        with pytest.raises(SSHError, match="did not finish within 1s"):
            session.run("sleep 30", timeout=1)
        assert time.monotonic() - started < 5
