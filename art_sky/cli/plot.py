"""`art-sky plot MODEL`: a run's reward, loss and KL per step, drawn to a PNG from its history (history.jsonl):
asked of a cluster's server, read from the object store, or read from a local checkpoint root."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import typer

from art_sky import charts, clusters
from art_sky.backends import attach
from art_sky.errors import ConfigError
from art_sky.layout import HISTORY, model_key
from art_sky.settings import Settings
from art_sky.store import CheckpointStore

from .errors import console


def plot(
    model: str = typer.Argument(..., help="the model's name"),
    name: str = typer.Option("art", "--name", "-n", help="the cluster whose server has the model"),
    project: str | None = typer.Option(
        None, help="the model's project (needed with --uri; with --path, when two projects have a model of that name)"
    ),
    path: Path | None = typer.Option(
        None, help="read the history from this checkpoint root (ART's .art) instead of a server"
    ),
    uri: str | None = typer.Option(
        None, help="read the history from this object store (s3://, gs://, file://) instead of a server"
    ),
    out: Path | None = typer.Option(None, "--out", "-o", help="the PNG to write (default MODEL.png)"),
) -> None:
    """Draw MODEL's reward, loss and KL per training step to a PNG. The history comes from the server of cluster
    --name (default art), or --uri (the object store, with --project), or --path (a local .art, e.g. after
    `art-sky demo`); with no cluster of that name recorded, from ./.art when the model is there."""
    settings = Settings()
    if uri:
        history, source = asyncio.run(_from_store(uri, project, model, settings))
    elif path is not None or (name not in clusters.all_names(settings.home) and _local(Path(".art"), model, project)):
        history, source = _from_path(path or Path(".art"), model, project)
    else:
        history, source = asyncio.run(_from_server(name, model, settings))
    written = charts.draw(history, out or Path(f"{model}.png"), f"{model}: reward, loss and KL per step")
    console.print(
        f"{len(charts.training_steps(history))} steps from {source} drawn to {written}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


async def _from_server(name: str, model: str, settings: Settings) -> tuple[list[dict], str]:
    backend = attach(name, settings=settings, recover=False)
    try:
        return await backend.history(model), f"the server of cluster {name!r}"
    finally:
        await backend.close()


async def _from_store(uri: str, project: str | None, model: str, settings: Settings) -> tuple[list[dict], str]:
    if not project:
        raise ConfigError("--uri needs --project: the store keeps each model under its project")
    store = CheckpointStore(uri, endpoint=settings.checkpoint_endpoint, credentials=settings.store_credentials)
    data = await store.history(project, model)
    if data is None:
        raise ConfigError(
            f"{store.where(project, model)} has no {HISTORY}: check the project and model names "
            "(`art-sky checkpoints ls` lists them)"
        )
    return _lines(data.decode()), store.where(project, model)


def _local(root: Path, model: str, project: str | None) -> list[Path]:
    """The history files of models named `model` under a checkpoint root (of `project` only, when given)."""
    pattern = f"{model_key(project, model)}/{HISTORY}" if project else f"*/models/{model}/{HISTORY}"
    return sorted(root.glob(pattern))


def _from_path(root: Path, model: str, project: str | None) -> tuple[list[dict], str]:
    found = _local(root, model, project)
    if not found:
        raise ConfigError(
            f"no history of model {model!r} under {root}: give the checkpoint root it trained in "
            "(--path), or ask a cluster's server (--name) or the object store (--uri)"
        )
    if len(found) > 1:
        projects = ", ".join(f.parent.parent.parent.name for f in found)
        raise ConfigError(
            f"models named {model!r} in several projects under {root} ({projects}): pick one with --project"
        )
    return _lines(found[0].read_text()), str(found[0])


def _lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]
