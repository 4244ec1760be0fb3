"""One writer per lineage: a lineage (project + run: its checkpoint folder and its store prefix) is written by one
server process at a time, across model names, processes, clusters of one machine and clusters sharing a store.

Three guards, taken at register, in this order, before anything is read or written:
- on this server, one model name per lineage (a second name with the same run, or a run named as another model:
  409 naming the holder);
- the lineage's folder: `lineage.lock` held for the server's life (art_sky.ownership), `owner.json` beside it
  saying who (host, pid, cluster, since when); another server's lock is a 409 naming it;
- the store: an owner record under the lineage's prefix, created with a conditional put (If-None-Match: *) and
  refreshed (If-Match) every quarter of ART_SKY_OWNER_STALE_AFTER. Another cluster's live record is a 409; a stale
  one, one of a process of this host that has ended, or one of the same cluster (SkyPilot's recovery relaunching
  it) is taken over, conditionally, so two takers cannot both win. A store without conditional writes: a warning,
  and the folder lock alone guards.
A server whose record another took over (it was stale: a long network cut) stops uploading that lineage.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from pathlib import Path

from obstore.exceptions import AlreadyExistsError, NotSupportedError, PreconditionError

from art_sky.checkpoints import model_dir
from art_sky.disk_full import disk_full
from art_sky.errors import CheckpointStoreError, ConflictError
from art_sky.layout import LINEAGE_LOCK, OWNER_FILE, model_key
from art_sky.ownership import (
    Owner,
    Unlockable,
    UnreadableOwner,
    hold,
    holds,
    parse_owner,
    read_owner,
    release,
    write_owner,
)
from art_sky.settings import Settings
from art_sky.store import CheckpointStore
from art_sky.wire import RegisterRequest

log = logging.getLogger("art_sky.cluster")

Lineage = tuple[str, str]  # (project, run)
RACES = 3  # conditional writes lost to another taker before giving up
LOCK_WAIT = 3.0  # seconds a lineage lock is tried before another server is named as its writer


def cluster_name(settings: Settings) -> str | None:
    """This server's cluster: the name art-sky gave it, else SkyPilot's (its task environment), else none."""
    if settings.cluster_name:
        return settings.cluster_name
    with contextlib.suppress(ValueError, TypeError, KeyError):
        return str(json.loads(os.environ.get("SKYPILOT_CLUSTER_INFO", ""))["cluster_name"])
    return None


class Lineages:
    """The lineages this server writes: which model name holds each, their folder locks, their store records."""

    def __init__(self, art_path: Path, settings: Settings, store: CheckpointStore | None, server: str):
        self.art_path, self.store, self.server = art_path, store, server
        self.cluster = cluster_name(settings)
        self.stale_after = settings.owner_stale_after
        self.names: dict[Lineage, str] = {}
        self.owners: dict[Lineage, Owner] = {}
        self.records: dict[Lineage, str | None] = {}  # store records held -> their version tag
        self.lost: dict[Lineage, str] = {}  # store records another server took over -> what it said
        self.conditional = True  # False once the store refused a conditional write (warned once)
        self._refresher: asyncio.Task | None = None

    def claim_name(self, body: RegisterRequest) -> None:
        """On this server, one model name per lineage: ConflictError naming the name that holds it."""
        holder = self.names.get((body.project, body.run))
        if holder is not None and holder != body.name:
            raise ConflictError(
                f"model {body.name!r} claims run {body.run!r} of project {body.project!r}, which model {holder!r} "
                "holds on this server: two names writing one lineage would overwrite each other's checkpoints and "
                f"history. Give {body.name!r} a run_name of its own (or none), or train {holder!r}"
            )
        self.names[(body.project, body.run)] = body.name

    def release_name(self, body: RegisterRequest) -> None:
        """A registration that failed: its name no longer holds the lineage."""
        if self.names.get((body.project, body.run)) == body.name:
            del self.names[(body.project, body.run)]

    async def take(self, body: RegisterRequest) -> None:
        """The lineage's folder lock, then its store record: ConflictError naming the owner when another server
        holds either (nothing taken is kept then)."""
        lineage = (body.project, body.run)
        folder = model_dir(self.art_path, *lineage)
        lock = folder / LINEAGE_LOCK
        took = not holds(lock)
        try:
            await _hold_soon(lock)
        except BlockingIOError:
            raise ConflictError(
                f"run {body.run!r} of project {body.project!r} ({folder}) is written by another art-sky server: "
                f"{read_owner(folder / OWNER_FILE)}. One server writes a lineage at a time: stop that one (`art-sky "
                "down NAME`, or kill its pid), or register this model under another run_name or project"
            ) from None
        except Unlockable as exc:
            log.warning(
                "%s: a second server writing run %r there cannot be refused. Keep the checkpoint root (--art-path) "
                "on a local disk, or start one server at a time on it",
                exc.strerror,
                body.run,
            )
        owner = self.owners.get(lineage) or Owner.me(self.cluster, self.server)
        try:
            write_owner(folder / OWNER_FILE, owner)
            if self.store is not None and self.conditional and lineage not in self.records:
                await self._take_record(lineage, owner)
        except BaseException as exc:
            if took:
                release(lock)
            if isinstance(exc, OSError) and (
                full := disk_full(
                    exc,
                    folder,
                    "Free space there (`await model.delete_checkpoints()` deletes old checkpoints) and register again.",
                )
            ):
                raise full from exc
            raise
        self.owners[lineage] = owner

    def refused(self, project: str, run: str) -> str | None:
        """Why this server must not upload the lineage (another server took its store record over), or None."""
        return self.lost.get((project, run))

    async def close(self) -> None:
        """The server stops: its store records go (the next cluster need not wait for them to go stale)."""
        if self._refresher is not None:
            self._refresher.cancel()
        for (project, run), e_tag in list(self.records.items()):
            assert self.store is not None  # records are only taken in a store
            with contextlib.suppress(CheckpointStoreError):
                found = await self.store.owner(project, run)
                if found is not None and found[1] == e_tag:  # still ours
                    await self.store.delete_owner(project, run)
        self.records.clear()

    def _where(self, lineage: Lineage) -> str:
        assert self.store is not None
        return f"{self.store.uri}/{model_key(*lineage)}/{OWNER_FILE}"

    async def _take_record(self, lineage: Lineage, owner: Owner) -> None:
        assert self.store is not None
        where = self._where(lineage)
        try:
            for _ in range(RACES):
                found = await self.store.owner(*lineage)
                try:
                    if found is None:
                        e_tag = await self.store.put_owner(*lineage, owner.model_dump_json().encode(), None)
                    else:
                        holder = self._holder(found[0], where, lineage)
                        if found[1] is None:
                            raise NotSupportedError("the store gives its objects no version tags (ETag)")
                        e_tag = await self.store.put_owner(*lineage, owner.model_dump_json().encode(), found[1])
                        log.warning("took run %r of project %r over from %s", lineage[1], lineage[0], holder)
                    # the refresh is a conditional update: a store that cannot do one says so now, not later
                    e_tag = await self.store.put_owner(*lineage, owner.model_dump_json().encode(), e_tag)
                except (AlreadyExistsError, PreconditionError):
                    continue  # another server wrote it since it was read: read it again
                self.records[lineage] = e_tag
                self.lost.pop(lineage, None)
                if self._refresher is None or self._refresher.done():
                    self._refresher = asyncio.get_running_loop().create_task(self._refresh())
                return
        except (NotImplementedError, NotSupportedError) as exc:
            self.conditional = False
            with contextlib.suppress(CheckpointStoreError):
                found = await self.store.owner(*lineage)
                if found is not None and _parsed(found[0]) == owner:  # the record made before the store said no
                    await self.store.delete_owner(*lineage)
            log.warning(
                "the checkpoint store %s refuses conditional writes (%s): a second cluster on this prefix is not "
                "refused, only this machine's folder lock guards each lineage. Point one cluster at a time at this "
                "prefix (S3, R2 and GCS take conditional writes)",
                self.store.uri,
                str(exc).splitlines()[0],
            )
            return
        except CheckpointStoreError as exc:  # as for uploads: the store's trouble is said, training goes on
            log.warning(
                "not keeping the owner record %s (only this machine's folder lock guards run %r): %s",
                where,
                lineage[1],
                exc,
            )
            return
        raise ConflictError(f"{where} kept changing while this server tried to take it: another server is taking it")

    def _holder(self, data: bytes, where: str, lineage: Lineage) -> str:
        """The record's owner, when this server may take it over (stale, ended, this process, this cluster);
        ConflictError naming it otherwise, or saying what the record is when it cannot be read."""
        try:
            holder = parse_owner(data, where)
        except UnreadableOwner as exc:
            raise ConflictError(f"run {lineage[1]!r} of project {lineage[0]!r}: {exc}") from None
        age = time.time() - holder.refreshed
        if holder.same_process() or (self.cluster and holder.cluster == self.cluster):
            return f"{holder.describe()} (the same {'process' if holder.same_process() else 'cluster'})"
        if holder.dead_here():
            return f"{holder.describe()} (a process of this host that has ended)"
        if age > self.stale_after:
            return f"{holder.describe()} (its record stale: refreshed {age:.0f} s ago)"
        raise ConflictError(
            f"run {lineage[1]!r} of project {lineage[0]!r} is written by another cluster: {holder.describe()} "
            f"(its owner record {where}, refreshed {max(age, 0):.0f} s ago). One cluster writes a lineage at a "
            f"time: stop that one (`art-sky down NAME`), or wait until its record is stale "
            f"({self.stale_after:.0f} s after it stopped: ART_SKY_OWNER_STALE_AFTER), or give this model another "
            "run_name, project or checkpoint URI"
        )

    async def _refresh(self) -> None:
        """Every quarter of the stale bound, each record this server holds says it is alive."""
        assert self.store is not None
        while self.records:
            await asyncio.sleep(self.stale_after / 4)
            for lineage, e_tag in list(self.records.items()):
                owner = self.owners[lineage].model_copy(update={"refreshed": time.time()})
                try:
                    self.records[lineage] = await self.store.put_owner(
                        *lineage, owner.model_dump_json().encode(), e_tag
                    )
                except PreconditionError:
                    found = await self.store.owner(*lineage)
                    who = _parsed(found[0]) if found else None
                    self.lost[lineage] = (
                        f"run {lineage[1]!r} of project {lineage[0]!r} was taken over in the store by "
                        f"{who.describe() if who else 'another server'} (this server's record went stale): this "
                        "server no longer uploads it, so the lineage does not fork. Stop this server"
                    )
                    log.error("%s", self.lost[lineage])
                    del self.records[lineage]
                except CheckpointStoreError as exc:
                    log.warning("could not refresh %s (tried again soon): %s", self._where(lineage), exc)


def _parsed(data: bytes) -> Owner | None:
    try:
        return parse_owner(data, "")
    except UnreadableOwner:
        return None


async def _hold_soon(lock: Path, within: float = LOCK_WAIT) -> None:
    """`hold(lock)`, tried for `within` seconds: a predecessor just killed (kill -9, an OOM kill) lets go of its
    files only once its last thread is gone, a moment after it stops running."""
    deadline = time.monotonic() + within
    while True:
        try:
            return hold(lock)
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.1)
