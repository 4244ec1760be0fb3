"""The reason a process wrote, from the tail of its log or stderr: the one helper every "it failed" message uses
(a server that exited before listening, here, over SSH or as a SkyPilot job; a remote command that failed).

A process that ends on an error writes it last: `sys.exit("cannot bind ...")`, a traceback's final line, pip's
`ERROR: ...`. What comes after or around it is not a reason: blank lines, progress bars (redrawn with `\\r`),
and logging records below WARNING (the server's `2026-01-01 12:00:00,000 INFO name: ...`, uvicorn's `INFO:  ...`).
"""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_PROGRESS = re.compile(r"\d+%\|| \d+%$|━")  # tqdm's bar, a bare percentage, pip's / rich's bar
_RECORD = re.compile(r"^\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d[,.]\d+ (?P<level>[A-Z]+) (?:[\w.\-]+: )?(?P<message>.*)$")
_UVICORN = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL):\s+(?P<message>.*)$")
_QUIET = {"DEBUG", "INFO", "NOTSET"}
MAX_REASON = 400  # characters: a reason is one line of a message, not a paste


def lines(text: str) -> list[str]:
    """The lines a terminal would show: the last redraw of each (`\\r`), without colour codes or trailing blanks."""
    shown = (_ANSI.sub("", line.split("\r")[-1]).rstrip() for line in text.replace("\r\n", "\n").split("\n"))
    return [line for line in shown if line.strip()]


def reason(text: str, *, any_level: bool = False) -> str:
    """The reason `text` (a log's or stderr's tail) ends with: its last line that says something went wrong, a
    logging record's message without its timestamp. "" when there is none (every line progress or INFO): the
    process was stopped from outside, or is still going. `any_level`: else the last INFO record or line, for what
    a process that is still going was doing."""
    kept = [line for line in lines(text) if not _PROGRESS.search(line)]
    for at in range(len(kept) - 1, -1, -1):
        record = _RECORD.match(kept[at]) or _UVICORN.match(kept[at])
        if record is None:
            return _short(kept[at].strip())
        if record["level"] not in _QUIET:  # with the records of its level just before it (pip's two ERROR lines)
            block = [record["message"].strip()]
            while len(block) < 3 and at - len(block) >= 0:
                before = _RECORD.match(kept[at - len(block)]) or _UVICORN.match(kept[at - len(block)])
                if before is None or before["level"] != record["level"]:
                    break
                block.insert(0, before["message"].strip())
            return _short(" ".join(block))
    if any_level and kept:
        record = _RECORD.match(kept[-1]) or _UVICORN.match(kept[-1])
        return _short((record["message"] if record else kept[-1]).strip())
    return ""


def _short(line: str) -> str:
    return line if len(line) <= MAX_REASON else line[: MAX_REASON - 3] + "..."


def fix(why: str) -> str:
    """What to do about a reason a server's start is known to end with ("" when the reason says it itself)."""
    if "No module named" in why:
        return (
            "the server's Python lacks art-sky or its dependencies: name one with art-sky[cluster] installed "
            "(python=, `--python`), or leave it unset for art-sky's own environment"
        )
    if re.search(r"exec: .*: not found", why):
        return "no Python at that path: check python= (`--python`)"
    return ""
