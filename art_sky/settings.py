"""Settings from `ART_SKY_*` environment variables, then `.env` in the working directory (see .env.example).

Each entry point (a backend, a CLI command, the cluster server) reads them once, with `Settings()`, and passes them
down; nothing below reads the environment itself. Secrets are never logged. A choice is a `Literal`, checked here
once; a bad value is a `ConfigError` naming its variable and where it was read (the environment or which `.env`),
and an `ART_SKY_*` name that is no setting is a warning naming the nearest one (a typo is not silently ignored).
"""

from __future__ import annotations

import difflib
import logging
import os
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from dotenv import dotenv_values
from pydantic import AliasChoices, Field, PrivateAttr, SecretStr, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from art_sky.errors import ConfigError

log = logging.getLogger("art_sky.settings")
ENV_FILE = ".env"

# The object store's credentials and settings under their usual names (not ART_SKY_*): what a remote server gets.
STORE_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
    "GOOGLE_SERVICE_ACCOUNT",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
)

# ART_SKY_* names art-sky itself uses that are not settings, so that they are not taken for mistyped ones: what
# `art-sky tunnel` prints for other programs, the SkyPilot tasks' variables (templates/*.yaml, provisioners/
# sky_task.py) and what the server hands its trainer ranks (cluster/training/sharded.py).
NOT_SETTINGS = frozenset(
    {
        "ART_SKY_BASE_URL",
        "ART_SKY_HEAD_PORT",
        "ART_SKY_EXTRA",
        "ART_SKY_WHEEL",
        "ART_SKY_PYTHON",
        "ART_SKY_VERSION",
        "ART_SKY_CI_COMMAND",
        "ART_SKY_CI_SETUP",
        "ART_SKY_CI_TIMEOUT",
        "ART_SKY_RANK_LEADER",
        "ART_SKY_RANK_KEY",
    }
)
_warned: set[tuple[str, str]] = set()  # (variable, where): each unknown name is warned about once per process


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ART_SKY_", env_file=ENV_FILE, extra="ignore")

    def __init__(self, **values: Any) -> None:
        """`values` override the environment and `.env` (tests, a backend's own settings)."""
        _warn_unknown(_env_file())
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ConfigError(_explain(exc, values)) from None

    cache_dir: Path = Field(Path.home() / ".cache" / "art-sky", description="built models (the tiny model) live here")
    api_key: SecretStr | None = Field(None, description="the cluster server's API key; generated when unset")
    server_start_timeout: float = Field(
        600.0,
        description="seconds to wait for a cluster server to become healthy "
        "(and a worker node's replica for its head to answer)",
    )
    request_timeout: float = Field(600.0, description="seconds for one HTTP request to the cluster server")
    max_request_bytes: int = Field(
        64 * 1024 * 1024, gt=0, description="the server refuses larger training request bodies (train, SFT: 413)"
    )
    max_completion_request_bytes: int = Field(
        4 * 1024 * 1024,
        gt=0,
        description="the server refuses larger chat completion (and other control) request bodies (413)",
    )
    train_retry_timeout: float = Field(
        600.0,
        ge=0,
        description="seconds train(), SFT and register keep retrying "
        "(same request id) across dropped connections and server restarts",
    )
    max_leases_per_model: int = Field(
        1024,
        ge=1,
        description="adapter leases (ART's exact_adapter_lease) one model may hold at once: past it a lease is "
        "refused (429) until some are released",
    )
    max_new_tokens_limit: int = Field(4096, description="the largest max_tokens the portable engine accepts")
    max_batch_rows: int = Field(64, description="completions the portable engine samples together in one batch")
    train_microbatch_tokens: int = Field(
        4096, description="tokens per forward/backward pass; larger batches accumulate"
    )
    activation_checkpointing: Literal["auto", "on", "off"] = Field(
        "auto",
        description="recompute each layer's activations in the backward pass (less memory, about a third "
        "more compute): auto (only for a micro-batch that would not fit the GPU's free memory otherwise; never on "
        "a CPU) | on | off. The Unsloth trainer always uses its own",
    )
    home: Path = Field(Path.home() / ".art-sky", description="art-sky's own state: cluster records, SSH host keys")
    ssh_connect_timeout: float = Field(20.0, description="seconds to open an SSH connection (TCP, handshake, login)")
    remote_install_timeout: float = Field(1800.0, description="seconds for the remote venv and pip install step")
    remote_python: str | None = Field(
        None,
        description="a Python on the cluster that already has art-sky installed: SkyPilot clusters skip the install",
    )
    engine: Literal["auto", "vllm", "portable"] = Field(
        "auto", description="inference engine: auto (vllm when importable) | vllm | portable"
    )
    trainer: Literal["auto", "unsloth", "peft"] = Field(
        "auto", description="trainer: auto (unsloth when importable on CUDA) | unsloth | peft"
    )
    allow_untested_stack: bool = Field(
        False,
        description="run vLLM's GPU build or Unsloth at versions outside "
        "the tested GPU stack (templates/gpu-constraints.txt) instead of refusing",
    )
    gpu_sharing: Literal["auto", "sleep"] = Field(
        "auto",
        description="vLLM beside the Unsloth trainer on one GPU: auto (share the "
        "weights in one process where Unsloth supports the model, else vLLM sleeps while "
        "training) | sleep (always vLLM's own server, asleep while training)",
    )
    engine_gpu_memory: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="share of GPU memory vLLM may take; the trainer uses the rest (vLLM sleeps while training)",
    )
    gpu_layout: Literal["auto", "shared", "dedicated"] = Field(
        "auto",
        description="how the node's GPUs are split: auto (dedicated with two or more "
        "GPUs and vLLM, else shared) | shared (one GPU for both jobs) | dedicated (vLLM on its "
        "own GPUs, the trainer on the last ART_SKY_TRAINER_GPUS)",
    )
    trainer_gpus: int = Field(
        1, ge=1, description="GPUs the trainer takes in the dedicated layout (the last ones); vLLM takes the others"
    )
    trainer_cpu_ranks: int = Field(
        1,
        ge=1,
        description="trainer ranks per node on a node without GPUs; more than "
        "one shards the model over them (FSDP2 on gloo), as trainer GPUs do on CUDA",
    )
    nodes: int = Field(
        1,
        ge=1,
        description="nodes in the cluster (the head and its workers): the trainer's ranks "
        "span them; SkyPilot's SKYPILOT_NUM_NODES sets it on a SkyPilot cluster",
    )
    rendezvous_host: str = Field(
        "127.0.0.1",
        description="the head's address the worker nodes' trainer ranks meet "
        "at (its private address on a multi-node cluster)",
    )
    trainer_max_restarts: int = Field(
        10,
        ge=0,
        description="times torchrun restarts the trainer's ranks after a "
        "rank fails (each restart reloads the last committed step)",
    )
    trainer_rank_timeout: float = Field(
        600.0,
        gt=0,
        description="seconds one collective of the trainer's ranks may wait for a rank before they fail and restart",
    )
    engine_tensor_parallel: int = Field(
        0,
        ge=0,
        description="vLLM's tensor-parallel size in the dedicated layout; "
        "0: the smallest power of two whose GPUs hold the model",
    )
    dedicated_gpu_memory: float = Field(
        0.9,
        gt=0,
        lt=1,
        description="share of each of its own GPUs vLLM takes in the dedicated layout (its --gpu-memory-utilization)",
    )
    vllm_start_timeout: float = Field(600.0, description="seconds to wait for the vLLM child server to be ready")
    vllm_max_loras: int = Field(
        4,
        ge=1,
        description="adapters an engine keeps loaded at once: the newest "
        "step of each model plus older name@step ones (vLLM's --max-loras)",
    )
    vllm_compact_json: bool = Field(
        True,
        description="vLLM's constrained JSON without free whitespace (as the "
        "portable engine's), with its xgrammar backend, which refuses a few schema "
        "features (multipleOf, uniqueItems); false: vLLM's auto backend, whose JSON "
        "may carry any whitespace",
    )
    tool_parser: str = Field(
        "",
        description="how tool calls are read from replies, by vLLM's parser names (hermes, "
        "llama3_json, mistral; vLLM has more); empty: from the model's chat template; none: "
        "not read",
    )
    checkpoint_uri: str | None = Field(
        None,
        description="object store the cluster mirrors checkpoints to: s3://bucket/prefix, gs://bucket/prefix "
        "or file:///path; unset keeps them on the cluster only",
    )
    checkpoint_endpoint: str | None = Field(
        None, description="endpoint of an S3-compatible store (R2, MinIO, SeaweedFS); default AWS or AWS_ENDPOINT_URL"
    )
    checkpoint_background: bool = Field(
        True,
        description="write each step's checkpoint to disk in a thread while the engine swaps to the new adapter "
        "and the next step may start training (its commit waits for the write); train() returns once the step is on "
        "disk either way; false: written before the step commits",
    )
    checkpoint_strict: bool = Field(
        False, description="a failed checkpoint upload fails training and flush_checkpoints() instead of warning"
    )
    cluster_name: str | None = Field(
        None,
        description="the cluster a server belongs to (art-sky sets it when it starts one; SkyPilot's name otherwise): "
        "its lineages' owner records name it, and a relaunch of the same cluster takes them over",
    )
    owner_stale_after: float = Field(
        60.0,
        gt=0,
        description="seconds after its last refresh (every quarter of this) that a lineage's owner record in the "
        "object store is stale: another cluster may then take the lineage over",
    )
    hourly_cost: float | None = Field(
        None,
        ge=0,
        description="the machine's price in $ per hour, for each step's cost (costs/gpu); default: "
        "SkyPilot's price of its cluster, none for an SSH host or this machine",
    )
    train_stall_timeout: float = Field(
        900.0,
        gt=0,
        description="seconds a training step may go without progress before train() raises, naming "
        "what the server is doing (a warning comes at a third of it)",
    )
    recover_after: float = Field(
        15.0,
        gt=0,
        description="seconds a SkyPilot cluster's server may go unanswered before SkyPilot is asked "
        "whether the cluster was lost (preempted, stopped, its job ended), with recovery on",
    )
    recover_timeout: float = Field(
        1800.0,
        gt=0,
        description="seconds recovery may take to bring a lost SkyPilot cluster back (launch, server, "
        "models restored) before it gives up and tears the cluster down",
    )
    wandb_api_key: SecretStr | None = Field(
        None,
        validation_alias=AliasChoices("WANDB_API_KEY", "wandb_api_key"),
        description="Weights & Biases' key (WANDB_API_KEY): set, each model logs its steps to a W&B run",
    )
    skypilot_python: Path | None = Field(
        None,
        description="a Python that has SkyPilot, to run it with; default: a venv art-sky makes for it under "
        "the cache dir (SkyPilot's pins stay out of this environment)",
    )
    langfuse_public_key: str | None = Field(
        None,
        validation_alias=AliasChoices("LANGFUSE_PUBLIC_KEY", "langfuse_public_key"),
        description="Langfuse's public key (LANGFUSE_PUBLIC_KEY): with the secret key, each model's rollouts go to "
        "Langfuse as traces",
    )
    langfuse_secret_key: SecretStr | None = Field(
        None,
        validation_alias=AliasChoices("LANGFUSE_SECRET_KEY", "langfuse_secret_key"),
        description="Langfuse's secret key (LANGFUSE_SECRET_KEY)",
    )
    langfuse_host: str | None = Field(
        None,
        validation_alias=AliasChoices("LANGFUSE_HOST", "LANGFUSE_BASE_URL", "langfuse_host"),
        description="Langfuse's URL (LANGFUSE_HOST or LANGFUSE_BASE_URL); default Langfuse Cloud",
    )
    _store_credentials: dict[str, str] = PrivateAttr(default_factory=dict)

    def model_post_init(self, context: object) -> None:
        """The store's variables keep their usual names (AWS_*, GOOGLE_*): read them here, environment then .env."""
        from_file = _env_file()
        for name in STORE_VARIABLES:
            value = os.environ.get(name) or from_file.get(name)
            if value:
                self._store_credentials[name] = value

    @property
    def store_credentials(self) -> dict[str, str]:
        """The object store's credentials and settings set here (never log them)."""
        return dict(self._store_credentials)


def variables(name: str, field: FieldInfo) -> list[str]:
    """The environment variables a setting is read from: ART_SKY_ and its name, or the names its aliases give."""
    aliases = getattr(field.validation_alias, "choices", None)
    if not aliases:
        return [f"ART_SKY_{name.upper()}"]
    return list(dict.fromkeys(str(alias).upper() for alias in aliases))


def choices(field: FieldInfo) -> tuple[str, ...]:
    """A choice setting's values (its `Literal`'s), else ()."""
    return tuple(str(value) for value in get_args(field.annotation)) if get_origin(field.annotation) is Literal else ()


def _env_file() -> dict[str, str | None]:
    return dotenv_values(ENV_FILE) if Path(ENV_FILE).is_file() else {}


def _known() -> set[str]:
    return {v for name, field in Settings.model_fields.items() for v in variables(name, field)} | NOT_SETTINGS


def _warn_unknown(from_file: dict[str, str | None]) -> None:
    """A warning for each ART_SKY_* name in the environment or .env that is no setting, with the nearest one."""
    found = [(name, "the environment") for name in os.environ] + [
        (name, str(Path(ENV_FILE).resolve())) for name in from_file
    ]
    known = _known()
    settings = {v.removeprefix("ART_SKY_"): v for v in known - NOT_SETTINGS if v.startswith("ART_SKY_")}
    for name, where in found:
        upper = name.upper()
        if not upper.startswith("ART_SKY_") or upper in known or (upper, where) in _warned:
            continue
        _warned.add((upper, where))
        nearest = [
            settings[n] for n in difflib.get_close_matches(upper.removeprefix("ART_SKY_"), list(settings), 1, 0.7)
        ]
        log.warning(
            "%s (in %s) is not an art-sky setting and is ignored%s",
            name,
            where,
            f": did you mean {nearest[0]}?" if nearest else " (the settings: docs/reference/settings.md)",
        )


def _explain(exc: ValidationError, values: dict[str, Any]) -> str:
    """pydantic's report as art-sky's: each bad value by its variable, where it was read, and what it may be.
    (A secret is a plain string, which never fails: no value shown here is one.)"""
    in_file = {name.upper() for name in _env_file()}
    in_environment = {name.upper() for name in os.environ}
    problems = []
    for error in exc.errors():
        key = str(error["loc"][0]) if error["loc"] else ""
        name, field = next(
            ((n, f) for n, f in Settings.model_fields.items() if key == n or key.upper() in variables(n, f)),
            (key, None),
        )
        names = variables(name, field) if field else [key.upper()]
        value = error["input"]
        if name in values:
            said = f"Settings({name}={value!r})"
        elif variable := next((v for v in names if v in in_environment), None):
            said = f"{variable}={value} (in the environment)"
        else:
            variable = next((v for v in names if v in in_file), names[0])
            said = f"{variable}={value} (in {Path(ENV_FILE).resolve()})"
        allowed = choices(field) if field else ()
        if allowed:
            nearest = difflib.get_close_matches(str(value), allowed, n=1, cutoff=0.6)
            reason = f"use one of {', '.join(allowed)}" + (f" (did you mean {nearest[0]}?)" if nearest else "")
        else:
            reason = error["msg"][:1].lower() + error["msg"][1:]
        problems.append(f"{said} is not a valid setting: {reason}")
    return "; ".join(problems)


def read_env_file(path: str | Path | None) -> dict[str, str]:
    """The variables of a .env file the user names (`env_path=`, `--env-file`)."""
    if path is None:
        return {}
    if not Path(path).is_file():
        raise ConfigError(f"env file {path} does not exist: give a .env file (KEY=value lines)")
    return {k: v for k, v in dotenv_values(path).items() if v is not None}
