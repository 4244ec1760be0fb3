"""A fleet on this machine: a head server and replica servers joined to it (`--join`), each its own process on its
own port and with its own checkpoint root, as nodes on a private network; started and awaited through the one
lifecycle (art_sky.remote.lifecycle). A node can be pinned to one core (taskset: every thread of it)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from art_sky.layout import ServerLayout
from art_sky.remote import lifecycle
from art_sky.remote.runner import LocalRunner

API_KEY = "fleet-key-0123456789"


@dataclass
class Node:
    layout: ServerLayout
    server: lifecycle.RemoteServer

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    def client(self, key: str = API_KEY, timeout: float = 120) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {key}"}, timeout=timeout)

    def kill(self) -> None:
        """SIGKILL, as a node lost: nothing of it says goodbye."""
        os.kill(self.server.pid, signal.SIGKILL)

    def stop(self) -> None:
        lifecycle.stop(LocalRunner(), self.layout, grace=5)


def start_node(
    root: Path,
    name: str,
    *,
    join: str | None = None,
    core: int | None = None,
    env: dict[str, str] | None = None,
    key: str = API_KEY,
    port: int | None = None,
    rank: int | None = None,
) -> Node:
    """A head (or, with `join`, a replica of the head at that URL, of node rank `rank`: 1 unless given, in a cluster
    of rank + 1 nodes unless `env` says) under `root/name` (on `port`), ready to answer /health."""
    layout = ServerLayout(run_dir=str(root / name / "run"), art_path=str(root / name / "art"))
    python = sys.executable
    if core is not None:
        python = str(root / f"python-on-core-{core}")
        Path(python).write_text(f'#!/bin/sh\nexec taskset -c {core} {sys.executable} "$@"\n')
        os.chmod(python, 0o755)
    runner = LocalRunner()
    rank = rank or 1 if join else None  # a worker always has its rank, within the cluster's nodes
    env = ({"ART_SKY_NODES": str(rank + 1)} if rank else {}) | (env or {})
    lifecycle.start(
        runner,
        layout,
        python=python,
        env={"ART_SKY_API_KEY": key} | env,
        exit_with=os.getpid(),
        args=(("--join", join) if join else ())
        + (("--port", str(port)) if port else ())
        + (("--node-rank", str(rank)) if rank else ()),
    )
    server = lifecycle.wait_ready(
        runner, layout, timeout=180, reach=lambda port: f"http://127.0.0.1:{port}", stop_on_timeout=True
    )
    return Node(layout, server)


def fleet(head: Node) -> list[dict]:
    """The head's fleet as /health shows it."""
    with head.client(timeout=30) as client:
        return client.get("/health").json()["fleet"]


def wait_fleet(head: Node, predicate, what: str, timeout: float = 180) -> list[dict]:
    """The head's fleet once `predicate(fleet)` holds (AssertionError naming `what` and the fleet otherwise)."""
    deadline = time.monotonic() + timeout
    while True:
        replicas = fleet(head)
        if predicate(replicas):
            return replicas
        if time.monotonic() > deadline:
            raise AssertionError(f"the fleet did not reach: {what} within {timeout}s; it is {replicas}")
        time.sleep(0.2)


async def complete(http: httpx.AsyncClient, text: str, **extra) -> httpx.Response:
    """One chat completion of model "tiny" through a node's /v1."""
    return await http.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 8} | extra,
    )


async def load_until_replica_busy(
    head: Node, start: Callable[[int], Awaitable[httpx.Response]], timeout: float = 120
) -> list[asyncio.Future[httpx.Response]]:
    """Completions `start(0)`, `start(1)`, ... sent 8 more at a time until the head's fleet shows its second replica
    with some in flight; all of them, still going. A fixed batch could all end before a poll of /health saw any
    there (a fast engine, a /health slow to answer under load), and what a test then does to the replica would
    find it idle."""
    sent: list[asyncio.Future[httpx.Response]] = []
    deadline = time.monotonic() + timeout
    while True:
        sent += [asyncio.ensure_future(start(len(sent) + i)) for i in range(8)]
        replicas = await asyncio.to_thread(fleet, head)
        if len(replicas) == 2 and replicas[1]["outstanding"] > 0:
            return sent
        assert time.monotonic() < deadline, f"the replica never had completions in flight within {timeout}s: {replicas}"
