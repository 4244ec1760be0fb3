"""Render SkyPilot tasks from the shipped templates (the cluster server: templates/cluster.yaml; a CI job:
templates/ci-job.yaml) and check them with SkyPilot's own schema. Configuration stays data: each template is a plain
SkyPilot task YAML that `sky launch` accepts as it is; rendering only sets fields on it.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
from importlib import resources as package_files
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

import art_sky
from art_sky.errors import ConfigError

SERVER_DIR = "art-sky"  # the server's directory under the job's HOME (run/, art/, venv/): templates/cluster.yaml
WHEEL_DIR = f"~/{SERVER_DIR}/dist"  # where the shipped wheel lands on the cluster (the template's setup reads it)
# Where the server's secrets land on the cluster (templates/cluster.yaml's scripts source it): a file, not SkyPilot
# task secrets, which show in the node's process command lines, its shell history and SkyPilot's job file.
SECRETS_FILE = f"~/{SERVER_DIR}/secrets.env"
CI_SECRETS_FILE = "~/.art-sky-ci/secrets.env"  # a CI job's --env-file (templates/ci-job.yaml), outside its workdir
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ClusterSpec(BaseModel):
    """What the user asks of the cluster; every field maps onto the task YAML."""

    model_config = ConfigDict(extra="forbid")

    gpu: str | list[str] | None = Field(
        "H100:1", description="an accelerator, or an ordered fallback list; None runs the portable engine on CPUs"
    )
    infra: str | None = Field(None, description="SkyPilot's infra: aws, gcp/us-central1, k8s/<context>, slurm/<name>")
    num_nodes: int = Field(
        1,
        ge=1,
        description="nodes: the server on the head, a replica and trainer ranks on every node (templates/cluster.yaml)",
    )
    resources: dict[str, Any] = Field(
        default_factory=dict, description="more SkyPilot resource fields (cpus, memory, disk_size, region, ...)"
    )
    spot: bool = False
    autostop_minutes: int | None = Field(
        60, description="tear the cluster down after this many idle minutes; None keeps it up"
    )
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for the server (ART_SKY_*)")
    secrets: dict[str, str] = Field(
        default_factory=dict, description="environment for the server (store keys), sent in a 0600 file"
    )
    python: str | None = Field(None, description="a Python on the cluster with art-sky installed: skip the install")
    version: str | None = Field(None, description="install art-sky==version from PyPI instead of a shipped wheel")
    wheel: Path | None = Field(None, description="the art-sky wheel to ship and install")
    template: Path | None = Field(None, description="your own task YAML instead of templates/cluster.yaml")
    overrides: dict[str, Any] = Field(default_factory=dict, description="merged into the task last; None deletes")

    @field_validator("gpu")
    @classmethod
    def _gpu_not_empty(cls, gpu):
        if isinstance(gpu, list) and not gpu:
            raise ValueError("an empty GPU list: give one accelerator, a list to try in order, or None for CPUs")
        return gpu


class CIJobSpec(BaseModel):
    """One CI job (`art-sky ci run`): the command, where it runs, and its safety net."""

    model_config = ConfigDict(extra="forbid")

    command: str = Field(description="a shell command line, run in the synced work dir")
    setup: str = Field("", description="a shell command run before it (installs); timed as setup")
    workdir: Path = Field(description="synced to the cluster (SkyPilot honours .skyignore, else .gitignore)")
    timeout_s: int = Field(gt=0, description="the node kills setup and command after this many seconds each")
    gpu: str | list[str] | None = None
    infra: str | None = None
    resources: dict[str, Any] = Field(default_factory=dict)
    spot: bool = False
    autodown_minutes: int | None = Field(
        description="the cluster tears itself down after this many idle minutes (the safety net); None: no net"
    )
    secrets: dict[str, str] = Field(
        default_factory=dict, description="environment for the command (--env-file), sent in a 0600 file"
    )


def parse_gpus(values: list[str]) -> str | list[str] | None:
    """`--gpu A --gpu B,C` into SkyPilot's fallback list (one accelerator alone); `none` alone for CPUs only."""
    gpus = [g.strip() for value in values for g in value.split(",") if g.strip()]
    if [g.lower() for g in gpus] == ["none"]:
        return None
    if not gpus or "none" in (g.lower() for g in gpus):
        raise ConfigError("--gpu: give accelerators (H100:1, A100-80GB:1, ...) or `none` alone for CPUs")
    return gpus[0] if len(gpus) == 1 else gpus


def load_template(path: Path | None = None, shipped: str = "cluster.yaml") -> dict[str, Any]:
    """The user's template, or the shipped one."""
    import yaml  # comes with the `sky` extra

    try:
        text = path.read_text() if path else (package_files.files("art_sky.templates") / shipped).read_text()
        config = yaml.safe_load(text)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read the task template {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"the task template {path} is not a YAML mapping: start from templates/cluster.yaml")
    return config


def write_secrets(path: Path, values: dict[str, str]) -> Path:
    """`values` as a shell file (KEY='value' lines, for `set -a; . file`) that only its owner can read: 0600 from
    its first byte. Put it in a private folder outside any synced workdir (a `tempfile.mkdtemp`)."""
    bad = sorted(k for k in values if not _NAME.fullmatch(k))
    if bad:
        raise ConfigError(f"secret names must be environment variable names (A-Z, 0-9, _): fix {', '.join(bad)}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a file that was there keeps its old mode under O_CREAT
    with os.fdopen(fd, "w") as file:
        file.writelines(f"{k}={shlex.quote(v)}\n" for k, v in sorted(values.items()))
    return path


def render_task(spec: ClusterSpec, api_key: SecretStr, secrets_file: Path) -> dict[str, Any]:
    """The task config dict for `sky.Task.from_yaml_config`. The API key and `spec.secrets` are written to
    `secrets_file` (0600), which the task mounts at SECRETS_FILE: keep it until the launch returns."""
    config = load_template(spec.template)
    resources = _set_resources(config, spec.gpu, spec.infra, spec.spot, spec.autostop_minutes, spec.resources)
    if spec.gpu is None:
        resources.pop("disk_size", None)  # a CPU server needs no room for vLLM and big models

    envs = config.setdefault("envs", {}) or {}
    config["envs"] = envs
    envs["ART_SKY_EXTRA"] = "gpu" if spec.gpu is not None else "cluster"
    envs["ART_SKY_PYTHON"] = spec.python or ""
    envs["ART_SKY_VERSION"] = spec.version or ""
    envs["ART_SKY_WHEEL"] = ""
    if spec.python is None and spec.version is None:
        if spec.wheel is None:
            raise ConfigError(
                "nothing to install on the cluster: give a wheel, an art-sky version, or a prepared "
                "Python (ART_SKY_REMOTE_PYTHON)"
            )
        envs["ART_SKY_WHEEL"] = spec.wheel.name
        config.setdefault("file_mounts", {})[f"{WHEEL_DIR}/{spec.wheel.name}"] = str(spec.wheel)
    envs.update(spec.env)
    if spec.num_nodes > 1:
        config["num_nodes"] = spec.num_nodes
    values = spec.secrets | {"ART_SKY_API_KEY": api_key.get_secret_value()}
    _mount_secrets(config, secrets_file, values, SECRETS_FILE)
    return _merge(config, spec.overrides)


def render_ci_task(spec: CIJobSpec, secrets_file: Path) -> dict[str, Any]:
    """The task config dict of a CI job (templates/ci-job.yaml). Secrets from --env-file go to `secrets_file`
    (0600), mounted at CI_SECRETS_FILE: keep it until the launch returns."""
    config = load_template(shipped="ci-job.yaml")
    _set_resources(config, spec.gpu, spec.infra, spec.spot, spec.autodown_minutes, spec.resources)
    config["workdir"] = str(spec.workdir)
    config["envs"] = (config.get("envs") or {}) | {
        "ART_SKY_CI_COMMAND": spec.command,
        "ART_SKY_CI_SETUP": spec.setup,
        "ART_SKY_CI_TIMEOUT": str(spec.timeout_s),
    }
    _mount_secrets(config, secrets_file, spec.secrets, CI_SECRETS_FILE)
    return config


def _mount_secrets(config: dict[str, Any], local: Path, values: dict[str, str], remote: str) -> None:
    """Write the secrets file and ship it by file_mounts; a template's task secrets of the same names (an older
    template's `ART_SKY_API_KEY: null`) are dropped, so that no value travels as a SkyPilot secret as well."""
    config.setdefault("file_mounts", {})[remote] = str(write_secrets(local, values))
    left = {k: v for k, v in (config.get("secrets") or {}).items() if k not in values}
    if left:
        config["secrets"] = left
    else:
        config.pop("secrets", None)


def _set_resources(
    config: dict[str, Any],
    gpu: str | list[str] | None,
    infra: str | None,
    spot: bool,
    autodown_minutes: int | None,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """Accelerators (one, or an ordered fallback list), infra, spot and autodown onto the task's resources."""
    resources = config.setdefault("resources", {}) or {}
    config["resources"] = resources
    for key in ("accelerators", "ordered", "any_of"):
        resources.pop(key, None)
    if isinstance(gpu, list):
        resources["ordered"] = [{"accelerators": _with_count(g)} for g in gpu]
    elif gpu is not None:
        resources["accelerators"] = _with_count(gpu)
    if infra is not None:
        resources["infra"] = infra
    if spot:
        resources["use_spot"] = True
    if autodown_minutes is None:
        resources.pop("autostop", None)
    else:
        resources["autostop"] = {"idle_minutes": autodown_minutes, "down": True}
    resources.update(extra)
    return resources


def validate_task(config: dict[str, Any]) -> dict[str, Any]:
    """Check the config with SkyPilot's task schema (in SkyPilot's environment); returns it, the task to launch."""
    from .sky import SkyError, validate

    try:
        validate(config)
    except SkyError as exc:  # SkyPilot raises ValueError subclasses for schema and field errors
        message = str(exc)
        for secret in (config.get("secrets") or {}).values():
            if secret:
                message = message.replace(str(secret), "***")
        raise ConfigError(
            f"SkyPilot refuses the task: {message}. Fix the template, resources or "
            f"overrides (art-sky {art_sky.__version__})"
        ) from None
    return config


def _with_count(gpu: str) -> str:
    return gpu if ":" in gpu else f"{gpu}:1"


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `overrides` into `base`: mappings merge, other values replace, None deletes."""
    for key, value in overrides.items():
        if value is None:
            base.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base
