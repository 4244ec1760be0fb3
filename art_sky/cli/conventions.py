"""The CLI's help as other command lines write it (git, SkyPilot, vLLM): `-h` beside `--help` (the root app's
context settings, which every command inherits), text that the terminal wraps (a docstring's line breaks are not
kept: only its paragraphs), and no type shown for a flag, which takes no value.

Every command is a `Command` and every group an `ErrorBoundary` (cli/errors.py), which both apply these rules once,
when typer builds them; tests/test_cli_conventions.py walks every command's help at several widths.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from typer._click import Context  # typer's vendored click: what a command's methods get
from typer.core import TyperCommand, TyperOption

HELP_OPTIONS = ["-h", "--help"]


def unwrapped(text: str | None) -> str | None:
    """A docstring's paragraphs, each on one line (the terminal wraps it); `\\b` paragraphs (click's "keep my
    lines") as they are."""
    if not text:
        return text
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(p if p.startswith("\b") else re.sub(r"\s*\n\s*", " ", p) for p in paragraphs)


class Conventional:
    """For a typer command or group: help paragraphs unwrapped, no metavar on a flag (`--force`, not `--force
    <bool>`), `--help` included."""

    help: str | None
    params: list[Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.help = unwrapped(self.help)
        for param in self.params:
            param.help = unwrapped(param.help)
            _no_flag_metavar(param)

    def get_help_option(self, ctx: Context) -> TyperOption | None:
        option = super().get_help_option(ctx)  # type: ignore[misc]  # TyperCommand's or TyperGroup's
        if option is not None:
            _no_flag_metavar(option)
        return option


def _no_flag_metavar(param: Any) -> None:
    if isinstance(param, TyperOption) and param.is_flag:
        param.metavar = ""  # typer shows the metavar in place of the type: an empty one shows nothing


class Command(Conventional, TyperCommand):
    """Every art-sky command (`app.command(cls=Command)`)."""
