"""`DeviceGate`: inference shares the device; an adapter swap (a whole training step on an engine that pauses for
it), registering and deleting checkpoints take it alone.

ART's semantics: a completion that arrives while the gate is held alone waits and is then served by the new step;
none fails. Many completions run at once (vLLM batches them continuously); a step waits for those in flight to finish,
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
    def in_flight(self) -> int:
        """Completions holding the device now."""
        return self._inflight

    async def hold(self) -> Hold:
        """A shared hold for one completion: waits while a step runs or waits. Release it when the completion's
        device work is done (its response read, its stream ended)."""
        while not self._open.is_set():
            await self._open.wait()
        self._inflight += 1
        self._idle.clear()
        return Hold(self)

    def _leave(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._exclusive:
            self._open.clear()
            try:
                await self._idle.wait()
                yield
            finally:
                self._open.set()


class Hold:
    """One completion's share of the device; `release()` is idempotent, so every way a request ends may call it."""

    def __init__(self, gate: DeviceGate):
        self._gate: DeviceGate | None = gate

    def release(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate._leave()
