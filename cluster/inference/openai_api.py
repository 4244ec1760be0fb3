"""The OpenAI-compatible surface of the cluster server: /v1/chat/completions (streaming too), /v1/models and
/v1/models/{id}; any other /v1 route is a 404 that says so. Every engine serves through it, so the laptop needs one
port and one tunnel.

A model's name serves its newest step; `name@step` serves an older step while its checkpoint exists. A response's
`model` names the step that served it. Parameters an engine would not honour are refused with a 400 naming them
(cluster/inference/chat_parameters.py). Errors come in OpenAI's format (and, like the rest of the server, with
`detail`), so the openai SDK, litellm and LangChain raise their usual exceptions.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from pydantic import TypeAdapter, ValidationError

from art_sky.errors import ArtSkyError, ConflictError, problems
from art_sky.wire import ChatMessage

from .. import runs
from ..model_state import ModelState
from .chat_parameters import honoured_only, refused
from .gate import DeviceGate

if TYPE_CHECKING:
    from ..activity import ModelActivity
    from .engine import Engine


UNAUTHORIZED = (
    "missing or wrong API key: send the server's key as a bearer token (model.openai_client() and the "
    "backends do this for you)"
)


class OpenAIError(ArtSkyError):
    """A refused completion, answered as OpenAI answers: {"error": {"message", "type", "param", "code"}} (and
    `detail`, as the rest of the server). Engines raise it; the /v1 routes answer it."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type

    def body(self) -> dict:
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.status}

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.body(), "detail": self.message}, status_code=self.status)


_MESSAGES = TypeAdapter(list[ChatMessage])
STEP = re.compile(r"[0-9]+")  # the step of `name@step`
MAX_STEP_DIGITS = 18  # a step number fits an int64 (no model trains 10^18 steps)


def invalid_request(exc: ValidationError, *within: str) -> OpenAIError:
    """A 400 naming each wrong field (its path in the body, e.g. messages.2.role)."""
    first = (*within, *exc.errors()[0]["loc"]) if exc.errors() else ()
    said = problems(exc, *within, empty="body")
    return OpenAIError(400, f"invalid request: {said}", param=str(first[0]) if first else None)


def check_messages(messages: Any) -> None:
    """Every engine gets messages OpenAI's API would take: a non-empty list, each with a known role and content
    that is text, content parts or null (vLLM would render an invented role)."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "`messages` must be a non-empty list of chat messages", param="messages")
    try:
        _MESSAGES.validate_python(messages)
    except ValidationError as exc:
        raise invalid_request(exc, "messages") from exc


@dataclass
class Served:
    """The model and step a request is served by."""

    state: ModelState
    step: int

    @property
    def name(self) -> str:
        """The adapter's name: the step it serves, `name@step`."""
        return f"{self.state.name}@{self.step}"

    def label(self, completion: dict) -> dict:
        """A completion's choices labelled with the step that sampled them: `art_sky_step` (a rollout's policy
        version) and ART's `policy_token_spans` (0.5.20+'s exact provenance, which its PipelineTrainer's eval
        checks: one adapter samples a whole completion here, so one span covers each choice's tokens)."""
        for choice in completion.get("choices", []):
            choice["art_sky_step"] = self.step
            tokens = len(choice.get("token_ids") or [])
            if tokens:
                choice["policy_token_spans"] = [
                    {
                        "start_token": 0,
                        "end_token": tokens,
                        "generation_id": completion.get("id") or self.name,
                        "policy_version": self.step,
                        "lora_slot": self.name,
                        "update_seq": self.step,
                    }
                ]
        return completion


@dataclass
class SSE:
    """A stream of server-sent events an engine opened; `close` ends it early (the client went away)."""

    chunks: AsyncIterator[bytes]
    close: Callable[[], Awaitable[None]]


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def resolve(states: dict[str, ModelState], model_id: Any) -> Served:
    """`name` (its newest step) or `name@step` (a step whose checkpoint exists) of a registered model."""
    if not isinstance(model_id, str) or not model_id:
        raise OpenAIError(400, "the request has no `model`: name a registered model, or `name@step`", param="model")
    name, at, step = model_id.partition("@")
    try:
        state = runs.find(states, name)
    except ConflictError as exc:  # a bare name with several runs: which one is not guessed
        raise OpenAIError(409, str(exc), param="model") from None
    if state is None:
        raise OpenAIError(
            404,
            f"model {_shown(model_id)!r} is not registered on this server (registered: "
            f"{sorted(states) or 'none'}): call `await model.register(backend)` first",
            param="model",
            type="not_found_error",
        )
    if not at:
        return Served(state, state.step)
    if not STEP.fullmatch(step):  # ASCII digits only: `str.isdigit` takes "²", which `int` refuses
        raise OpenAIError(
            400,
            f"model {_shown(model_id)!r}: the step after '@' must be a step number (digits 0-9), as in "
            f"'{name}@3'; or name {name!r} for the newest step",
            param="model",
        )
    steps = state.checkpoints.steps()
    number = int(step) if len(step) <= MAX_STEP_DIGITS else None  # longer: no step has it (nor can int read it)
    if number is None or number not in steps and number != state.step:  # the newest: maybe still written
        raise OpenAIError(
            404,
            f"no step {_shown(step)} of model {name!r}: it has checkpoints for steps "
            f"{', '.join(map(str, steps)) or 'none'} on this server; name one of them, or {name!r} for the newest",
            param="model",
            type="not_found_error",
        )
    return Served(state, number)


def _shown(text: str, limit: int = 40) -> str:
    """`text` as an error message quotes it: a long one cut (a 5000-digit step is not worth echoing)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _model_card(state: ModelState, step: int | None) -> dict:
    manifest = state.checkpoints.manifest(step if step is not None else state.step)
    created = manifest.created_at if manifest is not None else time.time()  # the newest step, being written
    card = {
        "id": state.name if step is None else f"{state.name}@{step}",
        "object": "model",
        "created": int(created),
        "owned_by": "art-sky",
        "root": state.request.base_model,
    }
    return card | ({"parent": state.name, "step": step} if step is not None else {"step": state.step})


# /v1/chat/completions in the server's OpenAPI document (it is a plain ASGI route, which FastAPI does not list).
PATHS = {
    "/v1/chat/completions": {
        "post": {
            "summary": "Chat completion (OpenAI's API; streamed as server-sent events with stream=true)",
            "operationId": "chat_completions",
            "security": [{"HTTPBearer": []}],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ChatCompletionRequest"}}},
            },
            "responses": {
                "200": {
                    "description": "the completion, or its events",
                    "content": {
                        "application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                "400": {"description": "a parameter the engine would not honour, or a malformed request"},
                "404": {"description": "the model (or its step) is not served here"},
                "413": {"description": "the request body is over the server's limit"},
            },
        }
    }
}


def install(
    app: FastAPI,
    engine: Engine,
    states: dict[str, ModelState],
    gate: DeviceGate,
    api_key: str,
    dependencies: list,
    activities: dict[str, ModelActivity],
) -> None:
    """Add the /v1 routes to the server's app; each completion is counted in its model's `activities`."""
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

    app.include_router(router)
    completions = _ChatCompletions(engine, states, gate, api_key, activities)
    # an ASGI app, which Starlette routes to as one; the stub types only request handlers
    app.router.add_route("/v1/chat/completions", completions, methods=["POST"])  # type: ignore[arg-type]
    app.router.add_route(
        "/v1/{path:path}", _not_served, include_in_schema=False, methods=["GET", "POST", "PUT", "PATCH", "DELETE"]
    )


async def _not_served(request: Request) -> JSONResponse:
    """Any other /v1 route (a client calling /v1/completions, /v1/embeddings, /v1/responses) gets an answer in
    OpenAI's format that says what is served, not a bare "Not Found"."""
    return OpenAIError(
        404,
        f"{request.method} {request.url.path} is not served here: art-sky serves POST "
        "/v1/chat/completions, GET /v1/models and GET /v1/models/{id}",
        type="not_found_error",
    ).response()


class SampledTokens:
    """The tokens a completion sampled, read from the bytes its client gets (cheap: a regular expression, no JSON):
    a response's usage, or a stream's sampled `token_ids` (vLLM's fields, sent by default), events split across
    network reads included; a stream's usage (include_usage) wins where it comes."""

    _IDS = re.compile(rb'(?<!prompt_)"token_ids":\s*\[([0-9,\s]*)\]')
    _USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')
    _TAIL = 64  # bytes kept from one read for the next: a field cut in two is read whole

    def __init__(self) -> None:
        self.sampled = 0
        self.usage: int | None = None
        self._tail = b""

    def feed(self, data: bytes) -> None:
        text = self._tail + data
        end = 0
        for match in self._IDS.finditer(text):
            ids = match.group(1).strip()
            self.sampled += ids.count(b",") + 1 if ids else 0
            end = match.end()
        for match in self._USAGE.finditer(text):
            self.usage, end = int(match.group(1)), max(end, match.end())
        self._tail = text[max(end, len(text) - self._TAIL) :]

    @property
    def tokens(self) -> int:
        return self.usage if self.usage is not None else self.sampled


class _ChatCompletions:
    """POST /v1/chat/completions as a plain ASGI app. With vLLM behind it this is a proxy, and on a GPU node's few
    cores its per-request work is taken from vLLM's own: no dependency injection, no response classes, each
    server-sent event passed on as the bytes it arrived as."""

    def __init__(
        self,
        engine: Engine,
        states: dict[str, ModelState],
        gate: DeviceGate,
        api_key: str,
        activities: dict[str, ModelActivity],
    ):
        self.engine, self.states, self.gate, self.activities = engine, states, gate, activities
        self.api_key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        scheme, _, key = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer" or not secrets.compare_digest(key.strip(), self.api_key):
            return await OpenAIError(401, UNAUTHORIZED, type="authentication_error").response()(scope, receive, send)
        try:
            activity, result = await self._complete(await _body(receive))
        except OpenAIError as exc:
            return await exc.response()(scope, receive, send)
        counted = SampledTokens()
        if not isinstance(result, SSE):
            counted.feed(result)
            activity.completion_finished(counted.tokens)
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(result)).encode())],
                }
            )
            return await send({"type": "http.response.body", "body": result})
        gone = asyncio.ensure_future(_disconnected(receive))  # the server does not notice it when it writes
        try:  # however it ends (done, failed, the client gone), the engine's side is closed
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
                }
            )
            async for chunk in result.chunks:
                if gone.done():  # the client went away: the engine stops sampling for it at its next token
                    return
                counted.feed(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            gone.cancel()
            activity.completion_finished(counted.tokens)
            await result.close()

    async def _complete(self, raw: bytes) -> tuple[ModelActivity, bytes | SSE]:
        """The completion (its JSON, or its events) and the activity of the model serving it, which counts it in
        flight until the caller says it finished."""
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise OpenAIError(400, f"the request body is not JSON ({exc}): send a chat completion request") from exc
        if not isinstance(body, dict):
            raise OpenAIError(400, "the request body must be a JSON object: send a chat completion request")
        engine = self.engine
        problem = refused(body, engine.honoured, engine.name)
        if problem:
            raise OpenAIError(400, problem)
        check_messages(body.get("messages"))
        hold = await self.gate.hold()  # the model's step is read after a running training step, never before
        try:
            served = resolve(self.states, body.get("model"))
        except BaseException:
            hold.release()
            raise
        activity = self.activities[served.state.name]
        activity.completion_started()
        try:
            return activity, await engine.chat(served, honoured_only(body, engine.honoured), hold)
        except (ValueError, TemplateError) as exc:
            hold.release()
            activity.completion_finished(0)
            raise OpenAIError(400, str(exc)) from exc
        except BaseException:
            hold.release()
            activity.completion_finished(0)
            raise


async def _disconnected(receive) -> None:
    """Returns when the client of a streamed response has gone away (its request body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise OpenAIError(400, "the client went away before sending the whole request")
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)
