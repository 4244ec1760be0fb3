"""Trajectories ART records its capture way (0.5.20+: `with art.trajectory(...)`, `art.trajectory_group(...)`,
`yield_trajectory`): the requests and responses its client saw, in `Trajectory.exchanges`, instead of
`messages_and_choices`. art-sky trains the conversations those exchanges hold.

Each chat completion exchange is a request's messages (with its tools and chat template arguments) and the choice
the model sampled; an exchange whose messages continue an earlier one's conversation (its messages, then that
choice) is that conversation's next turn. The first conversation is the trajectory's, the others its additional
histories. Every choice art-sky's server returned carries its prompt and sampled ids, so each trains exactly; the
server still checks each turn's context token for token.
"""

from __future__ import annotations

from typing import Any

from art_sky.client.trajectories import History, Trajectory
from art_sky.errors import ConfigError

_OTHER_KINDS = {"completions": "/v1/completions", "responses": "/v1/responses", "messages": "Anthropic's /v1/messages"}


def conversations(group: Any) -> Any:
    """A group whose trajectories ART recorded its capture way, as one of conversations; any other as it is."""
    trajectories = getattr(group, "trajectories", None)
    if not trajectories or not any(captured(t) for t in trajectories):
        return group
    return {"trajectories": [legacy(t) for t in trajectories], "exceptions": list(getattr(group, "exceptions", []))}


def captured(trajectory: Any) -> bool:
    """Whether ART recorded the trajectory its capture way (exchanges of any kind)."""
    exchanges = getattr(trajectory, "exchanges", None)
    return any(getattr(exchanges, kind, None) for kind in ("chat_completions", *_OTHER_KINDS))


def legacy(trajectory: Any) -> Any:
    """The trajectory as conversations (`messages_and_choices`, `additional_histories`): as it is when it has no
    captured exchanges, else built from them (art-sky's Trajectory, with the reward, metrics and metadata)."""
    exchanges = getattr(trajectory, "exchanges", None)
    calls = list(getattr(exchanges, "chat_completions", None) or [])
    others = [kind for kind in _OTHER_KINDS if getattr(exchanges, kind, None)]
    if others:
        raise ConfigError(
            f"the trajectory captured {', '.join(_OTHER_KINDS[k] for k in others)} exchanges: art-sky "
            "serves and trains chat completions (/v1/chat/completions) only"
        )
    if not calls:
        return trajectory
    conversations: list[History] = []
    for call in calls:
        request = call.request if isinstance(call.request, dict) else dict(call.request)
        messages = [dict(m) for m in request.get("messages") or []]
        for choice in call.response.choices:
            conversation = _continued(conversations, messages)
            if conversation is None:
                conversation = History(
                    messages_and_choices=list(messages),
                    tools=request.get("tools"),
                    chat_template_kwargs=request.get("chat_template_kwargs"),
                )
                conversations.append(conversation)
            else:
                conversation.messages_and_choices += messages[_length(conversation) :]
            conversation.messages_and_choices.append(_with_prompt(choice, call.response))
    main, *others_ = conversations
    return Trajectory(
        messages_and_choices=main.messages_and_choices,
        tools=main.tools,
        chat_template_kwargs=main.chat_template_kwargs,
        additional_histories=others_,
        reward=trajectory.reward,
        metrics=dict(trajectory.metrics),
        metadata=dict(trajectory.metadata),
        logs=list(trajectory.logs),
        initial_policy_version=trajectory.initial_policy_version,
        final_policy_version=trajectory.final_policy_version,
    )


def _continued(conversations: list[History], messages: list[dict]) -> History | None:
    """The conversation these request messages continue: its messages so far (a sampled turn matching any assistant
    message: the client serialises it its own way), then an assistant turn (the choice it sampled last)."""
    for conversation in reversed(conversations):
        done = conversation.messages_and_choices
        if (
            len(messages) > len(done)
            and messages[len(done) - 1].get("role") == "assistant"
            and all(
                given.get("role") == "assistant" if not isinstance(item, dict) else given == item
                for item, given in zip(done[:-1], messages, strict=False)
            )
        ):
            return conversation
    return None


def _length(conversation: History) -> int:
    return len(conversation.messages_and_choices)


def _with_prompt(choice: Any, response: Any) -> Any:
    """The choice, carrying the completion's prompt ids where only the completion has them."""
    extra = getattr(choice, "model_extra", None)
    prompt = (getattr(response, "model_extra", None) or {}).get("prompt_token_ids")
    if isinstance(extra, dict) and "prompt_token_ids" not in extra and prompt is not None:
        extra["prompt_token_ids"] = prompt
    return choice
