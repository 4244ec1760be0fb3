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
from art_sky.wire import WireChoice, WireGroup, WireMessage, WireTrajectory

MessageOrChoice = Choice | dict[str, Any]
_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


class Trajectory(BaseModel):
    """One rollout: the messages it saw, the choices the model sampled, and the reward it earned."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    messages_and_choices: list[MessageOrChoice] = []
    tools: list[dict[str, Any]] | None = None
    reward: float = 0.0
    metrics: dict[str, float | int | bool] = {}
    metadata: dict[str, Any] = {}
    logs: list[str] = []
    start_time: datetime = Field(default_factory=datetime.now)
    end_time: datetime | None = None

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as plain message dicts, choices turned into assistant messages."""
        return [_choice_message(item) if isinstance(item, Choice) else dict(item) for item in self.messages_and_choices]

    def finish(self) -> Trajectory:
        self.end_time = datetime.now()
        return self

    def log(self, message: str) -> None:
        self.logs.append(message)

    def to_wire(self) -> WireTrajectory:
        items: list[WireChoice | WireMessage] = []
        try:
            for item in self.messages_and_choices:
                items.append(_wire_choice(item) if isinstance(item, Choice) else
                             WireMessage(**{k: item[k] for k in _MESSAGE_KEYS if item.get(k) is not None}))
            return WireTrajectory(items=items, reward=self.reward, tools=self.tools,
                                  metrics={k: float(v) for k, v in self.metrics.items()})
        except (ValidationError, TypeError, AttributeError) as exc:
            raise ConfigError(f"malformed trajectory (item {len(items)}): {exc}") from exc


class TrajectoryGroup(BaseModel):
    """Trajectories of the same scenario, compared with each other by GRPO.

    As in ART, it may be built from awaitables (`TrajectoryGroup(rollout(model) for _ in range(8))`): awaiting
    it runs them concurrently and keeps the exceptions apart.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    trajectories: list[Trajectory] = []
    exceptions: list[BaseException] = []
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

    def to_wire(self) -> WireGroup:
        try:
            return WireGroup(trajectories=[t.to_wire() for t in self.trajectories])
        except ValidationError as exc:
            raise ConfigError(f"malformed trajectory group: {exc.errors()[0]['msg']}") from exc


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


def _choice_message(choice: Choice) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.message.content}
    if choice.message.tool_calls:
        message["tool_calls"] = [call.model_dump() for call in choice.message.tool_calls]
    return message


def _wire_choice(choice: Choice) -> WireChoice:
    token_ids, logprobs = None, None
    content = choice.logprobs.content if choice.logprobs else None
    if content is not None and all(t.token.startswith("token_id:") for t in content):
        token_ids = [int(t.token.removeprefix("token_id:")) for t in content]
        logprobs = [t.logprob if math.isfinite(t.logprob) else None for t in content]
    message = _choice_message(choice)
    return WireChoice(content=message["content"], tool_calls=message.get("tool_calls"), token_ids=token_ids,
                      logprobs=logprobs)
