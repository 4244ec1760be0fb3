"""The one mapping from the server's errors to HTTP statuses: the client's fault 4xx, the server's resources 5xx,
each with its own status (a full disk is 507, not 500). A step's error (cluster/steps.py) takes the status of what
caused it, so the streamed error line of a training request carries the same status and code a plain request would.
Every error body the server answers is `error_response(exc)`'s: the message and its machine-readable code."""

from __future__ import annotations

from art_sky.errors import (
    ArtSkyError,
    CheckpointStoreError,
    ConfigError,
    ConflictError,
    DiskFullError,
    EngineError,
    ErrorCode,
    LimitError,
    MissingError,
    NotRegisteredError,
    TokenizationError,
)
from art_sky.redact import redact
from art_sky.wire import ErrorResponse

from .training.rank_group import RankError

STATUSES: tuple[tuple[type[BaseException], int], ...] = (
    (ConfigError, 422),  # a setting or input is wrong: the message names it
    (TokenizationError, 422),  # a trajectory cannot become training tokens
    (NotRegisteredError, 404),  # register the model first
    (MissingError, 404),  # a step, checkpoint, lease or file that does not exist
    (ConflictError, 409),  # contradicts what the server holds
    (LimitError, 429),  # a bound reached: release something first
    (DiskFullError, 507),  # Insufficient Storage: the message names the disk and what to free
    (CheckpointStoreError, 502),  # the object store, upstream of the server, failed
    (EngineError, 503),  # the inference engine is down or refused: retry once it is back (its log says why)
    (RankError, 503),  # the trainer's ranks stopped: they restart from the last commit, retry the step
)
UNEXPECTED = 500  # anything else is a bug of the server's: its log has the traceback


def classify(exc: BaseException) -> tuple[int, ErrorCode]:
    """The status and code of `exc`, or of the first error on its cause chain that has one."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for kind, status in STATUSES:
            if isinstance(current, kind):
                assert isinstance(current, ArtSkyError)  # every kind in the table is one
                return status, current.code
        current = current.__cause__
    return UNEXPECTED, ErrorCode.INTERNAL


def http_status(exc: BaseException) -> int:
    """The status of `exc` (`classify`)."""
    return classify(exc)[0]


def error_response(exc: BaseException, detail: str | None = None) -> tuple[int, ErrorResponse]:
    """The status and body the server answers for `exc` (its message, or `detail`)."""
    status, code = classify(exc)
    return status, ErrorResponse(detail=redact(str(exc) if detail is None else detail), code=code)
