"""A model's step checkpoints, written off the step's critical path.

A step commits once its LoRA and AdamW state are staged (copied to host memory: `TrainedWeights.stage`); a thread
then writes the step's directory (the adapter, the optimizer's state, the step's record and the manifest, into a
temp directory that one syncfs puts on disk before it is renamed into place: art_sky/files.py's `atomic_dir`) while
the engine swaps to the new adapter. The step's answer waits for the write (`durable`): a step `train()` returned is
on disk, whatever kills the server after. What a synchronous write promised still holds:

- a step `train()` reported is on disk before the next step commits: the next step waits for its write (and writes
  it again if it failed; if that fails too, the next step rolls back with the reason, and the step it waited for
  stays the model's, in memory and served, until a write succeeds);
- kill -9 leaves a whole step or none (the temp directory is only ever renamed whole; the next start removes it);
- a full disk fails the step that would need it, rolled back: a step whose staged state (plus a margin) does not
  fit the disk's free space is refused up front;
- flushing checkpoints to the object store, and the server's shutdown, wait for the write first.

An engine that loads adapters from files (vLLM, the fleet's replicas) asks `adapter_dir` for a step still being
written: its adapter is written for it then (not synced), beside the checkpoints, and removed once a later step
commits. With ART_SKY_CHECKPOINT_BACKGROUND=false the write happens before the step commits, as before.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from art_sky.checkpoints import CheckpointDir, StepRecord
from art_sky.disk_full import disk_full
from art_sky.errors import ArtSkyError
from art_sky.files import TEMP_PREFIX
from art_sky.layout import STEP_RECORD

from .training.weights import ADAPTER_CONFIG, ADAPTER_WEIGHTS

log = logging.getLogger("art_sky.cluster")

ROOM_MARGIN = 1.05  # a step's files over its staged tensors: headers, the config, the record, the manifest
ROOM_SLACK = 1 << 20


class CheckpointWriteError(ArtSkyError):
    """A committed step's checkpoint could not be written (the cause says why: a full disk, permissions)."""


class Staged(Protocol):
    """A step's adapter and optimizer state, captured when it committed."""

    @property
    def nbytes(self) -> int:
        """About what its files take."""

    def write(self, directory: Path) -> None:
        """The adapter (PEFT's layout, which vLLM loads) and the optimizer's state, into `directory`."""

    def write_adapter(self, directory: Path) -> None:
        """Only the adapter."""

    def release(self) -> None:
        """The step is on disk: what holds the staged state can go."""


@dataclass
class StagedFiles:
    """A step's files, already written into a directory of their own (the trainer's ranks write them): linked into
    the checkpoint when it is written, then removed."""

    directory: Path

    @property
    def nbytes(self) -> int:
        return sum(path.stat().st_size for path in self.directory.rglob("*") if path.is_file())

    def write(self, directory: Path) -> None:
        self._link(directory, [p for p in self.directory.rglob("*") if p.is_file()])

    def write_adapter(self, directory: Path) -> None:
        self._link(directory, [self.directory / name for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG)])

    def release(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def _link(self, directory: Path, files: list[Path]) -> None:
        for source in files:
            target = directory / source.relative_to(self.directory)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source, target)  # the same disk: no copy
            except OSError:
                shutil.copy2(source, target)


@dataclass
class _Write:
    record: StepRecord
    metrics: dict[str, float] | None
    staged: Staged
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    history: list[dict] = field(default_factory=list)  # lines for history.jsonl once the step is on disk
    on_disk: bool = False

    @property
    def step(self) -> int:
        return self.record.step


class CheckpointWriter:
    """One model's checkpoint writes, one at a time, in step order."""

    def __init__(self, checkpoints: CheckpointDir, base_model: str, background: bool = True):
        self.checkpoints, self.base_model, self.background = checkpoints, base_model, background
        self._lock = threading.Lock()
        self._retrying = threading.Lock()
        self._pending: _Write | None = None  # the newest committed step until it is on disk
        self._served: dict[int, Path] = {}  # adapter copies of pending steps, written for an engine

    def write_now(self, record: StepRecord, staged: Staged, metrics: dict[str, float] | None = None) -> None:
        """Write a step before returning (registration's step 0)."""
        try:
            self._write(_Write(record, metrics, staged))
        except BaseException:
            staged.release()
            raise

    def commit(self, record: StepRecord, staged: Staged, metrics: dict[str, float] | None = None) -> None:
        """Write step `record.step`: started in the background, or (not `background`) done before returning.
        Raises, and the step must roll back, when the previous step's write fails again, when the disk has not the
        room for this one, or when a write done now fails."""
        write = _Write(record, metrics, staged)
        try:
            self.flush()
            self._check_room(staged.nbytes * ROOM_MARGIN + ROOM_SLACK)
            if not self.background:
                self._write(write)
                return
        except BaseException:
            staged.release()  # the step rolls back: nothing of it is kept
            raise
        with self._lock:
            self._pending = write
        threading.Thread(target=self._run, args=(write,), name=f"checkpoint-{self.checkpoints.name}").start()

    def flush(self) -> None:
        """Return once the pending step is on disk: a write that failed is tried once more, and raises if it fails
        again (the step stays pending). Also removes adapter copies no engine needs any more."""
        with self._lock:
            write = self._pending
        if write is not None:
            write.done.wait()
        with self._retrying:  # one retry at a time (a step's commit and a flush request may both ask)
            if write is not None and write.error is not None and not write.on_disk:
                log.info("writing step %d of %s again (it failed: %s)", write.step, self.checkpoints.name, write.error)
                try:
                    self._write(write)
                except Exception as exc:
                    raise CheckpointWriteError(
                        f"step {write.step} of {self.checkpoints.name} (trained and served) is not on disk yet: its "
                        f"checkpoint could not be written to {self.checkpoints.path} ({exc}). Fix that, then retry: "
                        "the step's request again, or the next step, writes it first"
                    ) from exc
            with self._lock:
                if write is not None and self._pending is write:
                    self._pending = None
        self._drop_served()

    def close(self) -> None:
        """The server stops: the pending step written (or what is lost said in the log)."""
        try:
            self.flush()
        except Exception as exc:  # nothing else can be done now
            log.error("the newest step of %s was not written before the server stopped: %s", self.checkpoints.name, exc)

    def durable(self, step: int) -> None:
        """Return once `step` is on disk, which a step's answer waits for (a step `train()` returned survives a kill
        of the server): its write awaited, and tried again once if it failed; raises CheckpointWriteError if that
        fails too (the step stays served and pending: a retry of its request tries the write again)."""
        with self._lock:
            write = self._pending
        if write is not None and write.step == step:
            self.flush()

    def written(self, step: int) -> bool:
        """Wait for `step`'s write: is it on disk? (False: its write failed; the next flush tries again.)"""
        with self._lock:
            write = self._pending
        if write is not None and write.step == step:
            write.done.wait()
        return self.checkpoints.manifest(step) is not None

    def append_history(self, step: int, entry: dict) -> None:
        """history.jsonl's line of step `step`: added once the step is on disk (so the history never names a step
        a killed server lost), now if it is."""
        with self._lock:
            write = self._pending
            if write is not None and write.step == step and not write.on_disk:
                write.history.append(entry)
                return
        self.checkpoints.append_history(entry)

    def record(self, step: int) -> StepRecord | None:
        """A step's record, on disk or still being written."""
        with self._lock:
            write = self._pending
        if write is not None and write.step == step:
            return write.record
        return self.checkpoints.record(step)

    def adapter_dir(self, step: int) -> Path:
        """Where an engine loads step `step`'s adapter: its checkpoint, or for a step still being written, a copy
        of its adapter written now."""
        with self._lock:
            write = self._pending
            if write is None or write.step != step or write.on_disk:
                return self.checkpoints.step_dir(step)
            if step not in self._served:
                directory = self.checkpoints.path / f"{TEMP_PREFIX}served-{step:04d}"
                shutil.rmtree(directory, ignore_errors=True)
                directory.mkdir(parents=True)
                write.staged.write_adapter(directory)
                self._served[step] = directory
            return self._served[step]

    def _run(self, write: _Write) -> None:
        try:
            self._write(write)
        except BaseException as exc:  # kept for the next step, which writes it again or fails with it
            write.error = exc
            log.warning(
                "the checkpoint of step %d of %s was not written (the next step writes it again): %s",
                write.step,
                self.checkpoints.name,
                exc,
            )
        finally:
            write.done.set()

    def _write(self, write: _Write) -> None:
        def files(tmp: Path) -> None:
            write.staged.write(tmp)
            (tmp / STEP_RECORD).parent.mkdir(exist_ok=True)
            (tmp / STEP_RECORD).write_text(write.record.model_dump_json(indent=1))

        self.checkpoints.save(write.step, files, base_model=self.base_model, metrics=write.metrics)
        write.error = None
        write.staged.release()
        with self._lock:
            write.on_disk, lines, write.history = True, write.history, []
        for entry in lines:
            try:
                self.checkpoints.append_history(entry)
            except OSError as exc:  # the record has the line: the next start adds it (model_state._complete_history)
                log.warning(
                    "history of %s: step %d's line not written yet (%s)", self.checkpoints.name, write.step, exc
                )

    def _check_room(self, needed: float) -> None:
        """Refuse a step the disk has not the room for, before it commits."""
        free = shutil.disk_usage(self.checkpoints.path).free
        if free < needed:
            full = OSError(
                errno.ENOSPC, f"No space left on device for the step's checkpoint (about {needed / 2**20:.1f} MiB)"
            )
            raise disk_full(full, self.checkpoints.path, self._advice()) or full

    def _advice(self) -> str:
        return (
            f"Delete old checkpoints of {self.checkpoints.name} in {self.checkpoints.path} (`await "
            "model.delete_checkpoints()` keeps the newest and the best) or other files on that disk, or give the "
            "machine a bigger disk; then try again."
        )

    def _drop_served(self) -> None:
        """Adapter copies of steps now on disk: the engines load those from the checkpoints."""
        with self._lock:
            done = [step for step in self._served if self._pending is None or self._pending.step != step]
            for step in done:
                shutil.rmtree(self._served.pop(step), ignore_errors=True)
