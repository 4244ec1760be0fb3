"""`Progress`: the phases of getting a server running (connecting, the Python found, the venv, the install, the
server's start, ready) shown as they happen, so that a quiet minute reads as an install and not as a hang.

On a terminal each phase is a rich live line (spinner, what pip is doing, elapsed time), left behind as one line
with its time once done; elsewhere (a pipe, CI, a log file) plain timestamped lines on stderr:

    [12:01:03] installing art-sky[cluster] with the CPU build of torch ... 41.2s

The same phases go to the `art_sky.progress` logger. With `verbose`, the remote commands' own output (pip's) is
printed as it arrives. Every path (SSH and local backends, the CLI, SkyPilot's environment) reports through one.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterator
from typing import TextIO

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress as RichProgress
from rich.progress import SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

log = logging.getLogger("art_sky.progress")


def elapsed(seconds: float) -> str:
    """41.2s, 3m36s."""
    return f"{seconds:.1f}s" if seconds < 60 else f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


class Phase:
    """One phase in progress: `detail` is what the live line says it is doing now (e.g. the package pip fetches)."""

    def __init__(self, progress: Progress, title: str):
        self.progress = progress
        self.title = title
        self.started = time.monotonic()
        self._task: TaskID | None = None

    def detail(self, text: str) -> None:
        self.progress._update(self, text)

    def output(self, line_seen: Callable[[str], str | None] | None = None) -> Callable[[str], None]:
        """A runner's `output` callback: each complete line goes to `line_seen` (which may return a new detail)
        and, with `verbose`, to the screen."""
        pending = [""]

        def feed(text: str) -> None:
            lines = (pending[0] + text).replace("\r", "\n").split("\n")
            pending[0] = lines.pop()
            for line in lines:
                if self.progress.verbose and line.strip():
                    self.progress._echo(line)
                new = line_seen(line) if line_seen else None
                if new:
                    self.detail(new)

        return feed


class Progress:
    """Reports phases to `stream` (default: stderr); `live` (default: when the stream is a terminal) draws rich's
    live line; `verbose` also shows the remote commands' own output; `enabled=False` only logs."""

    def __init__(
        self, *, verbose: bool = False, stream: TextIO | None = None, live: bool | None = None, enabled: bool = True
    ):
        self.console = Console(file=stream, stderr=stream is None, soft_wrap=True, highlight=False)
        self.live = self.console.is_terminal if live is None else live
        self.verbose = verbose
        self.enabled = enabled
        self.started = time.monotonic()
        self._current: Phase | None = None
        self._bar: RichProgress | None = None
        self._dangling = False  # a plain line "[..] title ..." waits for its time

    def begin(self) -> None:
        """Start the clock that `ready` reports."""
        self.started = time.monotonic()

    @contextlib.contextmanager
    def phase(self, title: str) -> Iterator[Phase]:
        """A phase: shown while it runs, then left as one line with its time (or `failed after`)."""
        phase = Phase(self, title)
        log.info("%s ...", title)
        self._open(phase)
        try:
            yield phase
        except BaseException:
            self._close(phase, f"failed after {elapsed(time.monotonic() - phase.started)}")
            log.info("%s failed after %s", title, elapsed(time.monotonic() - phase.started))
            raise
        took = elapsed(time.monotonic() - phase.started)
        self._close(phase, took)
        log.info("%s: %s", title, took)

    def note(self, text: str) -> None:
        """A fact found on the way (the Python's version, the stack chosen and why): one line."""
        log.info("%s", text)
        if self.enabled:
            self._line(f"[{_clock()}] {text}")

    def ready(self, what: str) -> None:
        """The last line: what is ready, and the total time since `begin`."""
        self.note(f"{what} in {elapsed(time.monotonic() - self.started)}")

    # -- drawing -------------------------------------------------------------------------------------------------

    def _open(self, phase: Phase) -> None:
        self._current = phase
        if not self.enabled:
            return
        if self.live:
            self._bar = RichProgress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                TextColumn("[dim]{task.fields[detail]}"),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
            )
            phase._task = self._bar.add_task(escape(phase.title), detail="")
            self._bar.start()
        else:
            self._end_dangling()
            self.console.file.write(f"[{_clock()}] {phase.title} ...")
            self.console.file.flush()
            self._dangling = True

    def _close(self, phase: Phase, outcome: str) -> None:
        self._current = None
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
            mark = "[green]✓[/green]" if outcome[0].isdigit() else "[red]✗[/red]"
            self.console.print(f"{mark} {escape(phase.title)} [dim]{escape(outcome)}[/dim]")
        elif self._dangling:
            self.console.file.write(f" {outcome}\n")
            self.console.file.flush()
            self._dangling = False
        else:
            self._line(f"[{_clock()}] {phase.title} ... {outcome}")

    def _update(self, phase: Phase, text: str) -> None:
        if self._bar is not None and phase._task is not None:
            self._bar.update(phase._task, detail=escape(text[:80]))

    def _echo(self, line: str) -> None:
        """A remote command's own output line (verbose)."""
        if self.enabled:
            self._line(f"  {line}", style="dim")

    def _line(self, text: str, style: str | None = None) -> None:
        if self._bar is not None:
            self._bar.console.print(text, markup=False, style=style)
            return
        self._end_dangling()
        self.console.file.write(text + "\n")
        self.console.file.flush()

    def _end_dangling(self) -> None:
        if self._dangling:
            self.console.file.write("\n")
            self._dangling = False


def _clock() -> str:
    return time.strftime("%H:%M:%S")


# -- pip's output ------------------------------------------------------------------------------------------------

_FETCH = re.compile(r"^\s*(Downloading|Using cached) (\S+) \(([\d.]+) (bytes|kB|MB|GB)\)")
_COLLECTING = re.compile(r"^\s*(Collecting|Processing) (\S+)")
_INSTALLED = re.compile(r"^\s*Successfully installed (.+)")
_UNIT = {"bytes": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}


class PipOutput:
    """What pip's (not quiet) output says: the package it works on now, the files it fetched and their sizes, how
    many packages it installed."""

    def __init__(self) -> None:
        self.fetched: list[tuple[str, float, bool]] = []  # (distribution, bytes, from pip's cache)
        self.installed = 0

    def line(self, line: str) -> str | None:
        """Read one line; return what the live line should say, if this line changes it."""
        if found := _FETCH.match(line):
            how, file, size, unit = found.groups()
            name = file.rsplit("/", 1)[-1].split("-", 1)[0].replace("_", "-").lower()
            self.fetched.append((name, float(size) * _UNIT[unit], how == "Using cached"))
            return f"{'cached' if how == 'Using cached' else 'downloading'} {name} ({size} {unit})"
        if found := _COLLECTING.match(line):  # Processing: a local file (a wheel directory, a file:// index)
            return f"{found[1].lower()} {found[2].rsplit('/', 1)[-1]}"
        if found := _INSTALLED.match(line):
            self.installed = len(found[1].split())
            return None
        if line.startswith("Installing collected packages"):
            return "installing the collected packages"
        return None

    def summary(self) -> str | None:
        """One line: packages installed, the download's total and its largest files; None when pip said nothing."""
        parts = []
        if self.installed:
            parts.append(f"{self.installed} package{'s' if self.installed > 1 else ''} installed")
        downloaded = [(name, size) for name, size, cached in self.fetched if not cached]
        if downloaded:
            largest = sorted(downloaded, key=lambda item: -item[1])[:3]
            parts.append(
                f"{_size(sum(size for _, size in downloaded))} downloaded, the largest "
                + ", ".join(f"{name} {_size(size)}" for name, size in largest)
            )
        cached = sum(size for _, size, was_cached in self.fetched if was_cached)
        if cached:
            parts.append(f"{_size(cached)} from pip's cache")
        return "; ".join(parts) or None


def _size(count: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count:.0f} bytes"
