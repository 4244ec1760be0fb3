"""`gather_trajectory_groups`: run every group's rollouts concurrently, with a progress bar and an exception budget."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeGuard

from tqdm.auto import tqdm

from art_sky.errors import ArtSkyError

from .model import completions_answered
from .trajectories import Trajectory, TrajectoryGroup


class TooManyRolloutErrors(ArtSkyError):
    """More rollouts raised than `max_exceptions` allows."""


async def gather_trajectory_groups(
    groups: Iterable[TrajectoryGroup],
    *,
    pbar_desc: str | None = "gather",
    max_exceptions: int | float = 0,
    after_each: Callable[[TrajectoryGroup], object] | None = None,
) -> list[TrajectoryGroup]:
    """Await every group; a failed rollout is kept in its group's `exceptions`.

    `after_each(group)`, as ART's: called as each group finishes (awaited if it returns an awaitable, e.g. RULER's
    `ruler_score_group`); what it returns takes the group's place: a group replaces it, a list of groups replaces it
    with those, None drops it.

    `max_exceptions`: how many failed rollouts are tolerated, as a count or (below 1) a fraction of all rollouts.
    Past it, TooManyRolloutErrors is raised from the first failure. The progress bar counts rollouts as each ends and
    shows the mean reward of the groups done and the chat completions per second of `model.openai_client()`s.
    """
    groups = list(groups)
    total = sum(len(g._pending) + len(g.trajectories) + len(g.exceptions) for g in groups)
    bar = tqdm(total=total, desc=pbar_desc, disable=pbar_desc is None, unit="rollout")
    began, answered = time.monotonic(), completions_answered()
    postfix: dict[str, str] = {}

    def show() -> None:
        calls = completions_answered() - answered
        if calls:
            postfix["completions/s"] = f"{calls / max(time.monotonic() - began, 1e-3):.1f}"
        bar.set_postfix(postfix, refresh=False)

    async def counted(rollout: Awaitable[Trajectory]) -> Trajectory:
        try:
            return await rollout
        finally:
            show()
            bar.update(1)

    for group in groups:
        group._pending = [counted(rollout) for rollout in group._pending]
    bar.update(sum(len(g.trajectories) + len(g.exceptions) for g in groups))  # given done

    async def one(group: TrajectoryGroup) -> list[TrajectoryGroup]:
        await group
        finished = [g for g in groups if not g._pending and g.trajectories]
        if finished:
            postfix["reward"] = f"{sum(t.reward for g in finished for t in g) / sum(len(g) for g in finished):.3f}"
            show()
        if after_each is None:
            return [group]
        result = after_each(group)
        if inspect.isawaitable(result):
            result = await result
        return _replacing(group, result)

    try:
        done = await asyncio.gather(*(one(g) for g in groups))
    finally:
        bar.close()
    failures = [e for g in groups for e in g.exceptions]
    allowed = max_exceptions * total if isinstance(max_exceptions, float) and max_exceptions < 1 else max_exceptions
    if len(failures) > allowed:
        raise TooManyRolloutErrors(
            f"{len(failures)} of {total} rollouts raised (allowed: {max_exceptions}); the first: "
            f"{type(failures[0]).__name__}: {failures[0]}. Fix the rollout or raise max_exceptions"
        ) from failures[0]
    return [g for replaced in done for g in replaced]


def _replacing(group: TrajectoryGroup, result: object) -> list[TrajectoryGroup]:
    """What after_each returned, as the groups that take `group`'s place (ART's rule)."""
    if result is None:
        return []
    if isinstance(result, list) and all(_is_group(g) for g in result):
        return result
    if _is_group(result):
        return [result]
    raise TypeError(
        f"after_each returned {type(result).__name__}: return the group (a new one replaces it), a list "
        "of groups, or None to drop it, as in ART"
    )


def _is_group(value: object) -> TypeGuard[TrajectoryGroup]:
    """A trajectory group, art-sky's or ART's (read by its fields)."""
    return hasattr(value, "trajectories") and hasattr(value, "exceptions")
