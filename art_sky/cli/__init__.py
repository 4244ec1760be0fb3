"""`art-sky`: the command line. Each command wraps the async Python API: clusters (up, down, status, logs, tunnel,
ssh), checkpoints in the object store, CI jobs, the dashboard and the demo.

Conventions: a cluster command's first argument is the cluster's NAME (`--name` is an alias; default `art`); a
checkpoints command's are PROJECT [MODEL], since it acts on the object store, which outlives clusters. Errors are
one or two lines from one boundary (cli/errors.py); `art-sky --verbose COMMAND` adds their detail and every
library's log."""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer

import art_sky

from . import checkpoints, ci, clusters, dashboard, down, plot
from .conventions import HELP_OPTIONS, Command
from .errors import ErrorBoundary, console

app = typer.Typer(
    help="Train LLM agents with GRPO: locally on CPU, on an SSH host, or on SkyPilot clusters.",
    no_args_is_help=True,
    add_completion=False,
    cls=ErrorBoundary,
    context_settings={"help_option_names": HELP_OPTIONS},  # every command inherits them
)


def _print_version(asked: bool) -> None:
    if asked:
        console.print(f"art-sky {art_sky.__version__}", markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
def main(
    verbose: bool = typer.Option(
        False,
        "--verbose",
        "-v",
        help="show errors in full (a server log's last lines, a remote command's output) and every library's log lines",
    ),
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_print_version, help="print art-sky's version and exit"
    ),
) -> None:
    """Train LLM agents with GRPO: locally on CPU, on an SSH host, or on SkyPilot clusters."""


@app.command(cls=Command)
def demo(
    steps: int = typer.Option(15, min=1, help="training steps"),
    groups: int = typer.Option(8, min=1, help="trajectory groups per step"),
    group_size: int = typer.Option(8, min=2, help="rollouts per group"),
    learning_rate: float = typer.Option(5e-3, min=0.0, help="LoRA learning rate"),
    seed: int = typer.Option(0, help="seed for prompts and sampling"),
    path: Path = typer.Option(Path(".art"), help="checkpoint root (ART's .art)"),
    plot: Path = typer.Option(Path("demo-reward.png"), help="where to draw the reward curve"),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="continue the previous run's model (default: a fresh model, the previous run's demo checkpoints removed)",
    ),
) -> None:
    """Run the whole loop on this machine's CPU with the embedded tiny model and watch the reward climb."""
    from art_sky.demo import run_demo

    rewards = asyncio.run(
        run_demo(
            steps=steps,
            groups=groups,
            group_size=group_size,
            learning_rate=learning_rate,
            seed=seed,
            path=path,
            plot=plot,
            resume=resume,
            echo=_plain,
        )
    )
    console.print(f"mean reward: first step {rewards[0]:.3f}, last step {rewards[-1]:.3f}")


def _plain(text: str) -> None:
    """Print model output as is: no rich markup, no wrapping."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


@app.command(cls=Command)
def version() -> None:
    """Print art-sky's version."""
    console.print(art_sky.__version__)


for command in (clusters.up, down.down, clusters.status, clusters.logs, clusters.tunnel):
    app.command(cls=Command)(command)
app.command(cls=clusters.CommandAfterDashes)(clusters.ssh)
app.command(cls=Command)(plot.plot)
app.command(cls=Command)(dashboard.dashboard)
app.add_typer(checkpoints.app, name="checkpoints", help="List, pull, push and delete checkpoints in the object store.")
app.add_typer(ci.app, name="ci")
