"""Credentials kept out of everything art-sky writes: a URL's user and password (`http://user:pass@host` ->
`http://***@host`) and the secret values this process knows (the API key, the object store's keys), in every log
line and every error message. Libraries quote what they were given (obstore's errors name the endpoint URL, with
its password), so redaction is applied where text leaves art-sky: the store's and the fleet's errors, the tunnel's
messages, and a log formatter on the server's log (every logger's lines, tracebacks included)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

MASK = "***"
MIN_SECRET = 8  # a shorter value ("true", a region) is no secret, and masking it would garble the text
# scheme://userinfo@ : the userinfo is anything up to the first @ of the authority (no /, whitespace, ? or #)
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/\s?#@]+@")
# the store's variables whose values are secrets (AWS_ACCESS_KEY_ID names a key, it is not one)
SECRET_VARIABLES = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "GOOGLE_SERVICE_ACCOUNT_KEY")
_secrets: set[str] = set()


def add_secrets(values: Iterable[str | None]) -> None:
    """Mask these values wherever `redact` sees them, from now on in this process."""
    _secrets.update(v for v in values if v and len(v) >= MIN_SECRET)


def redact(text: str) -> str:
    """`text` without a URL's credentials or a known secret value."""
    text = _USERINFO.sub(rf"\g<scheme>{MASK}@", text)
    for value in sorted(_secrets, key=len, reverse=True):  # the longest first: one that contains another
        text = text.replace(value, MASK)
    return text


class RedactingFormatter(logging.Formatter):
    """A handler's formatter, its whole output (message, arguments, traceback) redacted."""

    def __init__(self, inner: logging.Formatter | None):
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        return redact(self.inner.format(record))


def redact_logging(logger: logging.Logger | None = None) -> None:
    """Every handler of `logger` (the root logger) writes redacted lines."""
    for handler in (logger or logging.getLogger()).handlers:
        if not isinstance(handler.formatter, RedactingFormatter):
            handler.setFormatter(RedactingFormatter(handler.formatter))
