"""The checkpoint store: the local checkpoint layout mirrored in object storage (S3, R2, GCS or a directory).

obstore (Rust's `object_store`) does the transfers: native async, multipart uploads and ranged downloads in
parallel, one API for every cloud. A step's files go up first and its `manifest.json` last, so a step is visible
(listed, restorable) only once it is complete; a download lands only after every file matches the manifest.
Keys are the checkpoint layout's (art_sky.layout) under the URI's prefix, as on disk.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlparse

import obstore
from obstore.exceptions import (
    AlreadyExistsError,
    BaseError,
    NotSupportedError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
)
from obstore.store import GCSStore, LocalStore, S3Store

from art_sky.checkpoints import CheckpointDir, CorruptCheckpointError, Manifest
from art_sky.errors import CheckpointStoreError, ConfigError
from art_sky.files import atomic_dir
from art_sky.layout import HISTORY, MANIFEST, OWNER_FILE, model_key, step_key, step_name
from art_sky.redact import SECRET_VARIABLES, add_secrets, redact
from art_sky.settings import Settings

if TYPE_CHECKING:  # obstore's typed dicts exist only in its stubs
    from obstore._put import PutMode
    from obstore.store import ClientConfig, S3Config

log = logging.getLogger("art_sky.store")

CHUNK = 8 * 1024 * 1024  # multipart part size and download range size (awscli's and boto3's default too)
CONCURRENCY = 10  # requests in flight per file
Progress = Callable[[int], None]  # told the bytes just transferred
T = TypeVar("T")


class CheckpointStore:
    """Checkpoints of every project and model under one URI: list, upload, verified download, delete."""

    def __init__(self, uri: str, *, endpoint: str | None = None, credentials: dict[str, str] | None = None):
        """`credentials`: the store's variables (AWS_*, GOOGLE_*; Settings.store_credentials) over the environment's."""
        self.uri = uri.rstrip("/")
        add_secrets((credentials or {}).get(name) or os.environ.get(name) for name in SECRET_VARIABLES)
        self._store = _open(self.uri, endpoint, credentials or {})

    @classmethod
    def from_settings(cls, settings: Settings) -> CheckpointStore | None:
        """The store ART_SKY_CHECKPOINT_URI names, or None when checkpoints stay on the cluster only."""
        if not settings.checkpoint_uri:
            return None
        return cls(
            settings.checkpoint_uri, endpoint=settings.checkpoint_endpoint, credentials=settings.store_credentials
        )

    def where(self, project: str, name: str, step: int | None = None) -> str:
        """The URI of a model's checkpoints, or of one step, for messages and listings."""
        base = f"{self.uri}/{model_key(project, name)}/checkpoints"
        return base if step is None else f"{base}/{step_name(step)}"

    async def check(self) -> None:
        """Fail early, naming the URI, when the bucket is missing or the credentials are refused."""
        await self._call("list the store", obstore.list_with_delimiter_async(self._store, None))

    async def models(self) -> list[tuple[str, str]]:
        """(project, model) pairs that have anything stored."""
        found = []
        top = await self._call("list the store", obstore.list_with_delimiter_async(self._store, None))
        for project in top["common_prefixes"]:
            project = project.rstrip("/").rsplit("/", 1)[-1]
            listing = await self._call(
                "list models", obstore.list_with_delimiter_async(self._store, model_key(project, ""))
            )
            found += [(project, name.rstrip("/").rsplit("/", 1)[-1]) for name in listing["common_prefixes"]]
        return sorted(found)

    async def manifests(self, project: str, name: str) -> list[Manifest]:
        """Manifests of the complete steps (those whose manifest is there), oldest first."""
        listing = await self._call(
            "list checkpoints",
            obstore.list_with_delimiter_async(self._store, f"{model_key(project, name)}/checkpoints/"),
        )
        steps = [int(p) for p in (p.rstrip("/").rsplit("/", 1)[-1] for p in listing["common_prefixes"]) if p.isdigit()]
        found = await asyncio.gather(*(self.manifest(project, name, step) for step in sorted(steps)))
        return [manifest for manifest in found if manifest is not None]

    async def manifest(self, project: str, name: str, step: int) -> Manifest | None:
        """A step's manifest; None when the step is absent, partial, or its manifest unreadable."""
        data = await self._get_optional(f"{step_key(project, name, step)}/{MANIFEST}", "read a manifest")
        try:
            return None if data is None else Manifest.model_validate_json(data)
        except ValueError:
            log.warning("ignoring %s: its manifest is not valid JSON", self.where(project, name, step))
            return None

    async def upload_step(self, checkpoints: CheckpointDir, step: int, progress: Progress | None = None) -> int:
        """Upload a local step, manifest last; returns the bytes sent (0 when the store already has it)."""
        local = checkpoints.manifest(step)
        if local is None:
            raise CheckpointStoreError(f"step {step} of {checkpoints.path} has no manifest: nothing to upload")
        key = step_key(checkpoints.project, checkpoints.name, step)
        remote = await self.manifest(checkpoints.project, checkpoints.name, step)
        if remote == local:
            return 0
        if remote is not None:  # a different step of the same number: hide the old one while it is replaced
            await self._call("delete a manifest", obstore.delete_async(self._store, f"{key}/{MANIFEST}"))
        step_dir = checkpoints.step_dir(step)
        report = progress or (lambda n: None)
        await asyncio.gather(*(self._put_file(f"{key}/{rel}", step_dir / rel, report) for rel in local.files))
        await self._call(
            "upload a manifest", obstore.put_async(self._store, f"{key}/{MANIFEST}", (step_dir / MANIFEST).read_bytes())
        )
        return local.size_bytes

    async def download_step(
        self, project: str, name: str, step: int, dest: Path, progress: Progress | None = None
    ) -> Manifest:
        """Download a step into `dest` (created whole or not at all), every file checked against the manifest.

        Raises CorruptCheckpointError when a file is missing or differs, CheckpointStoreError when the store fails.
        """
        where = self.where(project, name, step)
        manifest = await self.manifest(project, name, step)
        if manifest is None:
            raise CheckpointStoreError(
                f"{where} is not in the store (no manifest): `art-sky checkpoints ls` lists the steps there"
            )
        key = step_key(project, name, step)
        with atomic_dir(dest) as tmp:
            report = progress or (lambda n: None)
            digests = await asyncio.gather(
                *(
                    self._get_file(f"{key}/{rel}", tmp / rel, entry.size, where, report)
                    for rel, entry in manifest.files.items()
                )
            )
            for (rel, entry), digest in zip(manifest.files.items(), digests, strict=False):
                if digest != entry.sha256:
                    raise CorruptCheckpointError(
                        f"{where}/{rel} does not match its manifest (sha256 differs): the "
                        "stored step is corrupt; `art-sky checkpoints rm` deletes it"
                    )
            (tmp / MANIFEST).write_text(manifest.model_dump_json(indent=2))
        return manifest

    async def restore(self, checkpoints: CheckpointDir) -> int | None:
        """Download the newest step that verifies (and the history); corrupt steps are skipped with a warning."""
        restored = None
        for manifest in reversed(await self.manifests(checkpoints.project, checkpoints.name)):
            try:
                await self.download_step(
                    checkpoints.project, checkpoints.name, manifest.step, checkpoints.step_dir(manifest.step)
                )
            except CorruptCheckpointError as exc:
                log.warning("skipping step %d: %s", manifest.step, exc)
                continue
            restored = manifest.step
            break
        history = checkpoints.model_dir / HISTORY
        data = await self._get_optional(
            f"{model_key(checkpoints.project, checkpoints.name)}/{HISTORY}", "read the history"
        )
        if data is not None and not history.exists():
            history.parent.mkdir(parents=True, exist_ok=True)
            history.write_bytes(data)
        return restored

    async def upload_history(self, checkpoints: CheckpointDir) -> None:
        """Mirror history.jsonl (the metrics retention by a metric needs on a fresh cluster)."""
        history = checkpoints.model_dir / HISTORY
        if history.exists():
            await self._call(
                "upload the history",
                obstore.put_async(
                    self._store, f"{model_key(checkpoints.project, checkpoints.name)}/{HISTORY}", history.read_bytes()
                ),
            )

    async def history(self, project: str, name: str) -> bytes | None:
        return await self._get_optional(f"{model_key(project, name)}/{HISTORY}", "read the history")

    async def delete_steps(self, project: str, name: str, steps: list[int]) -> None:
        """Delete steps, manifest first so a half-deleted step is never listed as complete."""
        for step in steps:
            key = step_key(project, name, step)
            await self._delete_optional(f"{key}/{MANIFEST}")
            listing = await self._call("list a step", obstore.list(self._store, f"{key}/").collect_async())
            paths = [entry["path"] for entry in listing]
            if paths:
                await self._call("delete a step", obstore.delete_async(self._store, paths))

    async def owner(self, project: str, run: str) -> tuple[bytes, str | None] | None:
        """A lineage's owner record (cluster/lineage.py) and its version tag; None when there is none."""
        key = f"{model_key(project, run)}/{OWNER_FILE}"
        try:
            result = await obstore.get_async(self._store, key)
            return bytes(await result.bytes_async()), result.meta["e_tag"]
        except FileNotFoundError as exc:
            if _absent(exc):
                return None
            raise self._error("read an owner record", exc) from exc
        except BaseError as exc:
            raise self._error("read an owner record", exc) from exc

    async def put_owner(self, project: str, run: str, data: bytes, e_tag: str | None) -> str | None:
        """Write a lineage's owner record only over what was read: nothing (`e_tag` None: If-None-Match: *) or that
        version (If-Match). obstore's AlreadyExistsError / PreconditionError: another writer came first;
        NotImplementedError / NotSupportedError: the store has no conditional writes."""
        mode: PutMode = "create" if e_tag is None else {"e_tag": e_tag}
        try:
            put = await obstore.put_async(self._store, f"{model_key(project, run)}/{OWNER_FILE}", data, mode=mode)
        except (AlreadyExistsError, PreconditionError, NotSupportedError):
            raise
        except BaseError as exc:
            raise self._error("write an owner record", exc) from exc
        return put["e_tag"]

    async def delete_owner(self, project: str, run: str) -> None:
        await self._delete_optional(f"{model_key(project, run)}/{OWNER_FILE}")

    async def _put_file(self, key: str, path: Path, progress: Progress) -> None:
        await self._call(
            "upload",
            obstore.put_async(self._store, key, _blocks(path, progress), chunk_size=CHUNK, max_concurrency=CONCURRENCY),
        )

    async def _get_file(self, key: str, path: Path, size: int, where: str, progress: Progress) -> str:
        """Ranged GETs in parallel, written and hashed in order as they arrive; returns the sha256.

        A missing or resized object is corruption. At most CONCURRENCY ranges are in flight or waiting to be
        hashed, so memory stays bounded whatever the file size.
        """
        try:
            meta = await obstore.head_async(self._store, key)
        except FileNotFoundError as exc:
            if not _absent(exc):
                raise self._error("download", exc) from exc
            raise CorruptCheckpointError(
                f"{where} is incomplete: {key.rsplit('/', 1)[-1]} is missing from the "
                "store; `art-sky checkpoints rm` deletes the step"
            ) from None
        except BaseError as exc:
            raise self._error("download", exc) from exc
        if meta["size"] != size:
            raise CorruptCheckpointError(
                f"{where}: {key.rsplit('/', 1)[-1]} has {meta['size']} bytes in the store, "
                f"its manifest says {size}; `art-sky checkpoints rm` deletes the step"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        window: deque[asyncio.Future] = deque()
        with open(path, "wb") as handle:

            def keep(data) -> None:  # in a worker thread: file writes and hashing release the GIL
                handle.write(memoryview(data))
                digest.update(memoryview(data))

            async def fetch(start: int):
                return await self._call(
                    "download", obstore.get_range_async(self._store, key, start=start, end=min(start + CHUNK, size))
                )

            async def take_oldest() -> None:
                data = await window.popleft()
                await asyncio.to_thread(keep, data)
                progress(len(data))

            try:
                for start in range(0, size, CHUNK):
                    window.append(asyncio.ensure_future(fetch(start)))
                    if len(window) >= CONCURRENCY:
                        await take_oldest()
                while window:
                    await take_oldest()
            finally:
                for task in window:
                    task.cancel()
        return digest.hexdigest()

    async def _get_optional(self, key: str, action: str) -> bytes | None:
        try:
            result = await obstore.get_async(self._store, key)
            return bytes(await result.bytes_async())
        except FileNotFoundError as exc:
            if _absent(exc):
                return None
            raise self._error(action, exc) from exc
        except BaseError as exc:
            raise self._error(action, exc) from exc

    async def _delete_optional(self, key: str) -> None:
        try:
            await obstore.delete_async(self._store, key)
        except FileNotFoundError as exc:
            if not _absent(exc):
                raise self._error("delete", exc) from exc
        except BaseError as exc:
            raise self._error("delete", exc) from exc

    async def _call(self, action: str, awaitable: Awaitable[T]) -> T:
        try:
            return await awaitable
        except (BaseError, FileNotFoundError) as exc:
            raise self._error(action, exc) from exc

    def _error(self, action: str, exc: Exception) -> CheckpointStoreError:
        """Say what the store refused and what to do, naming the URI (never the credentials)."""
        text = str(_scrubbed(exc))
        match = re.search(r"<Code>([^<]+)</Code>", text)
        code = match.group(1) if match else ""
        misconfigured = True
        if code == "NoSuchBucket":
            bucket = "/".join(self.uri.split("/")[:3])
            make = "gcloud storage buckets create" if bucket.startswith("gs://") else "aws s3 mb"
            hint = (
                f"the bucket does not exist: create it (`{make} {bucket}`), or fix the bucket's name in the URI "
                "(ART_SKY_CHECKPOINT_URI)"
            )
        elif missing := _missing_credentials(text, self.uri):
            hint = missing
        elif code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken") or isinstance(
            exc, UnauthenticatedError
        ):
            hint = (
                f"the credentials were refused ({code or type(exc).__name__}): check AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (GOOGLE_SERVICE_ACCOUNT for gs://)"
            )
        elif code == "AccessDenied" or isinstance(exc, PermissionDeniedError):
            hint = (
                "access denied: the credentials need permission to read, write, list and delete objects under "
                "this prefix"
            )
        else:
            hint, misconfigured = text.split("\n", 1)[0][:300], False
        return CheckpointStoreError(redact(f"checkpoint store {self.uri}: cannot {action}: {hint}"), misconfigured)


def _scrubbed(exc: Exception) -> Exception:
    """`exc` with its text redacted in place: obstore's errors quote the endpoint URL, password and all, and the
    error stays the cause of art-sky's (a traceback prints it)."""
    exc.args = tuple(redact(a) if isinstance(a, str) else a for a in exc.args)
    return exc


def _blocks(path: Path, progress: Progress) -> Iterator[bytes]:
    """A file as CHUNK-sized blocks for obstore's multipart upload, reporting each block as it is handed over.

    (Measured on SeaweedFS: as fast as handing obstore the path, and faster than a file object.)
    """
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            progress(len(block))
            yield block


def _absent(exc: FileNotFoundError) -> bool:
    """obstore raises FileNotFoundError for a missing object and for a missing bucket; only the first is absence."""
    return "NoSuchBucket" not in str(exc)


def _open(uri: str, endpoint: str | None, credentials: dict[str, str]):
    """The obstore store a URI names; ConfigError for a URI art-sky cannot use."""
    parsed = urlparse(uri)
    usage = "use s3://bucket/prefix (AWS, R2, S3-compatible), gs://bucket/prefix or file:///absolute/path"
    if parsed.scheme not in ("s3", "gs", "file"):
        raise ConfigError(f"checkpoint store URI {uri!r} has an unknown scheme {parsed.scheme!r}: {usage}")
    try:
        if parsed.scheme == "file":
            if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
                raise ConfigError(f"checkpoint store URI {uri!r} is not an absolute file:/// path: {usage}")
            return LocalStore(prefix=Path(parsed.path), mkdir=True, automatic_cleanup=True)
        if not parsed.netloc:
            raise ConfigError(f"checkpoint store URI {uri!r} names no bucket: {usage}")
        prefix = parsed.path.strip("/") or None
        if parsed.scheme == "gs":
            google = {k: v for k, v in credentials.items() if k.startswith("GOOGLE_")}
            # obstore takes its environment variables' names as config keys; its stubs list only the short ones
            return GCSStore(parsed.netloc, prefix=prefix, config=google)  # type: ignore[arg-type]
        endpoint = endpoint or credentials.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
        options: S3Config = {"endpoint": endpoint} if endpoint else {}
        client: ClientConfig | None = {"allow_http": True} if endpoint and endpoint.startswith("http://") else None
        config = {k: v for k, v in credentials.items() if k.startswith("AWS_") and k != "AWS_ENDPOINT_URL"}
        # obstore takes its environment variables' names as config keys (its stubs list only the short ones), and
        # its stubs' S3Config holds `bucket`, so any **S3Config reads as a second bucket
        return S3Store(parsed.netloc, prefix=prefix, client_options=client, config=config, **options)  # type: ignore[arg-type, misc]
    except (BaseError, OSError) as exc:
        missing = _missing_credentials(redact(str(exc)), uri)
        raise CheckpointStoreError(
            redact(f"checkpoint store {uri}: cannot open it: {missing or str(exc).splitlines()[0]}"), bool(missing)
        ) from _scrubbed(exc)


# obstore's words for a credential it lacks -> the variable that gives it and the one beside it
_MISSING = {
    "Missing SecretAccessKey": ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID"),
    "Missing AccessKeyId": ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
}
_METADATA = "169.254.169.254"  # the cloud's instance metadata service: obstore's last resort when no key is set
_WHERE = "in the environment or .env where you start art-sky, which forwards them to the cluster"


def _missing_credentials(text: str, uri: str) -> str | None:
    """What obstore's error says is missing, by the variables that give it; None when it is something else."""
    for words, (variable, beside) in _MISSING.items():
        if words in text:
            return f"{variable} is not set, though {beside} is: set both ({_WHERE})"
    if _METADATA not in text:
        return None
    if uri.startswith("gs://"):
        return (
            "no Google Cloud credentials: GOOGLE_SERVICE_ACCOUNT (a service account key file) or "
            f"GOOGLE_SERVICE_ACCOUNT_KEY (its JSON) is not set ({_WHERE}), and this machine has no service "
            "account of its own (its metadata server refused)"
        )
    return (
        f"no S3 credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are not set ({_WHERE}), and this machine "
        "has no instance role to fall back on (its metadata service refused)"
    )


def server_env(settings: Settings, uri: str | None = None) -> dict[str, str]:
    """What a cluster server needs to sync checkpoints to `uri` (default: the settings' ART_SKY_CHECKPOINT_URI): the
    URI, the store's settings and the credentials set here (environment or .env). Every backend forwards this same
    environment. Empty when no store is configured; a malformed URI fails here, not in a remote server's log."""
    uri = uri or settings.checkpoint_uri
    if not uri:
        return {}
    CheckpointStore(uri, endpoint=settings.checkpoint_endpoint, credentials=settings.store_credentials)
    env = {"ART_SKY_CHECKPOINT_URI": uri, "ART_SKY_CHECKPOINT_STRICT": str(settings.checkpoint_strict).lower()}
    if settings.checkpoint_endpoint:
        env["ART_SKY_CHECKPOINT_ENDPOINT"] = settings.checkpoint_endpoint
    return env | settings.store_credentials
