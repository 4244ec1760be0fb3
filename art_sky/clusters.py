"""Records of the clusters `art-sky up` started, so `down`, `status`, `logs`, `tunnel` and `ssh` find them.

One 0600 JSON file per cluster, `<ART_SKY_HOME>/clusters/<name>.json`: the SSH target (none for this machine),
the server's directory and port there, and its API key (which is why the file is private; it is never printed
by `str()`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, SecretStr, field_serializer

from art_sky.errors import ConfigError
from art_sky.provisioners import SSHTarget
from art_sky.settings import settings

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class ClusterRecord(BaseModel):
    name: str
    kind: Literal["ssh", "sky", "local"] = "ssh"  # how the machine was obtained: a host you named, SkyPilot, this one
    target: SSHTarget | None  # None: this machine
    remote_dir: str  # absolute, on the machine (the bootstrap layout: run/server.pid, run/port.json, run/server.log)
    port: int  # the server's port on the machine
    pid: int
    api_key: SecretStr

    @property
    def where(self) -> str:
        if self.kind == "sky":
            return f"SkyPilot cluster {self.name}"
        return str(self.target) if self.target else "this machine"

    @field_serializer("api_key", when_used="json")
    def _reveal(self, value: SecretStr) -> str:
        return value.get_secret_value()


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ConfigError(f"cluster name {name!r}: use letters, digits, '.', '_' and '-' (at most 63)")
    return name


def record_path(name: str) -> Path:
    return settings().home / "clusters" / f"{check_name(name)}.json"


def save(record: ClusterRecord) -> Path:
    """Write atomically, readable by this user only."""
    path = record_path(record.name)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # also when a stale temp file was there
    with os.fdopen(fd, "w") as file:
        file.write(record.model_dump_json(indent=2))
    tmp.replace(path)
    return path


def load(name: str) -> ClusterRecord:
    path = record_path(name)
    if not path.is_file():
        known = ", ".join(all_names()) or "none"
        raise ConfigError(f"no cluster named {name!r} (known: {known}): start one with `art-sky up --name {name}`")
    return ClusterRecord.model_validate_json(path.read_text())


def remove(name: str) -> None:
    record_path(name).unlink(missing_ok=True)


def all_names() -> list[str]:
    folder = settings().home / "clusters"
    return sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []
