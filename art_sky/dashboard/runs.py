"""A checkpoint root's runs as the dashboard shows them, read from their files alone (each model's history.jsonl), so
a finished or crashed run reads as it was left, and a live one as far as its server has written.

Reading never fails on a run's contents: a cut last line (a crash mid-write) or a line that is not JSON is left out
and said in the run's `problems`; a folder that holds no run says so in `error`. Only numbers (and the step and its
time) are kept from a line: what a page shows is figures, never a string a server or a user logged.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from art_sky.layout import HISTORY, model_key

RUN_GLOB = f"{model_key('*', '*')}/{HISTORY}"  # every model's history under a checkpoint root


@dataclass
class Run:
    """One model's run: its history's whole lines (figures only), and what could not be read."""

    id: str  # project/name
    project: str
    name: str
    entries: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def wire(self) -> dict:
        return {
            "id": self.id,
            "project": self.project,
            "name": self.name,
            "entries": self.entries,
            "problems": self.problems,
        }


def history_files(root: Path) -> list[Path]:
    return sorted(root.glob(RUN_GLOB))


def read_run(path: Path) -> Run:
    """The run whose history is `path`: every whole line, in file order; the rest named in `problems`."""
    name, project = path.parent.name, path.parent.parent.parent.name
    run = Run(id=f"{project}/{name}", project=project, name=name)
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        run.problems.append(f"{path} could not be read ({exc.strerror or exc}): check its permissions")
        return run
    lines = text.split("\n")
    cut = lines.pop()  # after the last newline: empty unless the last line was cut
    for number, line in enumerate(lines, 1):
        if line.strip():
            entry = _entry(line)
            if entry is None:
                run.problems.append(f"line {number} of {path} is not a history line: left out")
            else:
                run.entries.append(entry)
    if cut.strip():
        entry = _entry(cut)
        if entry is not None:  # a whole line whose newline is still to come
            run.entries.append(entry)
        else:
            run.problems.append(
                f"the last line of {path} is cut (the run stopped while writing it): showing the "
                f"{len(run.entries)} whole lines before it"
            )
    return run


def _entry(line: str) -> dict | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("step"), int):
        return None
    kept = {
        k: v for k, v in value.items() if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }
    if isinstance(value.get("recorded_at"), str):
        kept["recorded_at"] = value["recorded_at"]
    return kept


def read_root(root: Path) -> dict:
    """Every run under the checkpoint root `root`, and the reason it shows none (`error`), for the page."""
    files = history_files(root)
    error = None
    if not root.is_dir():
        error = f"{root} is not a folder: give the checkpoint root a run trains in (--path, e.g. .art)"
    elif not files:
        models = list(root.glob(model_key("*", "*")))
        error = (
            f"no run has finished a step in {root} yet: {len(models)} model folder(s), no {HISTORY}. The page "
            "updates when the first step ends"
            if models or (root / "run").is_dir()
            else f"{root} is not a run folder (no PROJECT/models/NAME/{HISTORY} in it): give the checkpoint root a "
            "run trained in (--path, e.g. the .art that `art-sky demo` writes)"
        )
    return {"root": str(root), "error": error, "runs": [read_run(f).wire() for f in files]}


def signature(root: Path) -> tuple:
    """What changes when any run's history changes (a line appended, a file rewritten, a run added)."""
    marks = []
    for path in history_files(root):
        try:
            stat = path.stat()
        except OSError:
            continue
        marks.append((str(path), stat.st_size, stat.st_mtime_ns))
    return tuple(marks)
