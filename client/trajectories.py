"""Trajectories and groups, with ART's names and semantics, and their conversion to wire messages."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Iterable
from datetime import datetime
from typing import Any

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from art_sky.errors import ConfigError
from art_sky.wire import WireChoice, WireGroup, WireHistory, WireMessage, WireTrajectory

MessageOrChoice = Choice | dict[str, Any]
_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


class History(BaseModel):
    """A further conversation of the same rollout (ART's `additional_histories`): a sub-agent's chat, a
    summarised context. It trains as its own sequence, with the trajectory's reward."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    messages_and_choices: list[MessageOrChoice]
    tools: list[dict[str, Any]] | None = None

    def messages(self) -> list[dict[str, Any]]:
        return _messages(self.messages_and_choices)


class Trajectory(BaseModel):
    """One rollout: the messages it saw, the choices the model sampled, and the reward it earned (ART 0.5's
    fields, so ART's helpers read it)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    messages_and_choices: list[MessageOrChoice] = []
    tools: list[dict[str, Any]] | None = None
    additional_histories: list[History] = []
    reward: float = 0.0
    initial_policy_version: int | None = None
    final_policy_version: int | None = None
    metrics: dict[str, float | int | bool] = {}
    metadata: dict[str, float | int | str | bool | None] = {}
    logs: list[str] = []
    start_time: datetime = Field(default_factory=datetime.now)
    end_time: datetime | None = None

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as plain message dicts, choices turned into assistant messages."""
        return _messages(self.messages_and_choices)

    def finish(self) -> Trajectory:
        """Mark the rollout done; as in ART, its duration in seconds becomes the metric `duration`."""
        self.end_time = datetime.now()
        self.metrics["duration"] = (self.end_time - self.start_time).total_seconds()
        return self

    def log(self, message: str) -> None:
        self.logs.append(message)


class TrajectoryGroup(BaseModel):
    """Trajectories of the same scenario, compared with each other by GRPO; with ART's group-level `metrics`,
    `metadata` and `logs`.

    As in ART, it may be built from awaitables (`TrajectoryGroup(rollout(model) for _ in range(8))`): awaiting
    it runs them concurrently and keeps the exceptions apart.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    trajectories: list[Trajectory] = []
    exceptions: list[BaseException] = []
    metadata: dict[str, float | int | str | bool | None] = {}
    metrics: dict[str, float | int | bool] = {}
    logs: list[str] = []
    _pending: list[Awaitable[Trajectory]] = PrivateAttr(default_factory=list)

    def __init__(self, trajectories: Iterable[Trajectory | BaseException | Awaitable[Trajectory]] = (),
                 exceptions: list[BaseException] | None = None, **data: Any):
        items = list(trajectories)
        done = [t for t in items if isinstance(t, Trajectory)]
        errors = [t for t in items if isinstance(t, BaseException)] + list(exceptions or [])
        super().__init__(trajectories=done, exceptions=errors, **data)
        self._pending = [t for t in items if not isinstance(t, Trajectory | BaseException)]

    def __await__(self):
        return self._gather().__await__()

    async def _gather(self) -> TrajectoryGroup:
        results = await asyncio.gather(*self._pending, return_exceptions=True)
        self._pending = []
        for result in results:
            if isinstance(result, Trajectory):
                self.trajectories.append(result)
            elif isinstance(result, BaseException):
                if not isinstance(result, Exception):  # KeyboardInterrupt, CancelledError: not a rollout failure
                    raise result
                self.exceptions.append(result)
            else:
                self.exceptions.append(TypeError(f"rollout returned {type(result).__name__}, not a Trajectory"))
        return self

    def __iter__(self):
        return iter(self.trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)

    def log(self, message: str) -> None:
        self.logs.append(message)


def wire_groups(groups: Iterable[Any]) -> list[WireGroup]:
    """Trajectory groups, art-sky's or openpipe-art's (read by their fields), as wire messages. Groups without
    trajectories (every rollout failed) are left out. A malformed trajectory is a ConfigError naming its group,
    its index and the field, before anything is sent."""
    wired = []
    for g, group in enumerate(groups):
        if not group.trajectories:
            if not group.exceptions:
                raise ConfigError(f"group {g} is empty: no trajectories and no failed rollouts. (ART's "
                                  "ruler_score_group returns an art.TrajectoryGroup, which keeps only art.Trajectory "
                                  "objects: build those rollouts with art.Trajectory)")
            continue
        trajectories = [wire_trajectory(t, f"group {g}, trajectory {i}") for i, t in enumerate(group.trajectories)]
        try:
            wired.append(WireGroup(trajectories=trajectories))
        except ValidationError as exc:
            raise ConfigError(f"group {g}: {exc.errors()[0]['msg'].removeprefix('Value error, ')}") from exc
    return wired


def wire_trajectory(trajectory: Any, where: str) -> WireTrajectory:
    """One trajectory (art-sky's or openpipe-art's) as a wire message; `where` names it in errors."""
    reward = trajectory.reward
    if not isinstance(reward, int | float) or not math.isfinite(reward):
        raise ConfigError(f"{where}: reward is {reward!r}, not a finite number: check the rollout's reward function")
    histories = []
    for h, history in enumerate(getattr(trajectory, "additional_histories", None) or []):
        items = _wire_items(history.messages_and_choices, f"{where}, additional_histories[{h}]")
        histories.append(WireHistory(items=items, tools=history.tools))
    metrics = {}
    for key, value in trajectory.metrics.items():
        if not isinstance(value, int | float) or not math.isfinite(value):
            raise ConfigError(f"{where}: metrics[{key!r}] is {value!r}, not a finite number")
        metrics[key] = float(value)
    return WireTrajectory(items=_wire_items(trajectory.messages_and_choices, where), reward=reward,
                          tools=trajectory.tools, metrics=metrics, additional_histories=histories)


def _wire_items(messages_and_choices: list[Any], where: str) -> list[WireChoice | WireMessage]:
    if not messages_and_choices:
        raise ConfigError(f"{where}: messages_and_choices is empty: a trajectory needs the conversation and the "
                          "choices the model sampled")
    items = []
    for i, item in enumerate(messages_and_choices):
        try:
            items.append(_wire_item(item))
        except (ValidationError, TypeError, AttributeError, KeyError) as exc:
            raise ConfigError(f"malformed trajectory ({where}, messages_and_choices[{i}]): {_problem(exc)}") from exc
    return items


def _wire_item(item: Any) -> WireChoice | WireMessage:
    """One message dict or sampled Choice as a wire item."""
    if isinstance(item, Choice):
        return _wire_choice(item)
    return WireMessage(**{k: item[k] for k in _MESSAGE_KEYS if item.get(k) is not None})


def _problem(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        return f"{'.'.join(str(p) for p in first['loc']) or 'item'}: {first['msg']}"
    return f"{type(exc).__name__}: {exc}"


def summarize(groups: Iterable[TrajectoryGroup]) -> dict[str, float]:
    """Mean reward, its spread and the mean of every trajectory metric: what `model.log()` records."""
    trajectories = [t for g in groups for t in g.trajectories]
    if not trajectories:
        return {}
    rewards = [t.reward for t in trajectories]
    mean = sum(rewards) / len(rewards)
    summary = {"reward": mean, "reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
               "num_trajectories": float(len(rewards))}
    keys = {k for t in trajectories for k in t.metrics}
    for key in sorted(keys - summary.keys()):
        values = [float(t.metrics[key]) for t in trajectories if key in t.metrics]
        summary[key] = sum(values) / len(values)
    return summary


def _messages(messages_and_choices: list[MessageOrChoice]) -> list[dict[str, Any]]:
    return [_choice_message(item) if isinstance(item, Choice) else dict(item) for item in messages_and_choices]


def _choice_message(choice: Choice) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.message.content}
    if choice.message.tool_calls:
        message["tool_calls"] = [call.model_dump() for call in choice.message.tool_calls]
    return message


def _wire_choice(choice: Choice) -> WireChoice:
    token_ids, logprobs = None, None
    content = choice.logprobs.content if choice.logprobs else None
    sampled = getattr(choice, "token_ids", None)  # the engine's per-choice sampled ids (vLLM's `token_ids`)
    if content is not None and all(t.token.startswith("token_id:") for t in content):
        token_ids = [int(t.token.removeprefix("token_id:")) for t in content]
    elif sampled is not None:
        token_ids = [int(t) for t in sampled]
    if token_ids is not None and content is not None and len(content) == len(token_ids):
        logprobs = [t.logprob if math.isfinite(t.logprob) else None for t in content]
    message = _choice_message(choice)
    return WireChoice(content=message["content"], tool_calls=message.get("tool_calls"), token_ids=token_ids,
                      logprobs=logprobs)
