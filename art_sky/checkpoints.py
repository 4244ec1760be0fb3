"""Checkpoints on a filesystem, used by the cluster server, the object store and the CLI (layout: art_sky.layout).

A step directory holds a PEFT LoRA, its training state (`training_state/`: the optimizer's state and the step's
record, what an exact resume needs) and `manifest.json` (sha256 and size of every file, step, base model, time,
metrics). A step is written in a temp dir and renamed into place, so a step directory that exists is complete; the
manifest is what makes it trustworthy.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from pydantic import BaseModel

from art_sky.errors import ArtSkyError
from art_sky.files import atomic_dir, atomic_write, remove_stale_temps
from art_sky.layout import HISTORY, MANIFEST, STEP_RECORD, model_key, step_name
from art_sky.wire import TrainProgress


class FileEntry(BaseModel):
    sha256: str
    size: int


class Manifest(BaseModel):
    format: int = 1
    project: str
    model: str
    step: int
    base_model: str
    created_at: float
    files: dict[str, FileEntry]
    metrics: dict[str, float] = {}

    @property
    def size_bytes(self) -> int:
        return sum(entry.size for entry in self.files.values())


class StepRecord(BaseModel):
    """What a step committed besides its weights (`training_state/step.json`): which request trained it and what
    it answered, the recent request ids (so a restarted server still answers a retried request with its step instead
    of training it twice), the seed its training used, and its history line."""

    step: int
    kind: str  # train, sft, or init (a fresh LoRA)
    request_id: str | None = None
    seed: int | None = None
    result: TrainProgress | None = None
    requests: dict[str, int] = {}  # request id -> the step it trained, the most recent ones
    history: dict | None = None
    saved: bool = True  # a checkpoint (a resume point); False: trained with save_checkpoint=False, served only


class CorruptCheckpointError(ArtSkyError):
    """A checkpoint's files do not match its manifest."""


def model_dir(root: Path, project: str, name: str) -> Path:
    return Path(root) / model_key(project, name)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_manifest(
    directory: Path, *, project: str, model: str, step: int, base_model: str, metrics: dict[str, float] | None = None
) -> Manifest:
    files = {
        path.relative_to(directory).as_posix(): FileEntry(sha256=sha256_file(path), size=path.stat().st_size)
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    }
    return Manifest(
        project=project,
        model=model,
        step=step,
        base_model=base_model,
        created_at=time.time(),
        files=files,
        metrics=metrics or {},
    )


def read_manifest(step_dir: Path) -> Manifest | None:
    try:
        return Manifest.model_validate_json((Path(step_dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def verify(step_dir: Path, manifest: Manifest) -> None:
    """Raise CorruptCheckpointError naming the first file that is missing or differs from the manifest."""
    for rel, entry in manifest.files.items():
        path = Path(step_dir) / rel
        if not path.is_file() or path.stat().st_size != entry.size or sha256_file(path) != entry.sha256:
            raise CorruptCheckpointError(
                f"checkpoint {step_dir} is corrupt: {rel} does not match its manifest; delete the step to drop it"
            )


class CheckpointDir:
    """The checkpoints of one model on one filesystem."""

    def __init__(self, root: Path, project: str, name: str):
        self.project, self.name = project, name
        self.model_dir = model_dir(root, project, name)
        self.path = self.model_dir / "checkpoints"

    def step_dir(self, step: int) -> Path:
        return self.path / step_name(step)

    def steps(self) -> list[int]:
        """Steps whose directory holds a readable manifest, oldest first."""
        if not self.path.is_dir():
            return []
        found = []
        for child in self.path.iterdir():
            if child.is_dir() and child.name.isdigit() and read_manifest(child) is not None:
                found.append(int(child.name))
        return sorted(found)

    def manifest(self, step: int) -> Manifest | None:
        return read_manifest(self.step_dir(step))

    def record(self, step: int) -> StepRecord | None:
        """The step's record; None for a step saved without one (before art-sky kept them) or not on disk."""
        try:
            return StepRecord.model_validate_json((self.step_dir(step) / STEP_RECORD).read_text())
        except (OSError, ValueError):
            return None

    def remove_stale_temps(self) -> list[Path]:
        """Remove what saves and downloads killed mid-way left behind (never visible as steps: not renamed)."""
        return remove_stale_temps(self.path)

    def save(
        self, step: int, write: Callable[[Path], None], *, base_model: str, metrics: dict[str, float] | None = None
    ) -> Manifest:
        """`write(tmp_dir)` writes the adapter; the manifest is added and the directory renamed into place."""
        advice = (
            f"Delete old checkpoints of {self.name} in {self.path} (`await model.delete_checkpoints()` keeps "
            "the newest and the best) or other files on that disk, or give the machine a bigger disk; then "
            "try again."
        )
        with atomic_dir(self.step_dir(step), advice=advice) as tmp:  # replaces a stale copy (an interrupted run)
            write(tmp)
            manifest = build_manifest(
                tmp, project=self.project, model=self.name, step=step, base_model=base_model, metrics=metrics
            )
            (tmp / MANIFEST).write_text(manifest.model_dump_json(indent=2))
        return manifest

    def delete(self, steps: list[int]) -> None:
        for step in steps:
            shutil.rmtree(self.step_dir(step), ignore_errors=True)

    def append_history(self, entry: dict) -> None:
        self.model_dir.mkdir(parents=True, exist_ok=True)
        with open(self.model_dir / HISTORY, "a") as handle:
            handle.write(json.dumps(entry) + "\n")

    def set_history_aside(self, after: int) -> int:
        """Move the history lines of steps after `after` to history.unsaved.jsonl (appended); how many moved."""
        entries = self.history()
        later = [entry for entry in entries if isinstance(entry.get("step"), int) and entry["step"] > after]
        if not later:
            return 0
        with open(self.model_dir / f"{Path(HISTORY).stem}.unsaved.jsonl", "a") as handle:
            handle.writelines(json.dumps(entry) + "\n" for entry in later)
        kept = "".join(json.dumps(entry) + "\n" for entry in entries if entry not in later)
        atomic_write(self.model_dir / HISTORY, kept)
        return len(later)

    def history(self) -> list[dict]:
        """history.jsonl's lines (one cut short by a crash mid-write left out)."""
        try:
            lines = (self.model_dir / HISTORY).read_text().splitlines()
        except OSError:
            return []
        return [entry for line in lines if isinstance(entry := _json(line), dict)]

    def has_step_line(self, record: StepRecord) -> bool:
        """Does history.jsonl hold the line step `record.step` committed with (the one written as it committed,
        which adds the step's timing to the record's, or the record's own)?"""
        return record.history is not None and any(
            holds(entry, record.history) for entry in self.history() if entry.get("step") == record.step
        )

    def remove_duplicate_history(self) -> int:
        """Remove the lines history.jsonl holds twice, keeping the first: a line identical to an earlier one, and
        a copy of a step's record line after a line that already holds it (servers used to write the newest step's
        again at every start). The file is replaced whole; returns how many lines were removed."""
        path = self.model_dir / HISTORY
        try:
            lines = path.read_text().splitlines()
        except OSError:
            return 0
        records = {
            step: record.history
            for step in self.steps()
            if (record := self.record(step)) is not None and record.history is not None
        }
        kept: list[str] = []
        seen: list[dict] = []

        def again(entry: dict) -> bool:
            step = entry.get("step")
            return entry in seen or (
                isinstance(step, int)
                and entry == records.get(step)
                and any(holds(earlier, entry) for earlier in seen if earlier.get("step") == step)
            )

        for line in lines:
            entry = _json(line)  # a line that is not an object is not ours to judge: kept as it is
            if isinstance(entry, dict):
                if again(entry):
                    continue
                seen.append(entry)
            kept.append(line)
        if len(kept) < len(lines):
            atomic_write(path, "".join(line + "\n" for line in kept))
        return len(lines) - len(kept)


_SECTIONS = {"reward", "loss", "offpolicy", "pipeline", "throughput", "costs", "time", "data", "train", "val", "test"}


def _json(line: str) -> object:
    try:
        return json.loads(line)
    except ValueError:
        return None


def holds(line: dict, entry: dict) -> bool:
    """`line` says all that `entry` says (when each was recorded aside)."""
    return all(line.get(key) == value for key, value in entry.items() if key != "recorded_at")


def history_entry(step: int, split: str, metrics: dict[str, float]) -> dict:
    """One line of history.jsonl in ART's own format (what ART's `model.log` writes, so ART's frontend and this
    server can share the file): flat `<split>/<metric>` keys (a key already under a section keeps its name),
    `step` and `recorded_at`."""
    flat = {
        key if "/" in key and key.split("/", 1)[0] in _SECTIONS else f"{split}/{key}": value
        for key, value in metrics.items()
    }
    return flat | {"step": step, "recorded_at": datetime.now().isoformat()}


def steps_to_keep(steps: list[int], history: list[dict], best_metric: str | None, keep_last: int) -> set[int]:
    """ART's retention: the newest `keep_last` steps and the step with the highest `best_metric` in the history."""
    keep = set(sorted(steps)[-keep_last:])
    if best_metric:
        scores: dict[int, float] = {}
        for entry in history:
            if isinstance(entry.get(best_metric), int | float) and entry.get("step") in steps:
                scores[entry["step"]] = entry[best_metric]
        if scores:
            keep.add(max(scores, key=lambda step: (scores[step], step)))
    return keep
