"""One exception hierarchy for the whole project: every message says what happened and what to do.

Each error has a machine-readable `code` (`ErrorCode`): the server answers it beside the message (`wire.ErrorResponse`,
a training stream's error line) and clients branch on it, never on a message's wording (vLLM's `ErrorInfo.code`).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any, Protocol


class Reported(Protocol):
    """A validation error's report: pydantic's ValidationError, FastAPI's RequestValidationError."""

    def errors(self) -> Sequence[Any]: ...


class ErrorCode(StrEnum):
    """What kind of failure an error is, as the server and its clients name it on the wire."""

    INTERNAL = "internal"  # a bug of the server's: its log has the traceback
    INVALID = "invalid"  # a setting, argument or request body is wrong
    UNTRAINABLE = "untrainable"  # a trajectory cannot become training tokens
    UNAUTHORIZED = "unauthorized"  # wrong or missing API key
    NOT_REGISTERED = "not_registered"  # the model is not registered on this server
    NOT_FOUND = "not_found"  # a step, checkpoint, lease, file or route that does not exist
    CONFLICT = "conflict"  # the request contradicts what the server already holds
    LIMIT = "limit"  # a bound was reached (leases held, ...): release something first
    TOO_LARGE = "too_large"  # the request body is over its route's limit
    DISK_FULL = "disk_full"  # a write ran out of disk space
    STORE = "store"  # the checkpoint object store failed
    ENGINE = "engine"  # the inference engine is down or refused
    ROLLED_BACK = "rolled_back"  # the step was rolled back (the trainer's ranks restarted): train it again
    UNAVAILABLE = "unavailable"  # the server could not be reached or started


class ArtSkyError(Exception):
    """Base class of every error art-sky raises on purpose."""

    code: ErrorCode = ErrorCode.INTERNAL


class ConfigError(ArtSkyError):
    """A setting, argument or input is wrong; the message names it."""

    code = ErrorCode.INVALID


class NotRegisteredError(ArtSkyError):
    """The server has no model of that name registered (a restarted server, a typo): register it first."""

    code = ErrorCode.NOT_REGISTERED


class MissingError(ArtSkyError):
    """A step, checkpoint, lease or file the request names does not exist; the message lists what does."""

    code = ErrorCode.NOT_FOUND


class ConflictError(ArtSkyError):
    """The request contradicts what the server holds (a model registered otherwise); the message says what holds it."""

    code = ErrorCode.CONFLICT


class LimitError(ArtSkyError):
    """A bound was reached (e.g. leases per model); the message names the bound and what holds it."""

    code = ErrorCode.LIMIT


class ServerError(ArtSkyError):
    """The cluster server answered with an error: its status code, its message and its `code`."""

    def __init__(self, status_code: int, message: str, code: ErrorCode | str | None = None):
        super().__init__(f"server said {status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.code = _known(code, status_code)  # the server's code


class AuthError(ServerError):
    """Wrong or missing API key."""


class NotFoundError(ServerError):
    """Unknown model, step or route."""


class VersionMismatchError(ArtSkyError):
    """Client and cluster server run different art-sky versions."""

    code = ErrorCode.INVALID


class BackendUnavailableError(ArtSkyError):
    """The server could not be started or reached (dead process, dead tunnel, timeout)."""

    code = ErrorCode.UNAVAILABLE


class EngineError(ArtSkyError):
    """The inference engine failed (vLLM did not start, refused an adapter); the message points at its log."""

    code = ErrorCode.ENGINE


class SSHError(BackendUnavailableError):
    """An SSH connection, login, remote command or file transfer failed."""


class DiskFullError(ArtSkyError):
    """A write ran out of disk space (whatever layer raised it: art_sky/disk_full.py); the message names the disk
    and what to free."""

    code = ErrorCode.DISK_FULL


class TokenizationError(ArtSkyError):
    """A trajectory cannot be turned into training tokens (e.g. a choice without sampled token ids)."""

    code = ErrorCode.UNTRAINABLE


class CheckpointStoreError(ArtSkyError):
    """The checkpoint object store refused or failed an operation; the message names the store's URI.
    `misconfigured`: retrying cannot help (no such bucket, credentials missing or refused, no permission)."""

    code = ErrorCode.STORE

    def __init__(self, message: str, misconfigured: bool = False):
        super().__init__(message)
        self.misconfigured = misconfigured


class TrainingStalledError(ArtSkyError):
    """A training step made no progress for longer than ART_SKY_TRAIN_STALL_TIMEOUT; the message says what the server
    was doing (the phase it is stuck in)."""

    code = ErrorCode.UNAVAILABLE


# What a code means when an older server sent none: its status alone.
_BY_STATUS = {
    401: ErrorCode.UNAUTHORIZED,
    404: ErrorCode.NOT_FOUND,
    409: ErrorCode.CONFLICT,
    413: ErrorCode.TOO_LARGE,
    422: ErrorCode.INVALID,
    429: ErrorCode.LIMIT,
    502: ErrorCode.STORE,
    503: ErrorCode.ENGINE,
    507: ErrorCode.DISK_FULL,
}


def _known(code: ErrorCode | str | None, status_code: int) -> ErrorCode:
    """`code` as an ErrorCode; one this client does not know (a newer server's), or none, by the status."""
    try:
        return ErrorCode(code) if code is not None else _BY_STATUS.get(status_code, ErrorCode.INTERNAL)
    except ValueError:
        return _BY_STATUS.get(status_code, ErrorCode.INTERNAL)


def first_problem(exc: Reported) -> tuple[str, str]:
    """pydantic's first problem as (the field's dotted path, what is wrong), without pydantic's "Value error, "."""
    errors = exc.errors()
    if not errors:
        return "", str(exc)
    return ".".join(str(p) for p in errors[0]["loc"]), errors[0]["msg"].removeprefix("Value error, ")


def problems(exc: Reported, *within: str | int, drop: int = 0, limit: int = 10, empty: str = "input") -> str:
    """pydantic's report as one line, `path.to.field: what is wrong; ...`: the first `limit` problems, then how many
    more; each path under `within` and without its first `drop` parts (a body's "body"); `empty` for a problem
    of the whole input. The one sentence every layer makes of a validation error."""
    errors = exc.errors()
    said = "; ".join(
        f"{'.'.join(str(p) for p in (*within, *e['loc'][drop:])) or empty}: {e['msg'].removeprefix('Value error, ')}"
        for e in errors[:limit]
    )
    return said + (f" (and {len(errors) - limit} more)" if len(errors) > limit else "")
