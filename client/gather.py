"""`gather_trajectory_groups`: run every group's rollouts concurrently, with a progress bar and an exception budget."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from tqdm.auto import tqdm

from art_sky.errors import ArtSkyError

from .trajectories import TrajectoryGroup


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

    `max_exceptions`: how many failed rollouts are tolerated, as a count or (below 1) a fraction of all rollouts.
    Past it, TooManyRolloutErrors is raised from the first failure.
    """
    groups = list(groups)
    total = sum(len(g._pending) + len(g.trajectories) + len(g.exceptions) for g in groups)
    bar = tqdm(total=total, desc=pbar_desc, disable=pbar_desc is None)

    async def one(group: TrajectoryGroup) -> TrajectoryGroup:
        await group
        bar.update(len(group.trajectories) + len(group.exceptions))
        if group.trajectories:
            bar.set_postfix(reward=f"{sum(t.reward for t in group) / len(group):.3f}")
        if after_each is not None:
            result = after_each(group)
            if asyncio.iscoroutine(result):
                await result
        return group

    try:
        done = await asyncio.gather(*(one(g) for g in groups))
    finally:
        bar.close()
    failures = [e for g in done for e in g.exceptions]
    allowed = max_exceptions * total if isinstance(max_exceptions, float) and max_exceptions < 1 else max_exceptions
    if len(failures) > allowed:
        raise TooManyRolloutErrors(
            f"{len(failures)} of {total} rollouts raised (allowed: {max_exceptions}); the first: "
            f"{type(failures[0]).__name__}: {failures[0]}. Fix the rollout or raise max_exceptions"
        ) from failures[0]
    return done
