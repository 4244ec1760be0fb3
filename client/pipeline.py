"""Pipelined GRPO: gather the next batch while the current step trains, with a bound on staleness.

A rollout's policy version is the adapter step that sampled it: the server puts it on every choice
(`art_sky_step`), the wire carries it (`WireChoice.step`), and a trajectory's version is its oldest sampled turn's
(else ART's `initial_policy_version`; else unknown, taken as current). A step trains at the model's step S; a
group whose version is below S - max_steps_off_policy is dropped, as ART's PipelineTrainer drops it, and counted
in the step's metrics (`discarded_stale_groups`; `steps_off_policy` is the kept trajectories' mean lag). Kept ones
train against their own sampled logprobs (the behaviour policy's), whatever step now trains, so a group behind S
whose sampled turns lack logprobs is dropped too: its ratio could only be taken against the current policy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from art_sky.errors import ConfigError
from art_sky.wire import TrainConfig, WireChoice, WireGroup, WireTrajectory

from .trajectories import _field

if TYPE_CHECKING:
    from .model import TrainableModel
    from .trajectories import TrajectoryGroup


def group_versions(groups: Sequence[Any], wired: Sequence[WireGroup]) -> list[int | None]:
    """Each wired group's policy version: its oldest trajectory's (`wire_groups` leaves out groups without
    trajectories, so the source groups are matched to the wired ones the same way)."""
    sources = [g for g in groups if _field(g, "trajectories")]
    versions = []
    for source, group in zip(sources, wired, strict=True):
        known = [
            v for v in map(trajectory_version, group.trajectories, _field(source, "trajectories")) if v is not None
        ]
        versions.append(min(known) if known else None)
    return versions


def trajectory_version(wired: WireTrajectory, source: Any = None) -> int | None:
    """The step of the oldest adapter that sampled a turn of this trajectory; else ART's `initial_policy_version`
    of the source trajectory; else None."""
    steps = [c.step for h in wired.histories() for c in h.items if isinstance(c, WireChoice) and c.step is not None]
    if steps:
        return min(steps)
    version = _field(source, "initial_policy_version")
    return version if isinstance(version, int) and not isinstance(version, bool) else None


def drop_stale(
    wired: list[WireGroup], versions: list[int | None], step: int, max_steps_off_policy: int | None
) -> tuple[list[WireGroup], dict[str, float]]:
    """The groups a step at model step `step` may train on, and the step's staleness metrics. No bound (None): every
    group trains (an ART program's own loop, e.g. ART's PipelineTrainer, bounds staleness itself)."""
    kept, lags, dropped = [], [], 0
    for group, version in zip(wired, versions, strict=True):
        behind = 0 if version is None else max(0, step - version)
        if max_steps_off_policy is not None and (
            behind > max_steps_off_policy or (behind and not _has_logprobs(group))
        ):
            dropped += 1
            continue
        kept.append(group)
        lags += [behind] * len(group.trajectories)
    return kept, {"discarded_stale_groups": float(dropped), "steps_off_policy": sum(lags) / len(lags) if lags else 0.0}


def check_bound(max_steps_off_policy: Any) -> int | None:
    if max_steps_off_policy is None:
        return None
    if not isinstance(max_steps_off_policy, int) or isinstance(max_steps_off_policy, bool) or max_steps_off_policy < 0:
        raise ConfigError(
            f"max_steps_off_policy={max_steps_off_policy!r}: give a whole number >= 0 (0: train only on "
            "rollouts of the current step; 1, the default: also those of the step before)"
        )
    return max_steps_off_policy


def _has_logprobs(group: WireGroup) -> bool:
    return all(
        c.logprobs is not None
        for t in group.trajectories
        for h in t.histories()
        for c in h.items
        if isinstance(c, WireChoice)
    )


async def pipeline(
    model: TrainableModel,
    rollouts: Callable[[int], Awaitable[Iterable[TrajectoryGroup]]],
    steps: int,
    *,
    config: TrainConfig | None = None,
    max_steps_off_policy: int = 1,
    head_start: float = 1.0,
    on_step: Callable[[int, dict[str, float]], Any] | None = None,
) -> list[dict[str, float]]:
    """Train `steps` GRPO steps, gathering batch i+1 (`await rollouts(i + 1)`) while step i trains on batch i.

    The next batch starts first, and the step is sent once the batch's first completions are answered (or after
    `head_start` seconds if it has sent none by then): sampling is compute, the step is compute, and on one device
    they would share it (bench_pipeline: sending the step at once made the pipelined run 1.05x, this 1.49x), while
    the rollouts' waiting on tools and environments overlaps the step for free. The later turns of multi-turn
    rollouts are sampled by the previous step while the step trains, where the server serves while training (/health's
    `serves_while_training`), or wait for it where it pauses inference. Returns each step's metrics (`model.train`'s,
    plus `reward`, the batch's mean rollout reward); `on_step(i, metrics)` is called as each step ends.

    `config` defaults to CISPO (as ART's PipelineTrainer): a token whose ratio to its behaviour policy is clipped
    still gets a (bounded) gradient, where PPO's clip gives it none. With large updates, one step off policy is
    enough for PPO to clip most tokens: on the demo task (bench/bench_pipeline.py --groups 8) the 10th step's
    rollouts scored 0.18 pipelined against 0.99 sequentially with PPO, 1.00 against 1.00 with CISPO.
    """
    check_bound(max_steps_off_policy)
    if not isinstance(head_start, int | float) or head_start < 0:
        raise ConfigError(f"pipeline(head_start={head_start!r}): give seconds >= 0")
    if not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"pipeline(steps={steps!r}): give the number of training steps, a whole number >= 0")
    config = config or TrainConfig(loss_fn="cispo")
    results: list[dict[str, float]] = []
    groups = list(await rollouts(0)) if steps else []
    for i in range(steps):
        following = asyncio.ensure_future(rollouts(i + 1)) if i + 1 < steps else None
        try:
            if following is not None:
                await _first_turns_answered(model, following, head_start)
            training = await model.train(groups, config, wait=False, max_steps_off_policy=max_steps_off_policy)
            assert isinstance(training, asyncio.Task)  # wait=False
            metrics = await training
        except BaseException:
            if following is not None:
                following.cancel()
            raise
        metrics = metrics | {"reward": _mean_reward(groups)}
        results.append(metrics)
        if on_step is not None:
            on_step(i, metrics)
        groups = list(await following) if following is not None else []
    return results


async def _first_turns_answered(model: TrainableModel, following: asyncio.Future, head_start: float) -> None:
    """Wait until the batch that just started has sent completions (at most `head_start` seconds) and none of the
    model's completions is waiting any more, or the batch is done."""
    sampling, loop = model._sampling, asyncio.get_running_loop()
    sent, deadline = sampling.sent, loop.time() + head_start

    async def change(timeout: float | None) -> None:
        sampling.changed.clear()
        changed = asyncio.ensure_future(sampling.changed.wait())
        await asyncio.wait([following, changed], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        changed.cancel()

    while sampling.sent == sent and not following.done() and loop.time() < deadline:
        await change(deadline - loop.time())
    while sampling.count and not following.done():
        await change(None)


def _mean_reward(groups: Iterable[Any]) -> float:
    rewards = [t.reward for g in groups for t in g.trajectories]
    return sum(rewards) / len(rewards) if rewards else 0.0
