"""Plain tables for the CLI: one line per row, so `art-sky status | grep NAME` finds a whole row.

Rich's tables fold or drop columns to fit a terminal, names included; these never fold. In a terminal that is too
narrow, the columns named shrinkable are cut (with "…"), the widest first, so that cuts spread over the wide
columns; the rest (a cluster's name) always show whole. Anywhere else (a pipe, a file) nothing is cut.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text

from .errors import console

GAP = "  "


def lines(
    headers: Sequence[str], rows: Sequence[Sequence[str]], *, width: int | None, shrink: Sequence[int] = ()
) -> list[str]:
    """The table as text lines, at most `width` characters where cutting the `shrink` columns (indices; among
    equally wide ones the first is cut first) can make it so; `width=None` cuts nothing."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]
    excess = sum(widths) + len(GAP) * (len(widths) - 1) - width if width is not None else 0
    while (
        excess > 0 and (widest := max(shrink, key=lambda i: widths[i], default=None)) is not None and widths[widest] > 1
    ):
        widths[widest] -= 1
        excess -= 1
    return [GAP.join(_cell(cell, w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in (headers, *rows)]


def _cell(text: str, width: int) -> str:
    return text.ljust(width) if len(text) <= width else text[: width - 1] + "…"


def show(headers: Sequence[str], rows: Sequence[Sequence[str]], *, shrink: Sequence[int] = ()) -> None:
    """Print a table: fitted to the terminal's width in a terminal, whole anywhere else."""
    width = console.width if console.is_terminal else None
    header, *body = lines(headers, rows, width=width, shrink=shrink)
    console.print(Text(header, style="bold"), soft_wrap=True)
    for line in body:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
