"""The CLI's one error boundary: an art-sky error (or invalid input) ends a command with its message and an exit
code, not a traceback."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from art_sky.errors import ArtSkyError

console = Console()
F = TypeVar("F", bound=Callable)


def friendly(command: F, *, exit_code: int = 1, prefix: str = "") -> F:
    """Wrap a command: an `ArtSkyError` or a `ValueError` (pydantic's validation too) prints
    "<prefix>error: message" and exits with `exit_code`."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (ArtSkyError, ValueError) as exc:
            console.print(f"{escape(prefix)}[red]error:[/red]", escape(str(exc)), highlight=False, soft_wrap=True)
            raise typer.Exit(exit_code) from None

    return wrapper  # type: ignore[return-value]
