"""Trajectories and groups, with ART's names and semantics, and their conversion to wire messages."""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Awaitable, Iterable, Mapping
from datetime import datetime
from typing import Any

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from art_sky.errors import ConfigError, first_problem, problems
from art_sky.wire import WireChoice, WireGroup, WireHistory, WireMessage, WireTrajectory

# A message dict, or what a client returned: an openai Choice or ChatCompletion, litellm's Choices, ModelResponse or
# Message, a LangChain message (see `wire_item`).
MessageOrChoice = Choice | dict[str, Any] | Any
_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


class History(BaseModel):
    """A further conversation of the same rollout (ART's `additional_histories`): a sub-agent's chat, a
    summarised context. It trains as its own sequence, with the trajectory's reward."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    messages_and_choices: list[MessageOrChoice] = Field(description="as the Trajectory's")
    tools: list[dict[str, Any]] | None = Field(None, description="as the Trajectory's")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="as the Trajectory's")

    def messages(self) -> list[dict[str, Any]]:
        return _messages(self.messages_and_choices)


class Trajectory(BaseModel):
    """One rollout: the messages it saw, the choices the model sampled, and the reward it earned (ART 0.5's
    fields, so ART's helpers read it)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    messages_and_choices: list[MessageOrChoice] = Field(
        [],
        description="the conversation in order: message dicts (context) and what the client returned for each "
        "sampled turn (an openai Choice or ChatCompletion, litellm's, a LangChain AIMessage), which trains",
    )
    tools: list[dict[str, Any]] | None = Field(
        None, description="the tools the completions were requested with (OpenAI's format)"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="the chat template's arguments the completions were requested with (`extra_body={\"chat_template_"
        'kwargs": ...}`): a turn that came back without its token ids is rendered for training with them, as it '
        "was sampled",
    )
    additional_histories: list[History] = Field(
        [], description="further conversations of this rollout, each trained as a sequence of its own with its reward"
    )
    reward: float = Field(0.0, description="the rollout's score: GRPO's advantage is it against its group's mean")
    initial_policy_version: int | None = Field(
        None, description="ART's: the step that sampled it, where its choices do not say (client/pipeline.py)"
    )
    final_policy_version: int | None = Field(None, description="ART's; kept, not read")
    metrics: dict[str, float | int | bool] = Field(
        {}, description="numbers of this rollout: each step's history has their mean (and Langfuse each as a score)"
    )
    metadata: dict[str, float | int | str | bool | None] = Field(
        {}, description="ART's: the rollout's Langfuse trace carries it (where the model traces to Langfuse)"
    )
    logs: list[str] = Field([], description="lines `log()` added (ART's); kept, not read")
    start_time: datetime = Field(default_factory=datetime.now, description="when it was made")
    end_time: datetime | None = Field(None, description="when `finish()` was called")

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

    trajectories: list[Trajectory] = Field([], description="the rollouts GRPO compares (at least 2 to train)")
    exceptions: list[BaseException] = Field([], description="the rollouts that raised, kept apart (exception_rate)")
    metadata: dict[str, float | int | str | bool | None] = Field({}, description="ART's; kept, not read")
    metrics: dict[str, float | int | bool] = Field({}, description="ART's group-level metrics; kept, not read")
    logs: list[str] = Field([], description="lines `log()` added (ART's); kept, not read")
    _pending: list[Awaitable[Trajectory]] = PrivateAttr(default_factory=list)

    def __init__(
        self,
        trajectories: Iterable[Trajectory | BaseException | Awaitable[Trajectory]] = (),
        exceptions: list[BaseException] | None = None,
        **data: Any,
    ):
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


def wire_groups(groups: Iterable[Any], chat_template_kwargs: dict[str, Any] | None = None) -> list[WireGroup]:
    """Trajectory groups, art-sky's or openpipe-art's (read by their fields), as wire messages. Groups without
    trajectories (every rollout failed) are left out. A malformed trajectory is a ConfigError naming its group,
    its index and the field, before anything is sent. `chat_template_kwargs`: the model's client's, for
    trajectories that do not say their own."""
    wired = []
    for g, group in enumerate(groups):
        if not _field(group, "trajectories"):
            if not _field(group, "exceptions"):
                raise ConfigError(
                    f"group {g} is empty: no trajectories and no failed rollouts. (ART's "
                    "ruler_score_group returns an art.TrajectoryGroup, which keeps only art.Trajectory "
                    "objects: build those rollouts with art.Trajectory)"
                )
            continue
        trajectories = [
            wire_trajectory(t, f"group {g}, trajectory {i}", chat_template_kwargs)
            for i, t in enumerate(_field(group, "trajectories"))
        ]
        try:
            wired.append(WireGroup(trajectories=trajectories))
        except ValidationError as exc:
            raise ConfigError(f"group {g}: {first_problem(exc)[1]}") from exc
    return wired


def wire_trajectory(
    trajectory: Any, where: str = "trajectory", chat_template_kwargs: dict[str, Any] | None = None
) -> WireTrajectory:
    """One trajectory (art-sky's, openpipe-art's, or anything with ART's fields) as a wire message; `where` names it
    in errors. `chat_template_kwargs`: the default where the trajectory and its histories say none."""
    kwargs = _field(trajectory, "chat_template_kwargs") or chat_template_kwargs
    reward = _field(trajectory, "reward")
    if not isinstance(reward, int | float) or not math.isfinite(reward):
        raise ConfigError(f"{where}: reward is {reward!r}, not a finite number: check the rollout's reward function")
    histories = []
    for h, history in enumerate(_field(trajectory, "additional_histories") or []):
        items = _wire_items(_field(history, "messages_and_choices"), f"{where}, additional_histories[{h}]")
        histories.append(
            WireHistory(
                items=items,
                tools=_field(history, "tools"),
                chat_template_kwargs=_field(history, "chat_template_kwargs") or kwargs,
            )
        )
    metrics = {}
    for key, value in (_field(trajectory, "metrics") or {}).items():
        if not isinstance(value, int | float) or not math.isfinite(value):
            raise ConfigError(f"{where}: metrics[{key!r}] is {value!r}, not a finite number")
        metrics[key] = float(value)
    return WireTrajectory(
        items=_wire_items(_field(trajectory, "messages_and_choices"), where),
        reward=reward,
        tools=_field(trajectory, "tools"),
        chat_template_kwargs=kwargs,
        metrics=metrics,
        additional_histories=histories,
    )


def wire_item(item: Any) -> WireChoice | WireMessage:
    """One entry of messages_and_choices as it goes on the wire, from any client's types (duck-typed).

    Sampled turns, trained: a choice (openai `Choice`, litellm `Choices`, or either as a dict), a completion with one
    choice (openai `ChatCompletion`, litellm `ModelResponse`), and an assistant message object a client returned
    (openai `ChatCompletionMessage`, litellm `Message`, LangChain `AIMessage`). They train on the ids the engine
    sampled where they carry them (`token_ids` and `prompt_token_ids`, or `token_id:N` logprob tokens), else on the
    chat template's rendering. Context, not trained: message dicts (an assistant dict too, as in ART) and LangChain's
    other messages.
    """
    if _is_langchain(item):
        return _from_langchain(item)
    if _field(item, "choices") is not None:
        choices = list(_field(item, "choices"))
        if len(choices) != 1:
            raise ConfigError(
                f"a completion with {len(choices)} choices: put the one the conversation continued "
                "with in messages_and_choices (completion.choices[i])"
            )
        return _wire_choice(
            choices[0],
            _field(item, "prompt_token_ids"),
            _step_of_model(_field(item, "model")),
            _field(_field(item, "usage"), "prompt_tokens"),
        )
    if _field(item, "message") is not None:
        return _wire_choice(item)
    if isinstance(item, Mapping):
        return WireMessage(**_message_fields(item))
    if _field(item, "role") == "assistant":
        return _wire_choice({"message": item})
    if _field(item, "role") is not None:
        return WireMessage(**_message_fields(item))
    raise ConfigError(
        f"{type(item).__name__} is neither a chat message nor a choice: messages_and_choices holds "
        "message dicts and the choices (or completions, or LangChain messages) your client returned"
    )


def _wire_items(messages_and_choices: Iterable[Any] | None, where: str) -> list[WireChoice | WireMessage]:
    """Items on the wire, each choice's prompt ids sent after what it shares with the previous choice's prompt and
    sampled ids (multi-turn prompts repeat the conversation so far: without this, a request grows with the square
    of the turns)."""
    if not messages_and_choices:
        raise ConfigError(
            f"{where}: messages_and_choices is empty: a trajectory needs the conversation and the "
            "choices the model sampled"
        )
    wired: list[WireChoice | WireMessage] = []
    previous: list[int] = []
    for i, item in enumerate(messages_and_choices):
        try:
            entry = wire_item(item)
        except (ConfigError, ValidationError, TypeError, ValueError, AttributeError, KeyError) as exc:
            raise ConfigError(f"malformed trajectory ({where}, messages_and_choices[{i}]): {_problem(exc)}") from exc
        if isinstance(entry, WireChoice) and entry.prompt_token_ids is not None:
            prompt = entry.prompt_token_ids
            shared = _shared_prefix(previous, prompt)
            entry.prompt_token_ids, entry.prompt_shared = prompt[shared:], shared
            previous = prompt + (entry.token_ids or [])
        wired.append(entry)
    return wired


def _problem(exc: Exception) -> str:
    """An error on one line; a validation error's first problem as `field: what is wrong`."""
    if isinstance(exc, ValidationError):
        return problems(exc, limit=1, empty="item")
    return str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"


def summarize(groups: Iterable[TrajectoryGroup]) -> dict[str, float]:
    """What `model.log(groups)` records, as ART's `model.log` does: the mean reward, `reward_std_dev` (the mean of
    each group's reward spread: what GRPO learns from), `exception_rate` (failed rollouts) and the mean of every
    trajectory metric."""
    groups = list(groups)
    trajectories = [t for g in groups for t in g.trajectories]
    if not trajectories:
        return {}
    rewards = [t.reward for t in trajectories]
    spreads = [statistics.pstdev(t.reward for t in g.trajectories) for g in groups if len(g.trajectories) > 1]
    failed = sum(len(g.exceptions) for g in groups)
    summary = {
        "reward": sum(rewards) / len(rewards),
        "reward_std_dev": sum(spreads) / len(spreads) if spreads else 0.0,
        "exception_rate": failed / (failed + len(trajectories)),
        "num_trajectories": float(len(rewards)),
    }
    keys = {k for t in trajectories for k in t.metrics}
    for key in sorted(keys - summary.keys()):
        values = [float(t.metrics[key]) for t in trajectories if key in t.metrics]
        summary[key] = sum(values) / len(values)
    return summary


def _messages(messages_and_choices: list[MessageOrChoice]) -> list[dict[str, Any]]:
    """Plain message dicts: dicts as they are, what clients returned (choices, message objects) converted."""
    return [
        dict(item) if isinstance(item, Mapping) and "role" in item else wire_item(item).message()
        for item in messages_and_choices
    ]


def _shared_prefix(a: list[int], b: list[int]) -> int:
    if len(b) >= len(a) and b[: len(a)] == a:  # the usual case: the next prompt extends the conversation
        return len(a)
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _wire_choice(
    choice: Any, prompt_token_ids: list[int] | None = None, step: int | None = None, prompt_tokens: int | None = None
) -> WireChoice:
    message = _field(choice, "message")
    extra = _field(choice, "provider_specific_fields") or {}  # where litellm keeps fields it does not know
    step = _first(_field(choice, "art_sky_step"), _field(extra, "art_sky_step"), step)
    token_ids = _first(_field(choice, "token_ids"), _field(extra, "token_ids"))
    prompt = _first(_field(choice, "prompt_token_ids"), _field(extra, "prompt_token_ids"), prompt_token_ids)
    token_ids, logprobs = _sampled(token_ids, _field(_field(choice, "logprobs"), "content"))
    fields = _message_fields(message)
    return WireChoice(
        content=fields.get("content"),
        tool_calls=fields.get("tool_calls"),
        reasoning_content=fields.get("reasoning_content"),
        token_ids=token_ids,
        logprobs=logprobs,
        prompt_token_ids=None if prompt is None else list(prompt),
        prompt_tokens=_count(prompt_tokens),
        step=step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None,
    )


def _step_of_model(model: Any) -> int | None:
    """The step in a completion's `model` (`name@step`, as art-sky's server names the adapter that served it)."""
    step = model.rpartition("@")[2] if isinstance(model, str) and "@" in model else ""
    return int(step) if step.isdigit() else None


def _sampled(token_ids: Any, content: Any) -> tuple[list[int] | None, list[float | None] | None]:
    """The sampled ids (`token_ids`, else logprob tokens written as `token_id:N`) and their logprobs."""
    entries = list(content or [])
    tokens = [_field(entry, "token") for entry in entries]
    if token_ids is None and tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        token_ids = [int(t.removeprefix("token_id:")) for t in tokens]
    if token_ids is None:
        return None, None
    token_ids = list(token_ids)
    if len(entries) != len(token_ids):  # no logprobs, or not one per sampled id: the on-policy path
        return token_ids, None
    values = [_field(entry, "logprob") for entry in entries]
    return token_ids, [float(v) if isinstance(v, int | float) and math.isfinite(v) else None for v in values]


def _message_fields(message: Any) -> dict[str, Any]:
    """The fields of a chat message (dict or object) that templates read."""
    fields = {key: _plain(_field(message, key)) for key in _MESSAGE_KEYS}
    extra = _field(message, "provider_specific_fields") or {}
    fields["reasoning_content"] = _first(
        _field(message, "reasoning_content"), _field(message, "reasoning"), _field(extra, "reasoning_content")
    )
    if not fields["tool_calls"]:
        fields["tool_calls"] = None
    return {key: value for key, value in fields.items() if value is not None}


def _is_langchain(item: Any) -> bool:
    return type(item).__module__.startswith("langchain") and isinstance(getattr(item, "type", None), str)


def _from_langchain(message: Any) -> WireChoice | WireMessage:
    """LangChain messages through LangChain's own OpenAI conversion; an AIMessage (or a streamed AIMessageChunk) is a
    sampled turn, whose logprobs carry the sampled ids when the request asked for `return_tokens_as_token_ids`."""
    from langchain_core.messages import convert_to_openai_messages

    fields = _message_fields(convert_to_openai_messages(message))
    if fields.get("role") != "assistant":
        return WireMessage(**fields)
    reasoning = (getattr(message, "additional_kwargs", None) or {}).get("reasoning_content")
    logprobs = (getattr(message, "response_metadata", None) or {}).get("logprobs") or {}
    token_ids, values = _sampled(None, logprobs.get("content"))
    usage = getattr(message, "usage_metadata", None) or {}  # its prompt is rendered again: its length is a check
    return WireChoice(
        content=fields.get("content"),
        tool_calls=fields.get("tool_calls"),
        reasoning_content=reasoning,
        token_ids=token_ids,
        logprobs=values,
        prompt_tokens=_count(usage.get("input_tokens")),
    )


def _count(value: Any) -> int | None:
    """A token count a client reported, if it is one."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _field(obj: Any, name: str) -> Any:
    """A field of a dict or an object (pydantic models keep unknown fields, such as vLLM's token ids, as attributes)."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _plain(value: Any) -> Any:
    """Objects (pydantic models, lists of them) as the dicts the wire carries."""
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_none=True)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
