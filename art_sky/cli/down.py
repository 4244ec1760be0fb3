"""`art-sky down NAME [--purge]`: stop the cluster, say what it left on the machine and how big it is, and with
`--purge` remove it (asking first; `--yes` skips the question).

What other clusters of the machine still use (an SSH host's shared venv and checkpoint root) is kept and said to
be. A stopped cluster whose files stay keeps its record in `<ART_SKY_HOME>/clusters/down/`, so `art-sky down NAME
--purge` can remove them later. Without a terminal and without `--yes` a purge refuses at once, before anything is
stopped: it never blocks on a question nobody sees.
"""

from __future__ import annotations

import asyncio
import sys

import typer

from art_sky import clusters
from art_sky.backends import KINDS, attach
from art_sky.errors import ArtSkyError, ConfigError
from art_sky.remote.leftovers import Leftover, size_text, summary
from art_sky.settings import Settings

from .clusters import NAME, NAME_OPTION, cluster_name
from .errors import console


def down(
    name: str | None = NAME,
    name_option: str | None = NAME_OPTION,
    force: bool = typer.Option(
        False,
        "--force",
        help="stop even if checkpoints are not in the object store yet, or the machine cannot be reached to ask",
    ),
    purge: bool = typer.Option(
        False,
        "--purge",
        help="also remove what the cluster left on its machine (an SSH host's venv, checkpoints, the cluster's "
        "folder), asking first; what other clusters there use stays",
    ),
    yes: bool = typer.Option(False, "--yes", "-y", help="purge without asking (needed where stdin is no terminal)"),
) -> None:
    """Stop the cluster's server and forget the cluster, then say what stays on its machine. A SkyPilot cluster is
    torn down (`sky down`); an SSH host's files stay unless `--purge`. Waits first until every checkpoint is in the
    object store (when one is configured); a server that has already exited is forgotten at once."""
    name = cluster_name(name, name_option)
    settings = Settings()
    home = settings.home
    if purge and not yes and not sys.stdin.isatty():
        raise ConfigError(
            f"not purging {name!r}: art-sky asks before it deletes files on the machine, and there is no terminal "
            "to ask on (stdin is not one): pass --yes to purge without asking"
        )
    if name in clusters.all_names(home):
        record = clusters.load(home, name)
        backend = attach(name, settings=settings, recover=False)
        with console.status(f"stopping {name!r} once its checkpoints are in the store ..."):
            done = asyncio.run(backend.down(force=force))
        clusters.remove(home, name)
        _say(f"cluster {name!r}: {done}; record removed")
    else:
        record = clusters.load_stopped(home, name)  # stopped before, its files left: the no-such-cluster error
    backend = KINDS[record.kind].from_record(record, settings=settings)
    try:
        items = asyncio.run(backend.leftovers(record.layout))
    except ArtSkyError as exc:
        clusters.save_stopped(home, record)
        _say(f"what stays on {record.where} was not measured ({str(exc).splitlines()[0]})")
        return
    if not items:
        clusters.forget_stopped(home, name)
        return
    removable = [item for item in items if item.kept_because is None]
    if not purge or not removable:
        clusters.save_stopped(home, record)
        _say(f"left on {record.where}: {summary(items)} ({_purge_hint(name, items)})")
        return
    if not yes and not typer.confirm(f"Remove {summary(removable)} from {record.where}?", default=False):
        clusters.save_stopped(home, record)
        _say(f"nothing removed; `art-sky down {name} --purge` asks again")
        raise typer.Exit(1)
    removed = asyncio.run(backend.purge(record.layout))
    clusters.forget_stopped(home, name)
    _say(f"removed from {record.where}: {summary(removed)}")
    for item in items:
        if item.kept_because is not None:
            _say(f"kept {item.what} ({size_text(item.size)}): {item.kept_because}")


def _purge_hint(name: str, items: list[Leftover]) -> str:
    kept = [item for item in items if item.kept_because is not None]
    if not kept:
        return f"`art-sky down {name} --purge` removes them"
    removable = [item.what for item in items if item.kept_because is None]
    stays = "; ".join(f"{item.what} stays: {item.kept_because}" for item in kept)
    if not removable:
        return stays
    return f"`art-sky down {name} --purge` removes {', '.join(removable)}; {stays}"


def _say(text: str) -> None:
    console.print(text, markup=False, highlight=False, soft_wrap=True)
