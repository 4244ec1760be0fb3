"""Langfuse, the third tracker ART's docs name: the rollouts a model trains on (and those `model.log` records) go to
Langfuse as traces, one per rollout (its conversation in, its last answer out), with its reward and metrics as the
trace's scores, tagged with the model and the step (`model:NAME`, `step:N`, `split:train`) and grouped by step (the
session `project/name/step-N`; the group's index is in the metadata).

As for W&B (reporting.py), this runs in the process that runs the rollouts, with the keys on this machine: nothing
about Langfuse crosses the tunnel. The SDK sends in its own threads (spans over OTLP/HTTP, scores to its API) and
flushes at exit. Rollouts made through Langfuse's OpenAI wrapper (`from langfuse.openai import AsyncOpenAI`) train
unchanged: the wrapper hands back the SDK's own objects, which carry the engine's token ids.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from art_sky.errors import ConfigError
from art_sky.settings import Settings

from .trajectories import Trajectory, TrajectoryGroup

log = logging.getLogger("art_sky")


def langfuse_wanted(report_metrics: list[str] | None, settings: Settings) -> bool:
    """ART's rule, for Langfuse: when asked (`report_metrics=["langfuse"]`), or by default when both of its keys are
    set (LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY)."""
    if report_metrics is not None:
        return "langfuse" in report_metrics
    return settings.langfuse_public_key is not None and settings.langfuse_secret_key is not None


def require_langfuse() -> Any:
    try:
        import langfuse
    except ImportError as exc:
        raise ConfigError(
            'Langfuse tracing needs the langfuse package: pip install "art-sky[langfuse]" (or leave '
            'LANGFUSE_PUBLIC_KEY unset, or leave "langfuse" out of report_metrics)'
        ) from exc
    return langfuse


class LangfuseTraces:
    """A model's rollouts in Langfuse; the SDK's client is made on first use from the settings' keys and host."""

    def __init__(self, project: str, name: str, settings: Settings):
        self.project, self.name, self.settings = project, name, settings
        self._client: Any = None

    def log(self, split: str, groups: Iterable[TrajectoryGroup], step: int) -> None:
        """Each rollout of `groups` a trace tagged with the model, `split` and `step`, its reward and metrics the
        trace's scores."""
        from langfuse import propagate_attributes

        client = self.client()
        for index, group in enumerate(groups):
            for trajectory in group.trajectories:
                with propagate_attributes(
                    trace_name=f"{self.name} {split}",
                    session_id=f"{self.project}/{self.name}/step-{step}",
                    tags=[f"model:{self.name}", f"step:{step}", f"split:{split}"],
                    metadata={
                        "project": self.project,
                        "model": self.name,
                        "step": str(step),
                        "split": split,
                        "group": str(index),
                    },
                ):
                    with client.start_as_current_observation(
                        as_type="span", name="rollout", **_io(trajectory), metadata=trajectory.metadata or None
                    ) as span:
                        span.score_trace(name="reward", value=float(trajectory.reward))
                        for key, value in trajectory.metrics.items():
                            span.score_trace(name=key, value=float(value))

    def client(self) -> Any:
        langfuse = require_langfuse()
        if self._client is None:
            settings = self.settings
            self._client = langfuse.Langfuse(
                public_key=settings.langfuse_public_key,
                secret_key=settings.langfuse_secret_key and settings.langfuse_secret_key.get_secret_value(),
                base_url=settings.langfuse_host,
            )
            log.info(
                "Langfuse traces of %s/%s go to %s",
                self.project,
                self.name,
                settings.langfuse_host or "Langfuse's default host",
            )
        return self._client

    def flush(self) -> None:
        """Send what is queued now (blocking); the SDK also does so at exit."""
        if self._client is not None:
            self._client.flush()


def _io(trajectory: Trajectory) -> dict[str, Any]:
    """The trace's input (the conversation up to the last answer, with the tools offered) and output (that answer)."""
    messages = trajectory.messages()
    last = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    conversation = messages[:-1] if last is not None else messages
    return {
        "input": {"messages": conversation} | ({"tools": trajectory.tools} if trajectory.tools else {}),
        "output": last,
    }
