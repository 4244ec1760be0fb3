"""The CLI's one error boundary and its terminal: every command group is an `ErrorBoundary`, so an error ends any
command with one or two lines (what happened, what to do) and an exit code, never a traceback or a library's log.

- Errors go to stderr (what a command prints for scripts stays on stdout) and end in a non-zero exit.
- An art-sky error (or invalid input) prints its first line; the lines after it (a server log's last lines, a
  remote command's output) are detail, printed only with `art-sky --verbose`.
- A path that does not exist (or cannot be used) is the user's to fix, as an art-sky error is: it names the path.
- Anything else is a bug: one line naming it, the traceback with `--verbose`.
- Logging while a command runs: art-sky's own warnings as `warning: ...` lines on stderr; other libraries'
  records (paramiko's "Secsh channel N open FAILED", httpx's request lines, uvicorn's) only with `--verbose`.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from typer._click import Context  # typer's vendored click: what a group's methods get (typer.Context subclasses it)
from typer.core import TyperGroup

from art_sky.errors import ArtSkyError, problems

from .conventions import Conventional

console = Console(soft_wrap=True)  # long lines (commands to copy) are never broken: the terminal wraps them
errors = Console(soft_wrap=True, stderr=True)


class ErrorBoundary(Conventional, TyperGroup):
    """A command group whose commands (and sub-groups') end in `exit_code` with a short message on error. The
    outermost one also sets up logging for the command (`--verbose`: everything at INFO)."""

    exit_code = 1
    prefix = ""  # before "error:" (`art-sky ci: error: ...`, so CI logs show who failed)

    def invoke(self, ctx: Context):
        verbose = bool(ctx.find_root().params.get("verbose"))
        logs = quiet_logs(verbose) if ctx.parent is None else contextlib.nullcontext()
        with logs:
            try:
                return super().invoke(ctx)
            except (typer.Exit, typer.Abort, typer.TyperException):  # --help, Ctrl-C, usage errors: typer's own
                raise
            except (ArtSkyError, ValueError) as exc:
                report(self.prefix, _message(exc), verbose)
            except Exception as exc:
                path = _wrong_path(exc)
                if verbose and path is None:
                    raise
                report(
                    self.prefix,
                    path
                    or f"unexpected {type(exc).__name__}: {exc} (a bug in art-sky: "
                    "`art-sky --verbose ...` shows the traceback; please report it)",
                    False,
                )
            raise typer.Exit(self.exit_code)


def _wrong_path(exc: Exception) -> str | None:
    """A path the user gave (an argument, a setting) that does not exist or cannot be used: the path and what is
    wrong with it, theirs to fix and no bug."""
    if isinstance(exc, FileNotFoundError | NotADirectoryError | IsADirectoryError | PermissionError) and exc.filename:
        return f"{exc.filename}: {(exc.strerror or str(exc)).lower()}: check the path"
    return None


def _message(exc: Exception) -> str:
    if isinstance(exc, ValidationError):  # pydantic's own layout is a paragraph per field
        return problems(exc, limit=len(exc.errors()))
    return str(exc)


def report(prefix: str, message: str, verbose: bool) -> None:
    """Print an error: its first line; the rest (detail) with `verbose`, else a pointer to it."""
    first, _, detail = message.strip().partition("\n")
    errors.print(f"{escape(prefix)}[red]error:[/red]", escape(first), highlight=False, soft_wrap=True)
    if detail.strip() and verbose:
        errors.print(detail, markup=False, highlight=False, soft_wrap=True)
    elif detail.strip():
        errors.print(
            f"  ({len(detail.strip().splitlines())} more lines of detail: `art-sky --verbose ...` shows them)",
            markup=False,
            highlight=False,
            soft_wrap=True,
            style="dim",
        )


@contextlib.contextmanager
def quiet_logs(verbose: bool) -> Iterator[None]:
    """For one command: art-sky's warnings as one line each on stderr, and no other library's records unless
    `verbose` (then every record at INFO and above). Restores logging afterwards (commands also run in-process)."""
    root, ours = logging.getLogger(), logging.getLogger("art_sky")
    handler = logging.StreamHandler(sys.stderr)
    saved = root.level, ours.level
    added: list[tuple[logging.Logger, logging.Handler]]
    if verbose:
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        added = [(root, handler)]
        root.setLevel(logging.INFO)
        ours.setLevel(logging.INFO)
    else:
        handler.setFormatter(_Lowercase("%(levelname)s: %(message)s"))
        # The NullHandler on the root keeps other libraries' warnings from logging's last resort (stderr).
        added = [(ours, handler), (root, logging.NullHandler())]
        ours.setLevel(logging.WARNING)
    for logger, each in added:
        logger.addHandler(each)
    try:
        yield
    finally:
        for logger, each in added:
            logger.removeHandler(each)
        root.setLevel(saved[0])
        ours.setLevel(saved[1])


class _Lowercase(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace(record.levelname, record.levelname.lower(), 1)
