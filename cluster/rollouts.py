"""Each step's rollouts beside its history (`rollouts.jsonl`, a line per committed GRPO step): its groups'
conversations, rewards, advantages and why a group or trajectory was left out, for the dashboard's step view.

Preparing the step notes each trajectory's advantage or skip reason (`Outcomes`); after the step commits one
background writer thread builds the line from the parsed request and those notes and appends it: never on the
step's path, in step order, and a failed write is a warning, never a failed step. A crash mid-write cuts the last
line only (the dashboard says so).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from art_sky.layout import ROLLOUTS
from art_sky.wire import TrainRequest

log = logging.getLogger("art_sky.cluster")

_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts")  # one: lines in step order


@dataclass
class Outcomes:
    """What preparing a step decided per trajectory: its advantage, or why it was left out; per group, why."""

    advantages: dict[tuple[int, int], float] = field(default_factory=dict)
    skipped: dict[tuple[int, int], str] = field(default_factory=dict)
    groups_skipped: dict[int, str] = field(default_factory=dict)


def step_line(body: TrainRequest, outcomes: Outcomes) -> dict:
    """The step's line without its number (set at commit): a group per request group, each trajectory's messages
    (the sampled turns as `assistant`), reward, advantage and skip reason."""
    groups = []
    for g, group in enumerate(body.groups):
        trajectories = []
        for t, trajectory in enumerate(group.trajectories):
            messages = [
                item.model_dump(exclude_none=True, exclude={"token_ids", "logprobs", "prompt_token_ids"})
                for item in trajectory.items
            ]
            for message in messages:
                if message.pop("kind", None) == "choice":
                    message["role"] = "assistant"
                for key in ("prompt_shared", "prompt_tokens", "step"):
                    message.pop(key, None)
            trajectories.append(
                {
                    "reward": trajectory.reward,
                    "advantage": outcomes.advantages.get((g, t)),
                    "skipped": outcomes.skipped.get((g, t)),
                    "metrics": trajectory.metrics,
                    "messages": messages,
                }
            )
        groups.append({"skipped": outcomes.groups_skipped.get(g), "trajectories": trajectories})
    return {"groups": groups}


def append_later(model_dir: Path, step: int, line: Callable[[], dict]) -> None:
    """Build step `step`'s line (`line()`) and append it to the model's rollouts.jsonl, in the background."""
    _writer.submit(_append, model_dir / ROLLOUTS, step, line)


def _append(path: Path, step: int, line: Callable[[], dict]) -> None:
    try:
        text = json.dumps({"step": step} | line()) + "\n"
        with open(path, "a") as handle:
            handle.write(text)
    except OSError as exc:  # the dashboard's data, not the run's: training goes on
        log.warning("rollouts of step %d not written to %s (%s)", step, path, exc.strerror or exc)
    except Exception:  # a bug here must not reach the step either; the log has the traceback
        log.exception("rollouts of step %d not written to %s", step, path)


def flush() -> None:
    """Wait for the lines submitted so far (a test reading the file, a server stopping)."""
    _writer.submit(lambda: None).result()
