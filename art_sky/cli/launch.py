"""`art-sky up`'s question before it rents a SkyPilot cluster, as `sky launch` asks: what it would launch (GPUs,
nodes, spot, where, SkyPilot's price, autostop: provisioners/sky_plan.py), then "Launch it?" unless `--yes`.

Without a terminal on stdin (CI, a script, a pipe) there is no one to ask, so it refuses at once, saying to pass
`--yes`: neither blocking on a question nobody sees (a CI job must not hang) nor renting on a script's behalf
that did not say so (a forgotten `--yes` costs a rerun, not a bill)."""

from __future__ import annotations

import asyncio
import sys

import typer

from art_sky.backends import SkyPilotBackend
from art_sky.errors import ConfigError

from .errors import console


def confirm_launch(backend: SkyPilotBackend, yes: bool) -> None:
    """Show what launching would rent, and ask (unless `yes`); nothing when the cluster is up already."""
    plan = asyncio.run(backend.launch_plan())
    if plan is None:
        return
    if plan.table.strip():
        console.print(plan.table.rstrip(), markup=False, highlight=False, style="dim")
    console.print("\n".join(plan.lines()), markup=False, highlight=False)
    if yes:
        return
    if not sys.stdin.isatty():
        raise ConfigError(
            f"not launching {plan.cluster!r}: art-sky asks before it rents a cluster, and there is no terminal "
            "to ask on (stdin is not one): pass --yes to launch without asking"
        )
    if not typer.confirm("Launch it?", default=False):
        console.print("not launched: nothing was rented")
        raise typer.Exit(1)
