"""Weights & Biases, as ART does it: one run per model (project = the model's project, name and id = the model's name,
so a run resumes by that id from any machine, after any cluster), every step's metrics in ART's flat keys
(`train/reward`, `time/step_wall_s`, `costs/gpu`, ...) with `training_step` as their x-axis.

Logging runs here, in the process that runs the rollouts, as ART's own client does: the key is on this machine, so a
remote cluster needs none, nothing about W&B crosses the tunnel, and a run outlives the clusters it trains on.
Rollouts traced with Weave (`@weave.op`) run unchanged: Weave wraps the user's functions, not art-sky's.
"""

from __future__ import annotations

import logging
from typing import Any

from art_sky.checkpoints import history_entry
from art_sky.errors import ConfigError

log = logging.getLogger("art_sky")

# The sections whose metrics plot against the trained step (ART's define_metric calls).
_STEP_SECTIONS = ("reward", "loss", "throughput", "costs", "time", "data", "train", "val", "test", "discarded")


def wandb_wanted(report_metrics: list[str] | None, api_key: str | None) -> bool:
    """ART's rule: W&B when asked (`report_metrics=["wandb"]`), or by default when WANDB_API_KEY is set."""
    return "wandb" in report_metrics if report_metrics is not None else api_key is not None


def require_wandb() -> Any:
    try:
        import wandb
    except ImportError as exc:
        raise ConfigError(
            'W&B logging needs the wandb package: pip install "art-sky[wandb]" (or leave '
            "WANDB_API_KEY unset, or pass report_metrics=[])"
        ) from exc
    return wandb


class WandbRun:
    """A model's W&B run, made on first use and resumed by the model's name."""

    def __init__(self, project: str, name: str, api_key: str | None):
        self.project, self.name, self.api_key = project, name, api_key
        self._run: Any = None

    def log(self, split: str, metrics: dict[str, float], step: int) -> None:
        """One row: the metrics under ART's keys (`<split>/<name>` unless already under a section), at `step`."""
        row = {
            key: value
            for key, value in history_entry(step, split, metrics).items()
            if key not in ("step", "recorded_at") and value == value
        }  # NaN: not a point (ART drops them too)
        self.run().log(row | {"training_step": step})

    def run(self) -> Any:
        wandb = require_wandb()
        if self._run is None or getattr(self._run, "_is_finished", False):
            settings = wandb.Settings(api_key=self.api_key) if self.api_key else wandb.Settings()
            run = wandb.init(
                project=self.project,
                name=self.name,
                id=self.name,
                resume="allow",
                reinit="create_new",
                settings=settings,
            )
            run.define_metric("training_step")
            for section in _STEP_SECTIONS:
                run.define_metric(f"{section}/*", step_metric="training_step")
            self._run = run
            log.info("W&B run %s/%s (id %s)", self.project, self.name, self.name)
        return self._run

    def finish(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
