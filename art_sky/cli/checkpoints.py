"""`art-sky checkpoints`: the checkpoints in the object store, from the laptop: list, pull, push, delete."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import typer
from tqdm.auto import tqdm

from art_sky.checkpoints import CheckpointDir, steps_to_keep
from art_sky.errors import ConfigError
from art_sky.settings import Settings
from art_sky.store import CheckpointStore

from . import table
from .conventions import Command
from .errors import ErrorBoundary, console

app = typer.Typer(
    help="LoRA checkpoints in the object store (ART_SKY_CHECKPOINT_URI or --uri): list, pull, push, delete.",
    no_args_is_help=True,
    cls=ErrorBoundary,
)

URI_HELP = "store URI: s3://bucket/prefix, gs://bucket/prefix or file:///path (default ART_SKY_CHECKPOINT_URI)"


def _store(uri: str | None) -> CheckpointStore:
    settings = Settings()
    uri = uri or settings.checkpoint_uri
    if not uri:
        raise ConfigError("no checkpoint store: pass --uri s3://bucket/prefix or set ART_SKY_CHECKPOINT_URI")
    return CheckpointStore(uri, endpoint=settings.checkpoint_endpoint, credentials=settings.store_credentials)


def _bar(description: str, total: int) -> tqdm:
    return tqdm(total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1024)


@app.command("ls", cls=Command)
def ls(
    project: str | None = typer.Argument(None, help="only this project"),
    model: str | None = typer.Argument(None, help="only this model of the project"),
    uri: str | None = typer.Option(None, help=URI_HELP),
    as_json: bool = typer.Option(False, "--json", help="print JSON for scripts: a list with one object per step"),
) -> None:
    """List the complete steps in the store: step, size, time, metrics and where each is."""

    async def work() -> tuple[str, list[dict]]:
        store = _store(uri)
        pairs = (
            [(project, model)]
            if project and model
            else [pair for pair in await store.models() if project in (None, pair[0])]
        )
        return store.uri, [
            {
                "project": p,
                "model": m,
                "step": step.step,
                "size_bytes": step.size_bytes,
                "created_at": step.created_at,
                "metrics": step.metrics,
                "where": store.where(p, m, step.step),
            }
            for p, m in pairs
            for step in await store.manifests(p, m)
        ]

    where, steps = asyncio.run(work())
    if as_json:
        print(json.dumps(steps, indent=2))
    elif steps:
        table.show(
            ("PROJECT", "MODEL", "STEP", "SIZE", "SAVED", "METRICS", "WHERE"),
            [
                (
                    s["project"],
                    s["model"],
                    str(s["step"]),
                    _size(s["size_bytes"]),
                    time.strftime("%Y-%m-%d %H:%M", time.localtime(s["created_at"])),
                    ", ".join(f"{k}={v:.4g}" for k, v in sorted(s["metrics"].items())) or "-",
                    s["where"],
                )
                for s in steps
            ],
            shrink=(5, 6),
        )
    else:
        console.print(f"no checkpoints in {where}" + (f" for {project}" if project else ""))


@app.command("pull", cls=Command)
def pull(
    project: str = typer.Argument(..., help="the model's project"),
    model: str = typer.Argument(..., help="the model's name"),
    step: int | None = typer.Option(None, help="the step to pull (default: the newest)"),
    to: Path | None = typer.Option(None, help="directory to create (default ./<model>-<step>)"),
    uri: str | None = typer.Option(None, help=URI_HELP),
) -> None:
    """Download a step's LoRA, verified against its manifest, into a directory vLLM or PEFT loads as is."""

    async def work() -> None:
        store = _store(uri)
        manifests = {m.step: m for m in await store.manifests(project, model)}
        if not manifests:
            raise ConfigError(f"{store.where(project, model)} holds no complete step: `art-sky checkpoints ls`")
        chosen = max(manifests) if step is None else step
        if chosen not in manifests:
            raise ConfigError(f"step {chosen} is not in {store.where(project, model)}; there: {sorted(manifests)}")
        dest = to or Path(f"{model}-{chosen:04d}")
        with _bar(f"pull step {chosen}", manifests[chosen].size_bytes) as bar:
            await store.download_step(project, model, chosen, dest, bar.update)
        console.print(f"step {chosen} of {project}/{model} is in {dest}")

    asyncio.run(work())


@app.command("push", cls=Command)
def push(
    project: str = typer.Argument(..., help="the model's project"),
    model: str = typer.Argument(..., help="the model's name"),
    path: Path = typer.Option(Path(".art"), help="local checkpoint root (a backend's `path`, ART's .art)"),
    step: int | None = typer.Option(None, help="only this step (default: every local step)"),
    uri: str | None = typer.Option(None, help=URI_HELP),
) -> None:
    """Upload local steps (files first, manifest last); steps the store already holds are skipped."""

    async def work() -> None:
        store = _store(uri)
        local = CheckpointDir(path, project, model)
        steps = local.steps() if step is None else [step]
        if not steps or (step is not None and step not in local.steps()):
            what = "no checkpoint" if step is None else f"no step {step}"
            raise ConfigError(f"{what} in {local.path}: check --path and the project and model given")
        for number in steps:
            manifest = local.manifest(number)
            assert manifest is not None  # steps() lists only the steps with a readable manifest
            with _bar(f"push step {number}", manifest.size_bytes) as bar:
                sent = await store.upload_step(local, number, bar.update)
                bar.update(bar.total - bar.n)
            console.print(f"step {number}: " + ("already in the store" if sent == 0 else f"sent {_size(sent)}"))
        await store.upload_history(local)

    asyncio.run(work())


@app.command("rm", cls=Command)
def rm(
    project: str = typer.Argument(..., help="the model's project"),
    model: str = typer.Argument(..., help="the model's name"),
    steps: list[int] | None = typer.Argument(None, help="steps to delete"),
    keep_last: int | None = typer.Option(None, min=1, help="instead: keep the newest N steps, delete the rest"),
    best_metric: str | None = typer.Option(
        None, help="with --keep-last, also keep the best step by this history metric, e.g. val/reward"
    ),
    uri: str | None = typer.Option(None, help=URI_HELP),
) -> None:
    """Delete steps from the store (each manifest first, so a half-deleted step is never listed)."""

    async def work() -> None:
        store = _store(uri)
        present = [m.step for m in await store.manifests(project, model)]
        if keep_last is not None:
            lines = ((await store.history(project, model)) or b"").decode().splitlines()
            history = [json.loads(line) for line in lines if line.strip()]
            doomed = [s for s in present if s not in steps_to_keep(present, history, best_metric, keep_last)]
        elif steps:
            if missing := sorted(set(steps) - set(present)):
                raise ConfigError(f"steps {missing} are not in {store.where(project, model)}; there: {present}")
            doomed = sorted(set(steps))
        else:
            raise ConfigError("name the steps to delete, or pass --keep-last N")
        await store.delete_steps(project, model, doomed)
        console.print(f"deleted {len(doomed)} step(s) of {store.where(project, model)}: {doomed}")

    asyncio.run(work())


def _size(size: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.2f} GiB"
