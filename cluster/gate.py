"""`DeviceGate`: inference shares the device, training (and registering, deleting checkpoints) takes it alone.

ART's semantics: a completion that arrives while a model trains waits and is then served by the new step; none
fails. Many completions run at once (vLLM batches them continuously); a step waits for those in flight to finish,
and once a step is waiting no new completion starts, so a steady stream of rollouts never starves training.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class DeviceGate:
    def __init__(self) -> None:
        self._inflight = 0
        self._idle = asyncio.Event()  # no completion in flight
        self._idle.set()
        self._open = asyncio.Event()  # no step running or waiting
        self._open.set()
        self._exclusive = asyncio.Lock()

    @property
    def inflight(self) -> int:
        return self._inflight

    def enter(self) -> None:
        """Take a shared hold now (the gate must be open: `await opened()` first). Pair with `leave()`."""
        self._inflight += 1
        self._idle.clear()

    def leave(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    async def opened(self) -> None:
        """Wait until no step runs or waits (returns at once on the fast path)."""
        while not self._open.is_set():
            await self._open.wait()

    @asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        await self.opened()
        self.enter()
        try:
            yield
        finally:
            self.leave()

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._exclusive:
            self._open.clear()
            try:
                await self._idle.wait()
                yield
            finally:
                self._open.set()
