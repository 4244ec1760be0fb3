"""`python -m art_sky.cluster`: start the cluster server. The API key comes from ART_SKY_API_KEY (never argv).

With `--run-dir` the server keeps its run files there (art_sky.layout: server.pid, port.json, server.log) and
logs to server.log; `--detach` also puts it in its own session and returns at once. Every way of starting a server
goes through here: the laptop's lifecycle (art_sky.remote.lifecycle: this machine, an SSH host) and the SkyPilot
task (templates/cluster.yaml). Nothing that starts threads (torch, uvicorn) is imported before the fork, and the
GPU layout (cluster/node/placement.py) is chosen before CUDA initializes. With `--join HEAD_URL` it is a worker
node's replica server (cluster/replica.py) instead: it joins the head's inference fleet once it listens, and a head
that refuses it ends it, saying why.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path

from art_sky.errors import ConfigError
from art_sky.files import atomic_write
from art_sky.layout import LOCK_FILE, ServerLayout
from art_sky.ownership import Unlockable, alive, hold
from art_sky.redact import add_secrets, redact_logging
from art_sky.settings import Settings
from art_sky.wire import node_url


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m art_sky.cluster", description=__doc__)
    parser.add_argument(
        "--host",
        action="append",
        help="address to bind (default 127.0.0.1: reach it by tunnel); "
        "repeat it to bind several (a multi-node head: 127.0.0.1 and its private address)",
    )
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one")
    parser.add_argument("--art-path", type=Path, default=Path(".art"), help="root of the checkpoint tree")
    parser.add_argument("--run-dir", type=Path, help="keep server.pid, port.json and server.log here")
    parser.add_argument("--detach", action="store_true", help="with --run-dir: run in a new session, return at once")
    parser.add_argument(
        "--exit-with",
        type=int,
        metavar="PID",
        help="stop when process PID ends (a LocalBackend's script: no server outlives it)",
    )
    parser.add_argument(
        "--join",
        metavar="HEAD_URL",
        help="a worker node: serve this node's engine as a replica in the fleet of the head's server "
        "at HEAD_URL (http://HEAD:PORT on the cluster's private network), no trainer",
    )
    parser.add_argument(
        "--advertise",
        metavar="HOST",
        help="with --join: the address the head reaches this replica at (default: --host, or this "
        "node's address when --host binds every interface)",
    )
    parser.add_argument(
        "--node-rank",
        type=int,
        metavar="RANK",
        help="with --join: this node's rank in the cluster (1 and up; SkyPilot's SKYPILOT_NODE_RANK): "
        "the head refuses a second replica of a rank its fleet has",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        sys.exit(f"--port {args.port} is not a TCP port: give 1 to 65535, or 0 for a free one")
    if args.node_rank is not None and (not args.join or args.node_rank < 1):
        sys.exit("--node-rank is a worker node's (with --join): 1 and up (the head is rank 0)")
    if args.join:
        try:
            node_url(args.join)
        except ValueError as exc:
            sys.exit(f"--join {args.join!r}: {exc}")
        if args.node_rank is None:
            sys.exit(
                "--join needs --node-rank: this worker node's rank in the cluster, 1 to ART_SKY_NODES - 1 "
                "(SkyPilot's SKYPILOT_NODE_RANK); the head keeps one replica per rank"
            )
    try:
        settings = Settings()
    except ConfigError as exc:  # a bad ART_SKY_* value: its variable and where it was read, not a traceback
        sys.exit(str(exc))
    if args.join and args.node_rank >= settings.nodes:
        workers = f"ranks 1 to {settings.nodes - 1}" if settings.nodes > 1 else "none (a one-node cluster)"
        sys.exit(
            f"--node-rank {args.node_rank} is not a worker of this cluster: ART_SKY_NODES is {settings.nodes}, so "
            f"its workers are {workers}. Set ART_SKY_NODES to the cluster's nodes (the head included), or give "
            "this node's own rank"
        )
    if settings.api_key is None:
        sys.exit("ART_SKY_API_KEY is not set: the server refuses to start without an API key")
    if args.detach and not args.run_dir:
        sys.exit("--detach needs --run-dir (where the detached server's pid, port and log go)")
    layout = None
    if args.run_dir:
        layout = ServerLayout(run_dir=str(args.run_dir.resolve()), art_path=str(args.art_path.resolve()))
        _take_run_dir(layout, args.detach)
    _serve(
        settings,
        list(dict.fromkeys(args.host or ["127.0.0.1"])),
        args.port,
        args.art_path,
        layout,
        args.exit_with,
        args.join,
        args.advertise,
        args.node_rank,
    )


def _take_run_dir(layout: ServerLayout, detach: bool) -> None:
    """Start the run files afresh (the last log kept as server.log.1), record this server's pid, log to server.log.
    Detached: fork; the parent records the child's pid and exits, the child leads a new session. Run files another
    server holds are left alone: this one exits, naming it."""
    run = Path(layout.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    _hold(layout)
    Path(layout.port_file).unlink(missing_ok=True)
    log = Path(layout.log_file)
    if log.exists():
        log.replace(log.with_name(log.name + ".1"))
    if detach:
        child = os.fork()
        if child:
            atomic_write(layout.pid_file, str(child))
            os._exit(0)
        os.setsid()
    else:
        atomic_write(layout.pid_file, str(os.getpid()))
        print(f"art-sky: the cluster server logs to {log}", flush=True)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    assert isinstance(sys.stdout, io.TextIOWrapper)  # the interpreter's own: nothing in the server replaces it
    sys.stdout.reconfigure(line_buffering=True)


def _hold(layout: ServerLayout) -> None:
    """Lock the run directory for this server's life (art_sky.ownership: the kernel lets go when the server ends,
    however it ends, kill -9 included). Held by another server: exit, naming it (its pid and port)."""
    try:
        hold(Path(layout.run_dir) / LOCK_FILE)
        return
    except BlockingIOError:
        held = True
    except Unlockable:  # a filesystem without locks (some NFS mounts): a live server's pid file says it is held
        held = _running_server(layout)
    if held:
        sys.exit(
            f"the run directory {layout.run_dir} belongs to a cluster server that is running "
            f"({_describe(layout)}): stop it first (`art-sky down`, or kill its pid), or start this one with "
            "another --run-dir"
        )


def _describe(layout: ServerLayout) -> str:
    """The running server of a run directory, as its run files name it: pid and port."""
    try:
        found = json.loads(Path(layout.port_file).read_text())
        return f"pid {found['pid']}, port {found['port']}"
    except (OSError, ValueError, KeyError, TypeError):
        pid = Path(layout.pid_file).read_text().strip() if Path(layout.pid_file).exists() else "unknown"
        return f"pid {pid}, not listening yet"


def _running_server(layout: ServerLayout) -> bool:
    try:
        pid = int(Path(layout.pid_file).read_text())
        return alive(pid) and b"art_sky.cluster" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return False


def _serve(
    settings: Settings,
    hosts: list[str],
    port: int,
    art_path: Path,
    layout: ServerLayout | None,
    exit_with: int | None = None,
    join: str | None = None,
    advertise: str | None = None,
    node_rank: int | None = None,
) -> None:
    import uvicorn

    assert settings.api_key is not None  # `main` refuses to start without one
    api_key = settings.api_key.get_secret_value()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    add_secrets([api_key])  # and the store's secrets, once it opens (art_sky.store)
    redact_logging()  # every logger's lines, uvicorn's included (log_config=None: they reach the root's handler)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request forwarded to vLLM is too many
    sockets = []  # bound before anything slow loads: a port in use is said in a second, not after the model
    for host in hosts:  # the same port on each address: the first one picks it when --port is 0
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sys.exit(f"cannot bind {host}:{port}: {exc}. Pick another --port or stop what uses it")
        port = sock.getsockname()[1]
        sockets.append(sock)
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))  # the cores it may run on (a pinned replica: its own)
    from art_sky.errors import ConfigError

    from .node.placement import place
    from .node.selection import vllm_serves
    from .server import create_app

    try:
        placement = place(settings, vllm_serves(settings))  # sets the trainer's GPUs before CUDA initializes here
        if join:
            from .replica import create_replica_app

            app = create_replica_app(art_path, api_key, settings, placement, join)
        else:
            app = create_app(art_path, api_key, settings, placement, layout.run_dir if layout else None)
    except ConfigError as exc:  # a setting or the installed stack: the message says what to change
        sys.exit(f"the cluster server cannot start: {exc}")
    bound = port
    # No access log: a line per completion costs the event loop what rollouts need (and no proxy headers: the
    # server is reached through a tunnel, never a proxy). A long keep-alive: clients (httpx: 5 s) drop idle
    # connections before the server does, so none reuses one the server is closing.
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="info",
            log_config=None,
            timeout_graceful_shutdown=5,
            access_log=False,
            proxy_headers=False,
            timeout_keep_alive=75,
        )
    )
    if layout is not None:
        atomic_write(layout.port_file, json.dumps({"port": bound, "pid": os.getpid()}))
    logging.getLogger("art_sky.cluster").info("listening on %s port %d", ", ".join(hosts), bound)
    if exit_with is not None:
        threading.Thread(target=_exit_with, args=(exit_with, server), daemon=True).start()
    if not join:
        server.run(sockets=sockets)
        return
    from art_sky.wire import JoinRequest

    from .replica import JoinError, Membership

    host = hosts[-1]
    where = advertise or (host if host not in ("0.0.0.0", "::") else socket.gethostbyname(socket.gethostname()))
    url = f"http://{f'[{where}]' if ':' in where else where}:{bound}"
    membership = Membership(
        join,
        api_key,
        JoinRequest(url=url, node=socket.gethostname(), engine=app.state.engine, rank=node_rank, pid=os.getpid()),
    )
    refused: list[str] = []

    def join_when_listening() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        try:
            membership.join_once_up(settings.server_start_timeout)
        except JoinError as exc:
            refused.append(str(exc))
            server.should_exit = True
            return
        membership.stay()

    threading.Thread(target=join_when_listening, daemon=True, name="fleet-membership").start()
    try:
        server.run(sockets=sockets)
    finally:
        membership.close()
    if refused:
        sys.exit(f"this replica could not join the fleet: {refused[0]}")


def _exit_with(pid: int, server) -> None:
    """Stop the server (gracefully: its engine's children too) once process `pid` has ended, however it ended
    (a crash, kill -9); a server that has not stopped a minute later exits anyway."""
    while alive(pid):
        time.sleep(1.0)
    logging.getLogger("art_sky.cluster").warning("process %d, which started this server, has ended: stopping", pid)
    server.should_exit = True
    time.sleep(60.0)
    os._exit(1)


if __name__ == "__main__":
    main()
