"""The OpenAI-compatible surface of the cluster server: /v1/chat/completions (streaming too), /v1/models and
/v1/models/{id}. Every engine serves through it, so the laptop needs one port and one tunnel.

A model's name serves its newest step; `name@step` serves an older step while its checkpoint exists. A response's
`model` names the step that served it. Parameters an engine would not honour are refused with a 400 naming them
(cluster/chat_parameters.py). Errors come in OpenAI's format (and, like the rest of the server, with `detail`),
so the openai SDK, litellm and LangChain raise their usual exceptions.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import ValidationError

from .chat_parameters import honoured_only, refused
from .gate import DeviceGate
from .model_state import ModelState

if TYPE_CHECKING:
    from .selection import Engine


class OpenAIError(Exception):
    """A refused request, answered as OpenAI answers: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type

    def body(self) -> dict:
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.status}

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.body(), "detail": self.message}, status_code=self.status)


def invalid_request(exc: ValidationError) -> OpenAIError:
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())
    first = exc.errors()[0]["loc"] if exc.errors() else ()
    return OpenAIError(400, f"invalid request: {problems}", param=str(first[0]) if first else None)


@dataclass
class Served:
    """The model and step a request is served by."""

    state: ModelState
    step: int

    @property
    def name(self) -> str:
        """The adapter's name: the step it serves, `name@step`."""
        return f"{self.state.name}@{self.step}"


@dataclass
class SSE:
    """A stream of server-sent events an engine opened; `close` ends it early (the client went away)."""

    chunks: AsyncIterator[bytes]
    close: Callable[[], Awaitable[None]]


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class _GuardedStream(StreamingResponse):
    """A streaming response whose engine side is closed however it ends: finished, failed, or the client gone."""

    def __init__(self, stream: SSE):
        super().__init__(stream.chunks, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self._close = stream.close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()


def resolve(states: dict[str, ModelState], model_id: Any) -> Served:
    """`name` (its newest step) or `name@step` (a step whose checkpoint exists) of a registered model."""
    if not isinstance(model_id, str) or not model_id:
        raise OpenAIError(400, "the request has no `model`: name a registered model, or `name@step`", param="model")
    name, at, step = model_id.partition("@")
    state = states.get(name)
    if state is None:
        raise OpenAIError(404, f"model {model_id!r} is not registered on this server (registered: "
                               f"{sorted(states) or 'none'}): call `await model.register(backend)` first",
                          param="model", type="not_found_error")
    if not at:
        return Served(state, state.step)
    steps = state.checkpoints.steps()
    if not step.isdigit() or int(step) not in steps:
        raise OpenAIError(404, f"model {model_id!r}: {name!r} has no checkpoint for step {step!r} (steps on this "
                               f"server: {', '.join(map(str, steps)) or 'none'}); name one of them, or {name!r} for "
                               "the newest", param="model", type="not_found_error")
    return Served(state, int(step))


def _model_card(state: ModelState, step: int | None) -> dict:
    created = state.checkpoints.manifest(step if step is not None else state.step).created_at
    card = {"id": state.name if step is None else f"{state.name}@{step}", "object": "model",
            "created": int(created), "owned_by": "art-sky", "root": state.request.base_model}
    return card | ({"parent": state.name, "step": step} if step is not None else {"step": state.step})


def install(app: FastAPI, engine: Engine, states: dict[str, ModelState], gate: DeviceGate,
            dependencies: list) -> None:
    """Add the /v1 routes to the server's app."""
    router = APIRouter(dependencies=dependencies)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @router.get("/v1/models")
    async def list_models() -> dict:
        cards = []
        for name in sorted(states):
            state = states[name]
            cards += [_model_card(state, None)] + [_model_card(state, s) for s in state.checkpoints.steps()]
        return {"object": "list", "data": cards}

    @router.get("/v1/models/{model_id}")
    async def get_model(model_id: str) -> dict:
        served = resolve(states, model_id)
        return _model_card(served.state, None if "@" not in model_id else served.step)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            raise OpenAIError(400, f"the request body is not JSON ({exc}): send a chat completion request") from exc
        if not isinstance(body, dict):
            raise OpenAIError(400, "the request body must be a JSON object: send a chat completion request")
        problem = refused(body, engine.honoured, engine.name)
        if problem:
            raise OpenAIError(400, problem)
        hold = await gate.hold()  # the model's step is read after a running training step, never before
        try:
            result = await engine.chat(resolve(states, body.get("model")), honoured_only(body, engine.honoured), hold)
        except (ValueError, TemplateError) as exc:
            hold.release()
            raise OpenAIError(400, str(exc)) from exc
        except BaseException:
            hold.release()
            raise
        if isinstance(result, SSE):
            return _GuardedStream(result)
        return Response(result, media_type="application/json")

    app.include_router(router)
