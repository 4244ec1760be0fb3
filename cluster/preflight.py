"""What registering a model checks before anything slow (loading weights, downloading checkpoints), so that a
mistake is said in a second, with its fix, not after a minute in a library's words:

- the base model: art-sky's own names (a misspelling gets a did-you-mean), a local directory that must exist on
  this machine (the server reads it here, not on the laptop), or a Hugging Face hub id, which needs the Hub (a
  node that cannot reach it is told so at once: the Hub client's own retries take a minute) unless it is cached;
- the checkpoint store: its bucket exists and its credentials are there and accepted (each missing one named by
  its variable). A store that is merely unreachable now is a warning, as for uploads, unless in strict mode.
"""

from __future__ import annotations

import asyncio
import difflib
import logging
import socket
from pathlib import Path

from art_sky.errors import CheckpointStoreError, ConfigError
from art_sky.store import CheckpointStore

from .tiny_model import TINY_MODEL_NAME

log = logging.getLogger("art_sky.cluster")

OWN_MODELS = (TINY_MODEL_NAME,)  # built from code (cluster/tiny_model.py): no download
OWN_PREFIX = "art-sky/"
HUB_TIMEOUT = 5.0  # seconds to ask the Hub whether a model exists: an answer, not a download
USAGE = (
    f"use {TINY_MODEL_NAME!r}, a local Hugging Face model directory on the cluster, or a hub id "
    "(owner/name) on a node with internet access"
)


async def check_registration(base_model: str, store: CheckpointStore | None, strict: bool) -> None:
    """Refuse a registration whose base model cannot load or whose store cannot work, saying how to fix it."""
    await asyncio.to_thread(check_base_model, base_model)
    if store is not None:
        await check_store(store, strict)


def check_base_model(name: str) -> None:
    """The base model can be found: one of art-sky's own, an existing local model directory, or a hub id the Hub
    has (or this node's Hugging Face cache holds). ConfigError, with the fix, otherwise."""
    if name in OWN_MODELS:
        return
    if name.startswith(OWN_PREFIX):
        nearest = _own_like(name)
        raise ConfigError(
            f"base model {name!r} is not one of art-sky's own models ({', '.join(OWN_MODELS)}): "
            + (f"did you mean {nearest!r}?" if nearest else USAGE)
        )
    path = Path(name).expanduser()
    if path.exists() or name.startswith(("/", "./", "../", "~")):
        _check_directory(name, path)
        return
    _check_hub_id(name)


def _own_like(name: str) -> str | None:
    """The art-sky model `name` looks like a misspelling of, if any (letters and digits compared: `artsky/tiny`,
    `art-sky/tiney`, but not `art-sky/qwen`)."""

    def letters(text: str) -> str:
        return "".join(c for c in text.lower() if c.isalnum())

    own = {letters(model): model for model in OWN_MODELS}
    found = difflib.get_close_matches(letters(name), list(own), n=1, cutoff=0.8)
    return own[found[0]] if found else None


def _check_directory(name: str, path: Path) -> None:
    where = f"on the server's machine ({socket.gethostname()}), which reads it"
    if not path.exists():
        raise ConfigError(f"base model {name!r} does not exist {where}: {USAGE}")
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"base model {name!r} is no Hugging Face model directory {where}: it has no config.json (save the model "
            "with `save_pretrained`, or give the directory that holds config.json)"
        )


def _check_hub_id(name: str) -> None:
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ConfigError(
            f"base model {name!r} is neither a directory on this server's machine nor a hub id (owner/name): {USAGE}"
        ) from None
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return  # in this node's Hugging Face cache: loads without the network
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(
            f"base model {name!r} is not in this node's Hugging Face cache, and HF_HUB_OFFLINE is set: download it "
            f"there first (`hf download {name}`), or give its local directory"
        )
    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT)
    except GatedRepoError:
        raise ConfigError(
            f"base model {name!r} is gated on the Hugging Face Hub: accept its terms on its page and give the "
            "server a token that may read it (HF_TOKEN in the server's environment, e.g. in the --env-file)"
        ) from None
    except RepositoryNotFoundError:
        nearest = _own_like(name)
        raise ConfigError(
            f"base model {name!r} is not on the Hugging Face Hub: "
            + (
                f"did you mean {nearest!r}?"
                if nearest
                else "check its id, or give the server HF_TOKEN if it is private"
            )
        ) from None
    except Exception as exc:  # no route, no DNS, a proxy, a timeout: the Hub is not reachable from here
        if _is_http_answer(exc):
            return  # the Hub answered something else (a 5xx, rate limit): the download will say more
        nearest = _own_like(name)
        raise ConfigError(
            f"base model {name!r} is a hub id, and this node cannot reach the Hugging Face Hub ({constants.ENDPOINT}: "
            f"{exc}): "
            + (
                f"did you mean art-sky's own {nearest!r}?"
                if nearest
                else "give a local model directory on the cluster, download it into the node's Hugging Face cache "
                f"first (`hf download {name}`), or run the server where there is internet access"
            )
        ) from None


def _is_http_answer(exc: Exception) -> bool:
    from huggingface_hub.errors import HfHubHTTPError

    return isinstance(exc, HfHubHTTPError)


async def check_store(store: CheckpointStore, strict: bool) -> None:
    """The store's bucket exists and its credentials are there and accepted; a store that cannot be reached now
    is only a warning (uploads retry) unless `strict`."""
    try:
        await store.check()
    except CheckpointStoreError as exc:
        if exc.misconfigured or strict:
            raise
        log.warning("the checkpoint store cannot be checked now (%s): registering anyway; uploads retry", exc)
