"""Request bodies: a size limit per route, enforced as the body arrives (413 before any work, chunked bodies too),
and parsing off the event loop, so that one large request never stalls /health or another model's completions.

Training bodies (train, SFT) may be large (ART_SKY_MAX_REQUEST_BYTES); a chat completion, and every other route's
body, is far smaller (ART_SKY_MAX_COMPLETION_REQUEST_BYTES). Parsing is pydantic's own JSON validation in a worker
thread: it lets the event loop run while it works, where `json.loads` would hold it for the whole body.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema

M = TypeVar("M", bound=BaseModel)

TRAINING_ROUTE = re.compile(r"^/art/models/[^/]+/(train|sft)$")
INLINE_BYTES = 64 * 1024  # bodies this small are parsed on the event loop: a thread hop would cost more
_WITHOUT_BODY = {"GET", "HEAD", "OPTIONS"}


class BodyLimits:
    """ASGI middleware: reads a request's body up to its route's limit, refusing a larger one with 413 as soon as
    it is known to be larger (its Content-Length, or the bytes so far), then hands the body on."""

    def __init__(self, app, training: int, other: int):
        self.app, self.training, self.other = app, training, other

    def limit(self, path: str) -> tuple[int, str]:
        """The limit of a route's body, and what to do about a larger one."""
        if TRAINING_ROUTE.match(path):
            return self.training, "(ART_SKY_MAX_REQUEST_BYTES): send fewer trajectory groups per request"
        return self.other, "(ART_SKY_MAX_COMPLETION_REQUEST_BYTES): shorten the request"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in _WITHOUT_BODY:
            return await self.app(scope, receive, send)
        limit, hint = self.limit(scope["path"])
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await _refuse(receive, send, limit, hint)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client went away: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await _refuse(receive, send, limit, hint)
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, whenever it comes

        await self.app(scope, replay, send)


async def _refuse(receive, send, limit: int, hint: str) -> None:
    message = f"request body is larger than the server's limit of {limit} bytes {hint}"
    response = JSONResponse(
        {"detail": message, "error": {"message": message, "type": "invalid_request_error", "param": None, "code": 413}},
        status_code=413,
    )
    await response({"type": "http"}, receive, send)


async def parse(request: Request, model: type[M]) -> M:
    """The request's body as `model`; a 422 naming each field that is wrong (as FastAPI's own bodies)."""
    raw = await request.body()
    try:
        if len(raw) <= INLINE_BYTES:
            return model.model_validate_json(raw)
        return await asyncio.to_thread(model.model_validate_json, raw)
    except ValidationError as exc:
        raise RequestValidationError([error | {"loc": ("body", *error["loc"])} for error in exc.errors()]) from exc


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra`: its JSON body is `model` (parsed by `parse`, not by FastAPI)."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    }


def document(app: FastAPI, models: list[type[BaseModel]], paths: dict[str, Any]) -> None:
    """Add the schemas of the bodies `parse` reads, and routes FastAPI does not list (plain ASGI ones), to the
    app's OpenAPI document."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            _, found = models_json_schema(
                [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, definition in found.get("$defs", {}).items():
                components.setdefault(name, definition)
            schema["paths"].update(paths)
        assert app.openapi_schema is not None  # `generate` keeps what it made
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend its document
