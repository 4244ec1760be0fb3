"""`ServerClient`: the laptop's one HTTP client of a cluster server. It owns the connection, the retries of a
request across dropped connections, a training step's progress stream and the mapping of error answers to
art-sky's errors (by the answer's `code`, never its wording), as httpx's transports own theirs.

A `Backend` (art_sky/backends/base.py) decides what to ask and when (start the server, register a model again,
relaunch a lost cluster); everything that goes over the wire goes through one of these public methods.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from art_sky.errors import AuthError, BackendUnavailableError, NotFoundError, ServerError, TrainingStalledError
from art_sky.wire import (
    CheckpointInfo,
    DeleteCheckpointsRequest,
    HealthResponse,
    Lease,
    LeaseRequest,
    LogRequest,
    ModelInfo,
    RegisterRequest,
    SFTRequest,
    SyncStatus,
    TrainProgress,
    TrainRequest,
)

log = logging.getLogger("art_sky")
RETRIES = 5  # idempotent requests survive a dropped connection (a reconnecting tunnel) this many times
STREAM_IDLE = 60.0  # seconds without a line on a training stream before the connection counts as lost (the server
# sends one at least every 10 s)


def backoff(attempt: int, cap: float) -> float:
    """Seconds before retry `attempt` (0, 1, ...): doubling from half a second, at most `cap`."""
    return min(0.5 * 2**attempt, cap)


async def _never_recovered(cause: Exception) -> bool:
    return False


class StreamLost(Exception):
    """A training request's connection ended before its result (retried with the same request id)."""


class ServerClient:
    """HTTP to one cluster server at `base_url` with `api_key`. `recovered(cause)` is asked when a request that
    must not be lost ran out of retries: True once the server is back on a relaunched machine (the request is
    tried once more), False to give up, as a SkyPilot cluster's recovery answers (backends/recovery.py)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        timeout: float,
        recovered: Callable[[Exception], Awaitable[bool]] = _never_recovered,
    ):
        self.base_url, self.timeout, self.recovered = base_url, timeout, recovered
        self._http = httpx.AsyncClient(
            base_url=base_url,
            headers={"authorization": f"Bearer {api_key}"},
            timeout=httpx.Timeout(timeout, connect=30.0),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: object = None,
        idempotent: bool | None = None,
        retry_for: float | None = None,
    ) -> Any:
        """One JSON request; idempotent ones (GET by default) are retried across dropped connections: a few times,
        or for `retry_for` seconds (with backoff) where losing the call would lose work."""
        retries = RETRIES if (method == "GET" if idempotent is None else idempotent) or retry_for else 0
        deadline = time.monotonic() + (retry_for or 0)
        for attempt in itertools.count():
            try:
                response = await self._http.request(method, path, json=json)
                break
            except httpx.TransportError as exc:
                if attempt >= retries and time.monotonic() >= deadline:
                    if (retries or retry_for) and await self.recovered(exc):
                        deadline = time.monotonic() + (retry_for or 0)  # on the relaunched cluster, once more
                        continue
                    raise BackendUnavailableError(
                        f"cannot reach the cluster server at {self.base_url} ({exc!r}): is it running and the "
                        "tunnel up? `art-sky status` tells"
                    ) from exc
                await asyncio.sleep(backoff(attempt, 10.0 if retry_for else 8.0))
        if response.status_code >= 400:
            raise_for(response)
        return response.json()

    async def answers(self, timeout: float) -> SyncStatus | bool:
        """One quick look, no retries: the server's sync status, True where it answers otherwise, False where it
        cannot be reached (what a cluster's watchdog asks)."""
        try:
            response = await self._http.get("/art/checkpoints/sync", timeout=timeout)
        except httpx.HTTPError:
            return False
        if response.status_code != 200:
            return True
        try:
            return SyncStatus.model_validate_json(response.content)
        except ValueError:
            return True

    # The server's routes, typed (wire.py holds every message).
    async def health(self) -> HealthResponse:
        return HealthResponse.model_validate(await self.request("GET", "/health"))

    async def register(self, request: RegisterRequest, retry_for: float) -> ModelInfo:
        return ModelInfo.model_validate(
            await self.request("POST", "/art/models", json=request.model_dump(), retry_for=retry_for)
        )

    async def model(self, name: str) -> ModelInfo:
        return ModelInfo.model_validate(await self.request("GET", f"/art/models/{name}"))

    async def log(self, name: str, request: LogRequest) -> None:
        await self.request("POST", f"/art/models/{name}/log", json=request.model_dump())

    async def history(self, name: str) -> list[dict]:
        return await self.request("GET", f"/art/models/{name}/history")

    async def checkpoints(self, name: str) -> list[CheckpointInfo]:
        return [CheckpointInfo.model_validate(c) for c in await self.request("GET", f"/art/models/{name}/checkpoints")]

    async def delete_checkpoints(self, name: str, request: DeleteCheckpointsRequest) -> list[CheckpointInfo]:
        answer = await self.request(
            "POST", f"/art/models/{name}/checkpoints/delete", json=request.model_dump(), idempotent=True
        )
        return [CheckpointInfo.model_validate(c) for c in answer]

    async def flush(self) -> SyncStatus:
        return SyncStatus.model_validate(await self.request("POST", "/art/checkpoints/flush", idempotent=True))

    async def lease(self, name: str, step: int) -> Lease:
        return Lease.model_validate(
            await self.request("POST", f"/art/models/{name}/leases", json=LeaseRequest(step=step).model_dump())
        )

    async def release(self, name: str, lease: Lease) -> None:
        await self.request("DELETE", f"/art/models/{name}/leases/{lease.id}", idempotent=True)

    async def follow_step(
        self,
        name: str,
        route: str,
        request: TrainRequest | SFTRequest,
        stall: StallWatch,
        on_progress: Callable[[TrainProgress], None],
    ) -> TrainProgress:
        """One attempt of a training step: the request, then its progress stream (each line to `on_progress`) to
        the result. StreamLost when the connection ends first; TrainingStalledError when `stall` runs out."""
        try:
            async with self._http.stream(
                "POST",
                f"/art/models/{name}/{route}",
                content=request.model_dump_json(),
                headers={"content-type": "application/json"},
                timeout=httpx.Timeout(self.timeout, connect=30.0, read=STREAM_IDLE),
            ) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise_for(response)
                lines = response.aiter_lines()
                while True:
                    try:
                        line = await asyncio.wait_for(anext(lines), stall.remaining())
                    except StopAsyncIteration:
                        break
                    except TimeoutError:
                        raise stall.error() from None
                    if not line.strip():
                        continue
                    event = TrainProgress.model_validate_json(line)
                    if event.type == "progress":
                        on_progress(event)
                        stall.saw(event)
                    elif event.type == "error":
                        raise ServerError(event.status or 500, event.message or "training failed", event.code)
                    else:
                        return event
        except httpx.TransportError as exc:
            raise StreamLost() from exc
        raise StreamLost("the training stream ended without a result")


def raise_for(response: httpx.Response) -> None:
    """The error an answer of 400 or more is: its `detail` as the message, its `code` kept for branching."""
    try:
        body = response.json()
        detail, code = body.get("detail", response.text), body.get("code")
    except (ValueError, AttributeError):
        detail, code = response.text, None
    kind = {401: AuthError, 404: NotFoundError}.get(response.status_code, ServerError)
    raise kind(response.status_code, str(detail), code)


class StallWatch:
    """Follows a step's progress lines: what the server is doing, and since when nothing changed (no micro-batch
    done, no new phase). A warning a third of the way to `timeout`; at it, `error()` says what the server was doing."""

    def __init__(self, name: str, timeout: float):
        self.name, self.timeout = name, timeout
        self.last: TrainProgress | None = None
        self.changed = time.monotonic()
        self.warned = False

    def saw(self, event: TrainProgress) -> None:
        activity = event.activity
        if self.last is None or (event.done, event.total, activity) != (
            self.last.done,
            self.last.total,
            self.last.activity,
        ):
            self.last, self.changed, self.warned = event, time.monotonic(), False
        elif self.quiet() >= self.timeout / 3 and not self.warned:
            self.warned = True
            log.warning("training %s: no progress for %.0f s; the server is %s", self.name, self.quiet(), self.doing())
        if self.quiet() >= self.timeout:
            raise self.error()

    def quiet(self) -> float:
        return time.monotonic() - self.changed

    def remaining(self) -> float:
        return max(self.timeout - self.quiet(), 0.01)

    def doing(self) -> str:
        activity = self.last.activity if self.last is not None else None
        if activity is None:
            return "not saying what it does (no progress line came)"
        return f"{activity.phase} {activity.detail}".strip()

    def error(self) -> TrainingStalledError:
        return TrainingStalledError(
            f"training {self.name} made no progress for {self.quiet():.0f} s: the server is {self.doing()}. The step "
            "goes on there: `art-sky status` shows what it does, `art-sky logs` its log, and `await "
            "model.get_step()` tells when it committed. If steps are this slow, raise ART_SKY_TRAIN_STALL_TIMEOUT"
        )
