"""The inference fleet: the engine the server's /v1 sees, routing completions over replicas (the head's own engine
and a replica server on each worker node that joined, `python -m art_sky.cluster --join HEAD`).

A completion goes to the replica with the fewest outstanding requests, except that one whose leading messages
(a conversation's first turns) hash to a replica goes there while that replica is not much busier than the least
busy (rendezvous hashing: a replica leaving moves only its own conversations), so its prefix cache is reused.

A replica serves a model's step by exact name (`name@step`); the fleet alone maps a model's name to its step. After a
step (the device gate held alone: no completion in flight anywhere), every replica that serves the model loads the
new step before the name moves on; a replica that joined or fell behind is brought up to date in the background and
gets the model's completions only once it serves its step. An older step named by a client (`name@step`) is sampled
by the head's engine, which has every checkpoint.

A replica that fails (connection refused or lost, a 5xx, three missed health checks in a row) leaves the fleet: a
completion it had not started streaming is retried on another replica (the head's engine at last), one it had
ends with an error event that says so.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import aiohttp
from fastapi import APIRouter, FastAPI, HTTPException
from fastapi.responses import FileResponse

from art_sky.redact import redact
from art_sky.wire import FleetReplica, JoinReply, JoinRequest, RegisterRequest, ReplicaModel, TrainerRendezvous

from ..model_state import ModelState
from .openai_api import SSE, OpenAIError, Served, sse

if TYPE_CHECKING:
    from .engine import Engine
    from .gate import Hold

log = logging.getLogger("art_sky.cluster")

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what a replica needs of a step
AFFINITY_SLACK = 2  # outstanding requests a conversation's replica may have over the least busy one
HEALTH_EVERY = 2.0  # seconds between the head's health checks of each replica
HEALTH_TIMEOUT = 5.0
MISSES = 3  # health checks in a row a replica may miss before it leaves
LOAD_TIMEOUT = 900.0  # a replica loading a model or a step (its base model may download first)
LOST_WITHIN = 60.0  # seconds a replica that left is named as a lost node (its trainer ranks went with it)
T = TypeVar("T")


class ReplicaError(Exception):
    """A replica failed a request: it leaves the fleet (the request is retried elsewhere unless it had started)."""


@dataclass(eq=False)
class Replica:
    url: str  # "local": the head's own engine
    node: str
    session: aiohttp.ClientSession | None = None  # aiohttp, as the vLLM proxy: a node's few cores go to sampling
    rank: int | None = None  # the worker node's rank: one replica per rank
    pid: int | None = None
    steps: dict[str, int] = field(default_factory=dict)  # model name -> the step it serves
    outstanding: int = 0
    completions: int = 0
    misses: int = 0
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    syncing: asyncio.Task | None = None

    @property
    def http(self) -> aiohttp.ClientSession:
        """A joined replica's session (the head's own engine, `local`, is called directly and has none)."""
        assert self.session is not None, f"the replica {self.url} has no session: it is the head's own engine"
        return self.session

    def describe(self) -> FleetReplica:
        return FleetReplica(
            url=self.url,
            node=self.node,
            rank=self.rank,
            pid=self.pid,
            outstanding=self.outstanding,
            completions=self.completions,
            steps=dict(self.steps),
        )


class Fleet:
    """An Engine over the head's engine and the joined replicas."""

    def __init__(self, local: Engine, api_key: str, nodes: int = 1):
        self.local = local
        self.nodes = nodes  # ART_SKY_NODES: more than one, and a worker's rank must be one of the cluster's
        self.headers = {"authorization": f"Bearer {api_key}"}
        self.head = Replica("local", socket.gethostname())
        self.replicas: list[Replica] = [self.head]
        self._models: dict[str, ModelState] = {}
        self._lock = threading.Lock()  # a replica's step set vs. a step's list of replicas to load it on
        self._loop: asyncio.AbstractEventLoop | None = None
        self._monitor: asyncio.Task | None = None
        self._departures: list[tuple[float, Replica, str]] = []  # (when, who, why) replicas left, the latest

    # -- the Engine protocol: the head's engine's, and every replica kept in step ----------------------------

    @property
    def name(self) -> str:
        return self.local.name

    @property
    def engine_port(self) -> int | None:
        return self.local.engine_port

    @property
    def honoured(self) -> frozenset[str]:
        return self.local.honoured

    @property
    def serves_while_training(self) -> bool:
        return self.local.serves_while_training

    def check(self, request: RegisterRequest) -> None:
        self.local.check(request)

    def attach(self, state: ModelState) -> None:
        """(Worker thread, the gate held alone.) The head serves the model; each replica loads it in the background
        and gets its completions once it serves its step."""
        self.local.attach(state)
        self._models[state.name] = state
        self.head.steps[state.name] = state.step
        for replica in self.remotes:
            self._replicas_loop.call_soon_threadsafe(self._sync, replica)

    def pause(self) -> None:
        self.local.pause()

    def resume(self, state: ModelState, trained: bool) -> None:
        """(Worker thread, the gate held alone: no completion in flight on any replica.) Every replica that serves
        the model loads the new step, then the head's engine swaps it in; a replica that fails leaves."""
        if trained:
            with self._lock:
                serving = [r for r in self.remotes if state.name in r.steps]
            if serving:
                asyncio.run_coroutine_threadsafe(self._serve_everywhere(serving, state), self._replicas_loop).result()
            for replica in self.remotes:  # those still loading an older step catch up
                self._replicas_loop.call_soon_threadsafe(self._sync, replica)
        self.local.resume(state, trained)
        self.head.steps[state.name] = state.step

    def close(self) -> None:
        self.local.close()

    async def aclose(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        for replica in self.remotes:
            await replica.http.close()
        await self.local.aclose()

    async def chat(self, served: Served, body: dict, hold: Hold) -> bytes | SSE:
        """The completion from the replica `_pick` chooses; a replica that fails before the client got a byte
        leaves, and the next one serves it."""
        tried: list[Replica] = []
        while True:
            replica = self._pick(served, body, tried)
            replica.outstanding += 1
            try:
                if replica is self.head:
                    result = await self.local.chat(served, body, hold)
                else:
                    result = await self._forward(replica, served, body, hold)
            except ReplicaError as exc:
                replica.outstanding -= 1
                self._leave(replica, str(exc))
                tried.append(replica)
                log.warning("retrying a completion of %s on another replica", served.name)
                continue
            except BaseException:
                replica.outstanding -= 1
                raise
            return _counted(replica, result)

    # -- routing -----------------------------------------------------------------------------------------------

    @property
    def remotes(self) -> list[Replica]:
        return [r for r in self.replicas if r is not self.head]

    @property
    def _replicas_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the replicas' sessions live on: a join sets it before its replica is in the fleet."""
        assert self._loop is not None, "no replica has joined the fleet"
        return self._loop

    def _pick(self, served: Served, body: dict, tried: list[Replica]) -> Replica:
        if served.step != served.state.step:
            return self.head  # an older step: only the head has every checkpoint
        ready = [r for r in self.replicas if r not in tried and r.steps.get(served.state.name) == served.step]
        if len(ready) <= 1:
            return ready[0] if ready else self.head
        key = json.dumps([served.state.name, body.get("messages", [])[:2]], sort_keys=True).encode()
        preferred = max(ready, key=lambda r: hashlib.blake2b(key + r.url.encode(), digest_size=8).digest())
        least = min(ready, key=lambda r: r.outstanding)
        return preferred if preferred.outstanding <= least.outstanding + AFFINITY_SLACK else least

    async def _forward(self, replica: Replica, served: Served, body: dict, hold: Hold) -> bytes | SSE:
        """The completion from a replica server's /v1, under the served step's exact name. Its 4xx answers are the
        request's (passed on); anything else is the replica's failure (ReplicaError)."""
        response = await _until_gone(
            replica,
            replica.http.post(
                "/v1/chat/completions",
                data=json.dumps(body | {"model": served.name}).encode(),
                headers={"content-type": "application/json"},
            ),
        )
        try:
            if response.status != 200:
                _raise_for(replica, response.status, await _until_gone(replica, response.read()))
            if not body.get("stream"):
                content = await _until_gone(replica, response.read())
                hold.release()
                response.release()
                return content
            chunks = response.content.iter_any()
            first = await _until_gone(replica, anext(chunks))
        except BaseException:
            response.close()
            raise

        async def close() -> None:
            hold.release()
            response.close()  # a stream the client left: the replica's engine drops it

        return SSE(self._relay(replica, first, chunks), close)

    async def _relay(self, replica: Replica, first: bytes, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        yield first
        while True:
            try:
                chunk = await _until_gone(replica, anext(chunks))
            except StopAsyncIteration:
                return
            except ReplicaError as exc:
                self._leave(replica, str(exc))
                yield sse(
                    {
                        "error": {
                            "message": f"the replica serving this completion ({replica.url} on "
                            f"{replica.node}) failed after it had started streaming: {exc}. "
                            "Retry the request; another replica serves it",
                            "type": "server_error",
                            "param": None,
                            "code": 502,
                        }
                    }
                )
                return
            yield chunk

    # -- membership --------------------------------------------------------------------------------------------

    async def join(self, request: JoinRequest) -> None:
        """Take a replica server into the fleet: it must answer /health with this head's key and run this head's
        engine. It gets completions once it serves each model's step (loaded in the background)."""
        if self.nodes > 1 and not 1 <= request.rank < self.nodes:
            raise HTTPException(
                409,
                f"node rank {request.rank} of the replica on {request.node} is not a worker of this cluster: it has "
                f"{self.nodes} nodes (ART_SKY_NODES), so the workers are ranks 1 to {self.nodes - 1}. Start it with "
                "--node-rank within them (SkyPilot's SKYPILOT_NODE_RANK)",
            )
        if request.engine != self.local.name:
            raise HTTPException(
                409,
                f"the replica on {request.node} runs the {request.engine} engine and this head "
                f"runs {self.local.name}: start every node with the same ART_SKY_ENGINE",
            )
        session = aiohttp.ClientSession(
            base_url=request.url,
            headers=self.headers,
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0),
        )
        try:
            async with session.get("/health", timeout=aiohttp.ClientTimeout(total=10.0)) as health:
                accepted = health.status == 200 and (await health.json()).get("engine") is not None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            await session.close()
            raise HTTPException(
                502,
                f"the head cannot reach the replica at {request.url} ({_said(exc)}): start the "
                "replica with --host on an address of the cluster's private network that "
                "the head reaches, and open its port between the nodes",
            ) from exc
        if not accepted:
            await session.close()
            raise HTTPException(
                502,
                f"the replica at {request.url} did not accept this head's API key: start it "
                "with the head's ART_SKY_API_KEY",
            )
        self._loop = asyncio.get_running_loop()
        try:
            await self._one_per_rank(request)
        except HTTPException:
            await session.close()
            raise
        for old in [r for r in self.remotes if r.url == request.url]:
            self._leave(old, "it joined again")
        replica = Replica(request.url, request.node, session, request.rank, request.pid)
        self.replicas.append(replica)
        log.info("replica %s on %s joined the fleet (%d replicas)", replica.url, replica.node, len(self.replicas))
        if self._monitor is None:
            self._monitor = asyncio.create_task(self._watch())
        self._sync(replica)

    async def _one_per_rank(self, request: JoinRequest) -> None:
        """A node has one replica: one of the same rank elsewhere that still answers refuses the join (409, naming
        it); one that does not answer is gone, and the newcomer replaces it."""
        for other in [r for r in self.remotes if r.rank == request.rank and r.url != request.url]:
            try:
                async with other.http.get("/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT)) as r:
                    alive = r.status == 200
            except (aiohttp.ClientError, TimeoutError):
                alive = False
            if not alive:
                self._leave(other, f"node rank {request.rank} joined again at {request.url}")
                continue
            raise HTTPException(
                409,
                f"node rank {request.rank} is in the fleet already: the replica at {other.url} "
                f"on {other.node} (pid {other.pid}) serves it. One replica per node: stop that "
                f"one first, or start this one with its own --node-rank",
            )

    def describe(self) -> list[FleetReplica]:
        return [r.describe() for r in self.replicas]

    def lost(self) -> str:
        """(A worker thread.) The worker nodes that are gone, in words: their replicas left the fleet in the last
        LOST_WITHIN s, or do not answer now. Where a trainer rank was lost, this says with which node."""
        now = time.monotonic()
        gone = [
            f"{_named(r)} left the fleet {now - at:.1f} s earlier ({why})"
            for at, r, why in self._departures
            if now - at < LOST_WITHIN
        ]
        if self._loop is not None and self.remotes:
            silent = asyncio.run_coroutine_threadsafe(self._silent(), self._loop).result(HEALTH_TIMEOUT + 5)
            gone += [f"{_named(r)} does not answer" for r in silent]
        return "; ".join(gone)

    async def _silent(self) -> list[Replica]:
        async def silent(replica: Replica) -> bool:
            try:
                async with replica.http.get("/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT)) as r:
                    return r.status != 200
            except (aiohttp.ClientError, TimeoutError):
                return True

        replicas = self.remotes
        return [
            r for r, quiet in zip(replicas, await asyncio.gather(*(silent(r) for r in replicas)), strict=False) if quiet
        ]

    def _leave(self, replica: Replica, reason: str) -> None:
        """(Event loop.) The replica leaves: its requests in flight end at once (retried where they can be)."""
        if replica not in self.replicas:
            return
        self._departures = [*self._departures[-20:], (time.monotonic(), replica, reason)]
        self.replicas.remove(replica)
        replica.gone.set()
        log.warning("replica %s on %s left the fleet: %s", replica.url, replica.node, reason)
        asyncio.get_running_loop().create_task(replica.http.close())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_EVERY)
            await asyncio.gather(*(self._check(r) for r in self.remotes))

    async def _check(self, replica: Replica) -> None:
        try:
            async with replica.http.get("/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT)) as r:
                r.raise_for_status()
        except aiohttp.ClientConnectorError as exc:  # nothing listens there any more
            self._leave(replica, f"it refuses connections ({_said(exc)})")
        except (aiohttp.ClientError, TimeoutError) as exc:
            replica.misses += 1
            if replica.misses >= MISSES:
                self._leave(replica, f"it did not answer /health {MISSES} times in a row ({_said(exc)})")
        else:
            replica.misses = 0

    def _sync(self, replica: Replica) -> None:
        """(Event loop.) Bring the replica up to every model's served step, in the background."""
        if replica in self.replicas and (replica.syncing is None or replica.syncing.done()):
            replica.syncing = asyncio.get_running_loop().create_task(self._catch_up(replica))

    async def _catch_up(self, replica: Replica) -> None:
        while replica in self.replicas:
            behind = [s for s in list(self._models.values()) if replica.steps.get(s.name) != s.step]
            if not behind:
                return
            state = behind[0]
            step = state.step
            try:
                await self._serve(replica, state, step)
            except ReplicaError as exc:
                self._leave(replica, str(exc))
                return
            with self._lock:  # a step published meanwhile: the loop loads it next
                if state.step == step:
                    replica.steps[state.name] = step
                    log.info("replica %s serves %s@%d", replica.url, state.name, step)

    async def _serve_everywhere(self, replicas: list[Replica], state: ModelState) -> None:
        async def one(replica: Replica) -> None:
            try:
                await self._serve(replica, state, state.step)
            except ReplicaError as exc:
                self._leave(replica, str(exc))
            else:
                replica.steps[state.name] = state.step

        await asyncio.gather(*(one(r) for r in replicas))

    async def _serve(self, replica: Replica, state: ModelState, step: int) -> None:
        """The replica loads the model at `step` (fetching its adapter from this head); ReplicaError if it cannot."""
        body = ReplicaModel(request=state.request, step=step).model_dump(mode="json")

        async def load() -> tuple[int, bytes]:
            async with replica.http.post(
                "/fleet/models", json=body, timeout=aiohttp.ClientTimeout(total=LOAD_TIMEOUT)
            ) as response:
                return response.status, await response.read()

        status, content = await _until_gone(replica, load())
        if status != 200:
            raise ReplicaError(f"it could not load {state.name}@{step}: {_detail(content)}")


def install(
    app: FastAPI, fleet: Fleet, dependencies: list, states: dict[str, ModelState], rendezvous: TrainerRendezvous | None
) -> None:
    """The head's fleet routes: a replica joins, and fetches a step's adapter files."""
    router = APIRouter(dependencies=dependencies)

    @router.post("/fleet/join")
    async def join(body: JoinRequest) -> JoinReply:
        """A worker node's replica joins the fleet; the reply says where its trainer ranks meet the head's."""
        await fleet.join(body)
        return JoinReply(trainer=rendezvous)

    @router.get("/fleet/models/{name}/steps/{step}/{file}")
    async def adapter_file(name: str, step: int, file: str) -> FileResponse:
        if file not in ADAPTER_FILES:
            raise HTTPException(404, f"{file!r} is not served to replicas: ask for one of {', '.join(ADAPTER_FILES)}")
        state = states.get(name)
        path = (await asyncio.to_thread(state.adapter_dir, step)) / file if state is not None else None
        if path is None or not path.is_file():
            raise HTTPException(
                404, f"no {file} for {name}@{step} on the head: the step is not registered or was deleted"
            )
        return FileResponse(path)

    app.include_router(router)


def _named(replica: Replica) -> str:
    rank = f"node rank {replica.rank}" if replica.rank is not None else "the worker node"
    return f"{rank} ({replica.node}, its replica {replica.url})"


def _counted(replica: Replica, result: bytes | SSE) -> bytes | SSE:
    """The replica's load drops once the completion is done (a stream: closed)."""
    if not isinstance(result, SSE):
        replica.outstanding -= 1
        replica.completions += 1
        return result
    done = False

    async def close() -> None:
        nonlocal done
        if not done:
            done = True
            replica.outstanding -= 1
            replica.completions += 1
        await result.close()

    return SSE(result.chunks, close)


async def _until_gone(replica: Replica, awaitable: Awaitable[T]) -> T:
    """`awaitable`'s result, or ReplicaError when it fails at the transport or the replica leaves meanwhile (the
    health checks found it gone: a replica that stops answering holds no request for long)."""
    task = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(replica.gone.wait())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the request itself was cancelled (its client went away)
        task.cancel()
        raise
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        raise ReplicaError(f"replica {replica.url} on {replica.node} left the fleet")
    try:
        return task.result()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ReplicaError(f"replica {replica.url} on {replica.node} failed: {_said(exc)}") from exc


def _said(exc: BaseException) -> str:
    """A transport failure in words (aiohttp's own text names sockets and SSL contexts), redacted."""
    return redact(_in_words(exc))


def _in_words(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError):  # refused, no route, a name that does not resolve
        error = exc.os_error
        return os.strerror(error.errno) if error.errno and error.errno > 0 else error.strerror or str(error)
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "it closed the connection"
    if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
        return "no answer in time"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "its answer was cut off"
    return f"{type(exc).__name__}: {exc}"


def _raise_for(replica: Replica, status: int, content: bytes) -> None:
    """A replica's error answer: the request's own (4xx, passed on as OpenAI's error) or the replica's failure."""
    if status >= 500 or status == 404:  # 404: it lost the model (restarted): out of step with the fleet
        raise ReplicaError(f"replica {replica.url} answered {status}: {_detail(content)}")
    try:
        error = json.loads(content)["error"]
        raise OpenAIError(status, error["message"], param=error.get("param"), type=error.get("type") or "")
    except (ValueError, KeyError, TypeError):
        raise OpenAIError(status, _detail(content)) from None


def _detail(content: bytes) -> str:
    try:
        return str(json.loads(content)["detail"])
    except (ValueError, KeyError, TypeError):
        return content[:300].decode(errors="replace")
