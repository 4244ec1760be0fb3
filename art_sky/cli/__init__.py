"""`art-sky`: the command line. Each command wraps the async Python API: clusters (up, down, status, logs, tunnel,
ssh), checkpoints in the object store, CI jobs, and the demo."""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer

import art_sky

from . import checkpoints, ci, clusters, plot
from .errors import console, friendly

app = typer.Typer(help="Train LLM agents with GRPO: locally on CPU, on an SSH host, or on SkyPilot clusters.",
                  no_args_is_help=True, add_completion=False)


@app.command()
def demo(
    steps: int = typer.Option(15, min=1, help="training steps"),
    groups: int = typer.Option(8, min=1, help="trajectory groups per step"),
    group_size: int = typer.Option(8, min=2, help="rollouts per group"),
    learning_rate: float = typer.Option(5e-3, min=0.0, help="LoRA learning rate"),
    seed: int = typer.Option(0, help="seed for prompts and sampling"),
    path: Path = typer.Option(Path(".art"), help="checkpoint root (ART's .art)"),
    plot: Path = typer.Option(Path("demo-reward.png"), help="where to draw the reward curve"),
) -> None:
    """Run the whole loop on this machine's CPU with the embedded tiny model and watch the reward climb."""
    from art_sky.demo import run_demo

    rewards = asyncio.run(run_demo(steps=steps, groups=groups, group_size=group_size, learning_rate=learning_rate,
                                   seed=seed, path=path, plot=plot, echo=_plain))
    console.print(f"mean reward: first step {rewards[0]:.3f}, last step {rewards[-1]:.3f}")


def _plain(text: str) -> None:
    """Print model output as is: no rich markup, no wrapping."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


@app.command()
def version() -> None:
    """Print art-sky's version."""
    console.print(art_sky.__version__)


for command in (clusters.up, clusters.down, clusters.status, clusters.logs, clusters.tunnel, clusters.ssh):
    app.command()(friendly(command))
app.command()(plot.plot)
app.add_typer(checkpoints.app, name="checkpoints", help="List, pull, push and delete checkpoints in the object store.")
app.add_typer(ci.app, name="ci")
