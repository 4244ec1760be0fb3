"""Records of the clusters `art-sky up` (or `initialize_cluster`) started, so `attach`, `down`, `status`, `logs`,
`tunnel` and `ssh` find them.

One 0600 JSON file per cluster, `<ART_SKY_HOME>/clusters/<name>.json`: its kind and machine, the server's files
there (art_sky.layout), port and pid, and its API key (which is why the file is private; it is never printed by
`str()`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, SecretStr, field_serializer

from art_sky.errors import ConfigError
from art_sky.files import atomic_write
from art_sky.layout import ServerLayout
from art_sky.provisioners.sky_task import ClusterSpec
from art_sky.remote.ssh import SSHTarget

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
Kind = Literal["local", "ssh", "sky"]


class RecoveryStatus(BaseModel):
    """What a SkyPilot cluster's recovery is doing or did (art_sky/backends/recovery.py), written by the process
    whose loop runs it: `art-sky status` shows `recovering` while that process lives."""

    state: Literal["recovering", "recovered", "failed"]
    reason: str  # what SkyPilot said became of the cluster, or why recovery failed
    since: float  # unix time the cluster was found lost
    pid: int  # the process recovering it
    recoveries: int = 0
    downtime_s: float = 0.0  # every recovery's, from the loss to the loop going on
    steps_replayed: int = 0
    lost_gpu_hours: float = 0.0


class ClusterRecord(BaseModel):
    name: str
    kind: Kind  # how the machine was obtained: this one, a host you named, SkyPilot
    where: str  # the machine, in words
    target: SSHTarget | None  # None: this machine
    layout: ServerLayout  # the server's files on the machine
    port: int  # the server's port on the machine
    pid: int
    api_key: SecretStr
    spec: ClusterSpec | None = None  # a SkyPilot cluster's task as asked (its secrets too): what a relaunch launches
    recover: bool | Literal["from-scratch"] = False  # a SkyPilot cluster is relaunched when it is lost
    server_job: int | None = None  # the SkyPilot job that runs the server (another one: it was relaunched)
    recovery: RecoveryStatus | None = None

    @field_serializer("api_key", when_used="json")
    def _reveal(self, value: SecretStr) -> str:
        return value.get_secret_value()


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ConfigError(f"cluster name {name!r}: use letters, digits, '.', '_' and '-' (at most 63)")
    return name


def record_path(home: Path, name: str) -> Path:
    return home / "clusters" / f"{check_name(name)}.json"


def save(home: Path, record: ClusterRecord) -> Path:
    """Write atomically, readable by this user only."""
    path = record_path(home, record.name)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    return atomic_write(path, record.model_dump_json(indent=2), private=True)


def load(home: Path, name: str) -> ClusterRecord:
    path = record_path(home, name)
    if not path.is_file():
        raise unknown(home, name)
    try:
        return ClusterRecord.model_validate_json(path.read_text())
    except ValueError as exc:
        raise ConfigError(
            f"the record {path} is not one this art-sky can read ({str(exc).splitlines()[0]}): stop "
            f"that server by hand and delete the file"
        ) from exc


def unknown(home: Path, name: str) -> ConfigError:
    """The error for a name with no record: which names there are, and how to start this one."""
    known = ", ".join(all_names(home)) or "none"
    return ConfigError(f"no cluster named {name!r} (known: {known}): start one with `art-sky up {name}`")


def remove(home: Path, name: str) -> None:
    record_path(home, name).unlink(missing_ok=True)


def stopped_path(home: Path, name: str) -> Path:
    """Where `down` keeps a stopped cluster's record while it left files on its machine, for `down --purge`."""
    return home / "clusters" / "down" / f"{check_name(name)}.json"


def save_stopped(home: Path, record: ClusterRecord) -> None:
    path = stopped_path(home, record.name)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write(path, record.model_dump_json(indent=2), private=True)


def load_stopped(home: Path, name: str) -> ClusterRecord:
    """The record of a stopped cluster whose files stay on its machine; the unknown-name error if there is none."""
    path = stopped_path(home, name)
    try:
        return ClusterRecord.model_validate_json(path.read_text())
    except (OSError, ValueError):
        raise unknown(home, name) from None


def forget_stopped(home: Path, name: str) -> None:
    stopped_path(home, name).unlink(missing_ok=True)


def all_names(home: Path) -> list[str]:
    folder = home / "clusters"
    return sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []
