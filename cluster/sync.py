"""Background checkpoint sync: each new step uploads while the next rollouts run, so training never waits for the
network. Jobs run one at a time in submission order on the server's event loop, outside the device lock. A failed
upload is remembered and retried on the next flush; it stops training only in strict mode.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from art_sky.checkpoints import CheckpointDir, steps_to_keep
from art_sky.errors import CheckpointStoreError
from art_sky.redact import redact
from art_sky.store import CheckpointStore
from art_sky.wire import ModelSync, SyncStatus

log = logging.getLogger("art_sky.cluster")


class CheckpointSync:
    def __init__(self, store: CheckpointStore, strict: bool, refused: Callable[[str, str], str | None] | None = None):
        """`refused(project, run)`: why a lineage must not be uploaded (another server owns it now), or None."""
        self.store, self.strict = store, strict
        self.refused = refused or (lambda project, run: None)
        self._queue: asyncio.Queue[tuple[str, Callable[[], Awaitable[None]]]] | None = None
        self._worker: asyncio.Task | None = None
        self._pending: list[str] = []
        self._failed: dict[tuple[str, str, int], tuple[CheckpointDir, str]] = {}
        self._synced: dict[str, int] = {}
        self._uploading: dict[str, int] = {}  # model name -> the step uploading now
        self._took: dict[str, float] = {}  # model name -> seconds its last upload took
        self._bytes = 0

    def submit(self, checkpoints: CheckpointDir, step: int, written: Callable[[int], bool] | None = None) -> None:
        """Queue a step's upload (a step the store already holds costs one manifest read); `written(step)` waits
        until a step still being written is on disk (False: its write failed, the upload is retried at the next
        flush)."""

        async def upload() -> None:
            key = (checkpoints.project, checkpoints.name, step)
            if written is not None and not await asyncio.to_thread(written, step):
                self._failed[key] = (
                    checkpoints,
                    f"step {step} of {checkpoints.name} is not on disk yet (its "
                    "checkpoint could not be written: see the server log)",
                )
                return
            if reason := self.refused(checkpoints.project, checkpoints.name):
                self._failed[key] = (checkpoints, reason)
                return
            if checkpoints.manifest(step) is None:  # deleted locally since (retention): nothing to keep
                self._failed.pop(key, None)
                return
            self._uploading[checkpoints.name] = step
            began = time.monotonic()
            try:
                self._bytes += await self.store.upload_step(checkpoints, step)
                await self.store.upload_history(checkpoints)
            except Exception as exc:  # reported through status(); the server keeps training
                message = str(exc) if isinstance(exc, CheckpointStoreError) else f"{type(exc).__name__}: {exc}"
                message = redact(
                    f"step {step} of {checkpoints.name} was not uploaded to {self.store.where(*key)}: {message}"
                )
                log.warning("%s", message)
                self._failed[key] = (checkpoints, message)
                return
            finally:
                self._uploading.pop(checkpoints.name, None)
            self._failed.pop(key, None)
            self._synced[checkpoints.name] = max(step, self._synced.get(checkpoints.name, -1))
            self._took[checkpoints.name] = time.monotonic() - began
            log.info("uploaded %s in %.1f s", self.store.where(*key), self._took[checkpoints.name])

        self._put(f"upload {checkpoints.name} step {step}", upload)

    def submit_retention(
        self,
        checkpoints: CheckpointDir,
        best_metric: str | None,
        keep_last: int,
        current: int,
        keep_steps: list[int] | None = None,
    ) -> None:
        """Apply `delete_checkpoints` to the store too: keep the newest `keep_last`, the best, and `current`
        (or exactly `keep_steps` and `current`)."""

        async def prune() -> None:
            try:
                steps = [m.step for m in await self.store.manifests(checkpoints.project, checkpoints.name)]
                keep = (
                    set(keep_steps)
                    if keep_steps is not None
                    else steps_to_keep(steps, checkpoints.history(), best_metric, keep_last)
                ) | {current}
                await self.store.delete_steps(
                    checkpoints.project, checkpoints.name, [s for s in steps if s not in keep]
                )
            except CheckpointStoreError as exc:
                log.warning("retention in the store failed: %s", exc)

        self._put(f"prune {checkpoints.name}", prune)

    async def flush(self) -> SyncStatus:
        """Retry failed uploads, then wait until nothing is queued."""
        for (_, _, step), (checkpoints, _) in list(self._failed.items()):
            self.submit(checkpoints, step)
        if self._queue is not None:
            await self._queue.join()
        return self.status()

    def blocking_error(self) -> str | None:
        """In strict mode, why training must not go on (a step failed to upload); None otherwise."""
        if self.strict and self._failed:
            return (
                "; ".join(message for _, message in self._failed.values()) + " (strict mode, "
                "ART_SKY_CHECKPOINT_STRICT): fix the store, then `await backend.flush_checkpoints()`"
            )
        return None

    def status(self) -> SyncStatus:
        return SyncStatus(
            uri=self.store.uri,
            strict=self.strict,
            pending=list(self._pending),
            errors=[message for _, message in self._failed.values()],
            synced=dict(self._synced),
            bytes_uploaded=self._bytes,
        )

    def model_sync(self, name: str) -> ModelSync:
        """Where one model's checkpoints stand in the store (`art-sky status`)."""
        failed = [message for (_, model, _), (_, message) in self._failed.items() if model == name]
        if failed:
            state, detail = "failed", failed[-1]
        elif name in self._uploading:
            state, detail = "uploading", f"step {self._uploading[name]} to {self.store.uri}"
        elif name in self._took:
            state, detail = "idle", f"{self.store.uri}, last upload took {self._took[name]:.1f} s"
        else:
            state, detail = "idle", self.store.uri
        return ModelSync(state=state, step=self._synced.get(name), detail=detail)

    def _put(self, label: str, job: Callable[[], Awaitable[None]]) -> None:
        if self._queue is None:  # created on the server's running loop at first use
            self._queue = asyncio.Queue()
            self._worker = asyncio.get_running_loop().create_task(self._work())
        self._pending.append(label)
        self._queue.put_nowait((label, job))

    async def _work(self) -> None:
        queue = self._queue
        assert queue is not None  # `_put` makes the queue before it starts this worker
        while True:
            label, job = await queue.get()
            try:
                await job()
            except Exception:  # a bug in a job must not stop the worker
                log.exception("checkpoint sync job %r failed", label)
            finally:
                self._pending.remove(label)
                queue.task_done()
