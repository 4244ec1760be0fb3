"""What the server asks of an inference engine (the portable one, the vLLM proxy, the shared-GPU one): one small
protocol, as httpx's transports. cluster/inference/openai_api.py serves /v1 through `chat`; the server's training step
calls `pause` / `resume` around a step.

An engine raises art-sky errors: `OpenAIError` (cluster/inference/openai_api.py, an ArtSkyError) for a refused
completion, answered in OpenAI's format; ConfigError / EngineError from the hooks, which the server maps to status
codes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from art_sky.wire import RegisterRequest

from ..model_state import ModelState

if TYPE_CHECKING:
    from .gate import Hold
    from .openai_api import SSE, Served


class Engine(Protocol):
    # Read-only for the server: an engine may hold them as attributes or compute them (the fleet's are its head's).
    @property
    def name(self) -> str: ...

    @property
    def engine_port(self) -> int | None:
        """The engine's own OpenAI port on the server's machine (vLLM), for diagnostics."""

    @property
    def honoured(self) -> frozenset[str]:
        """The chat completion parameters it honours; others are refused by name."""

    @property
    def serves_while_training(self) -> bool:
        """True: it keeps serving the previous step's adapter while a step trains (its own copy of the adapter, or
        its own device), and the step closes the device gate only to swap the new one in; False: `pause` holds
        inference for the whole step (the device's memory is needed by the trainer). /health reports it."""

    def check(self, request: RegisterRequest) -> None:
        """Before a model is loaded: ConfigError when this engine cannot serve it."""

    def attach(self, state: ModelState) -> None:
        """Serve a newly registered model."""

    def pause(self) -> None:
        """Before a training step, when it does not serve while training: hold inference (and free device memory
        where the engine can)."""

    def resume(self, state: ModelState, trained: bool) -> None:
        """After a training step (no completion in flight): serve the new step (when `trained`), then release
        inference."""

    async def chat(self, served: Served, body: dict, hold: Hold) -> bytes | SSE:
        """One chat completion for the served model and step: the response's JSON, or its server-sent events.
        `hold` is the request's share of the device gate; the engine releases it once sampling is done."""

    async def aclose(self) -> None:
        """Close what the engine opened on the server's event loop (connection pools)."""

    def close(self) -> None:
        """Stop what the engine started (a child server)."""
