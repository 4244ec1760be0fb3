"""`python -m art_sky.cluster`: start the cluster server. The API key comes from ART_SKY_API_KEY (never argv)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from pathlib import Path

import uvicorn

from art_sky.settings import Settings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m art_sky.cluster", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: reach it by tunnel)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one")
    parser.add_argument("--art-path", type=Path, default=Path(".art"), help="root of the checkpoint tree")
    parser.add_argument("--port-file", type=Path, help="write {\"port\": N} here once listening")
    args = parser.parse_args(argv)
    settings = Settings()
    if settings.api_key is None:
        sys.exit("ART_SKY_API_KEY is not set: the server refuses to start without an API key")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request forwarded to vLLM is too many
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    from art_sky.errors import ConfigError

    from .server import create_app

    try:
        app = create_app(args.art_path, settings.api_key.get_secret_value(), settings)
    except ConfigError as exc:  # a setting or the installed stack: the message says what to change
        sys.exit(f"the cluster server cannot start: {exc}")
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        sys.exit(f"cannot bind {args.host}:{args.port}: {exc}. Pick another --port or stop what uses it")
    port = sock.getsockname()[1]
    # No access log: a line per completion costs the event loop what rollouts need (and no proxy headers: the
    # server is reached through a tunnel, never a proxy). A long keep-alive: clients (httpx: 5 s) drop idle
    # connections before the server does, so none reuses one the server is closing.
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5, access_log=False,
                                           proxy_headers=False, timeout_keep_alive=75))
    if args.port_file:
        _write_port_file(args.port_file, port)
    logging.getLogger("art_sky.cluster").info("listening on %s:%d", args.host, port)
    server.run(sockets=[sock])


def _write_port_file(path: Path, port: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"port": port, "pid": os.getpid()}))
    tmp.replace(path)


if __name__ == "__main__":
    main()
