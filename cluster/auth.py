"""The server's API key as a bearer token, for the head's routes and a replica's alike: every route but /health
answers 401 without it. The comparison is constant-time."""

from __future__ import annotations

import secrets
from collections.abc import Callable

from fastapi import Depends, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .inference import openai_api


def api_key_auth(
    api_key: str,
) -> tuple[HTTPBearer, Callable[[HTTPAuthorizationCredentials | None], bool], Callable[..., None]]:
    """The server's API key as a bearer token: (the scheme, `has_key(credentials)`, the dependency of every route
    but /health, which answers 401)."""
    bearer = HTTPBearer(auto_error=False)

    def has_key(credentials: HTTPAuthorizationCredentials | None) -> bool:
        return credentials is not None and secrets.compare_digest(credentials.credentials.encode(), api_key.encode())

    def authorized(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if not has_key(credentials):
            raise HTTPException(401, openai_api.UNAUTHORIZED)

    return bearer, has_key, authorized
