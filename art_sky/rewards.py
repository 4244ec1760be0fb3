"""RULER, ART's LLM-as-judge reward, for `import art_sky as art` (`art.rewards.ruler_score_group`): the judge ranks a
group's trajectories relative to each other and its scores become their rewards. ART's signature and metrics
(`independent_reward`, `ruler_score`); it scores art-sky's trajectories and ART's.

The judge is any OpenAI-compatible model litellm reaches: an OpenAI model ("openai/o3"), any litellm id, or the
cluster's own endpoint, a base model registered next to the trained one (pass that model, or its
`litellm_completion_params()` in `extra_litellm_params`). Its reply is constrained to the scores' JSON schema
(response_format), which both engines enforce as compact JSON. The schema bounds every field (an explanation of at most
MAX_EXPLANATION characters, a score in hundredths), so a reply's length has a bound RULER computes and asks for as
max_tokens: a judge that follows the schema always finishes. Needs litellm (`pip install "art-sky[rewards]"`).
"""

from __future__ import annotations

import copy
import json
import logging
from textwrap import dedent
from typing import Any

from pydantic import BaseModel, Field

from art_sky.errors import ArtSkyError, ConfigError

log = logging.getLogger("art_sky")

DEFAULT_RUBRIC = dedent("""
    - A trajectory that achieves its goal should always get a significantly higher score than a trajectory that does not achieve its goal.
    - A trajectory that achieves its goal more efficiently (eg. by avoiding unproductive detours) should get a higher score than a trajectory that achieves its goal less efficiently.
    - If one trajectory is only slightly better than another, the difference in scores should be small. If it is significantly better, the difference in scores should be large.
    - You may give some partial credit for a trajectory that makes progress towards its goal but does not complete it.
""")  # noqa: E501 (ART's rubric, word for word)


class JudgeError(ArtSkyError):
    """The judge could not be reached or did not answer with scores; the group's rollouts are unchanged."""


MAX_EXPLANATION = 200  # characters


class TrajectoryScore(BaseModel):
    trajectory_id: str
    explanation: str = Field(
        max_length=MAX_EXPLANATION, description="A short description of the trajectory's performance."
    )
    score: float = Field(ge=0, le=1, description="A score between 0 and 1.")


def reply_bound(count: int) -> int:
    """The most tokens a judge's reply for `count` trajectories can take: its longest compact JSON in bytes (each
    explanation character at its longest in UTF-8, a space after each separator; no tokenizer spends less than a
    byte on a token), and the end."""
    item = {"trajectory_id": str(count), "explanation": "\U0001f600" * MAX_EXPLANATION, "score": 0.25}
    return len(json.dumps({"scores": [item] * count}, ensure_ascii=False).encode()) + 1


_SCORES = [0, *(round(i / 100, 2) for i in range(1, 100)), 1]  # hundredths: a score is at most 4 characters


def _response_format(count: int) -> dict:
    """The judge's reply: exactly one score per trajectory sent, its id one of theirs (ART's fields, bounded: the
    score one of the hundredths, which every grammar backend and OpenAI's strict mode enforce)."""
    item = TrajectoryScore.model_json_schema() | {"additionalProperties": False}
    item["properties"] = item["properties"] | {
        "trajectory_id": {"enum": [str(i) for i in range(1, count + 1)]},
        "score": item["properties"]["score"] | {"enum": _SCORES},
    }
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["scores"],
        "properties": {"scores": {"type": "array", "minItems": count, "maxItems": count, "items": item}},
    }
    return {"type": "json_schema", "json_schema": {"name": "ruler_scores", "schema": schema, "strict": True}}


def _judge_prompt(message_lists: list[list[dict]], tools: Any, rubric: str) -> list[dict]:
    """ART's prompt: the shared prefix once, then each trajectory's rest."""
    shared = 0
    while all(len(m) > shared and m[shared] == message_lists[0][shared] for m in message_lists):
        shared += 1
    text = f"<context>\n{json.dumps(message_lists[0][:shared], default=str)}\n</context>\n\n" if shared else ""
    if tools:
        text += f"<available_tools>\n{json.dumps(tools, default=str)}\n</available_tools>\n\n"
    text += "Trajectories:\n\n" + "\n\n".join(
        f'<trajectory id="{i}">\n{json.dumps(m[shared:], default=str)}\n</trajectory>'
        for i, m in enumerate(message_lists, start=1)
    )
    system = (
        "All of the trajectories below have been given the same goal. Your job is to consider each of them and "
        "give them a score between 0 and 1. Take into consideration your best judgement of the agent's goal."
        f"\n\nGrading standards:\n{rubric}"
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": text}]


async def ruler(
    message_lists: list[list[dict]],
    judge_model: Any = "openai/o3",
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str = DEFAULT_RUBRIC,
    tools: list[dict] | None = None,
    *,
    debug: bool = False,
) -> list[TrajectoryScore]:
    """One score per message list, from the judge (ART's `ruler`)."""
    import litellm  # the [rewards] extra; imported here so `art.rewards` loads without it
    import openai

    if not message_lists:
        return []
    params = dict(extra_litellm_params or {})
    if not isinstance(judge_model, str):  # an art-sky or ART model: its endpoint, key and name
        params = judge_model.litellm_completion_params() | params
        judge_model = params.pop("model")
    url = params.get("base_url") or params.get("api_base") or "the provider's default URL"
    count = len(message_lists)
    if "max_tokens" not in params and "max_completion_tokens" not in params:
        params["max_tokens"] = reply_bound(count)
    try:
        response = await litellm.acompletion(
            model=judge_model,
            messages=_judge_prompt(message_lists, tools, rubric),
            response_format=_response_format(count),
            caching=False,
            **params,
        )
    except Exception as exc:  # litellm's errors (openai's classes), whose class does not say "unreachable" (a
        # refused connection comes back as its InternalServerError): the cause chain does
        if not isinstance(exc, openai.APIError) and not _unreachable(exc):
            raise
        problem = "cannot be reached" if _unreachable(exc) else "refused the request"
        raise JudgeError(
            f"RULER's judge {judge_model!r} at {url} {problem} ({exc}): start it or name another "
            "judge; the rollouts are kept"
        ) from exc
    content = response.choices[0].message.content or ""
    if debug:
        log.info("RULER judge %s answered: %s", judge_model, content)
    if response.choices[0].finish_reason == "length":
        raise JudgeError(_cut(judge_model, url, response, params, count))
    try:
        # strict=False: a control character in an explanation (vLLM's xgrammar lets a weak judge write one raw)
        scores = [TrajectoryScore.model_validate(s) for s in json.loads(content, strict=False)["scores"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise JudgeError(
            f"RULER's judge {judge_model!r} at {url} did not answer with scores ({exc}): {content[:300]!r}"
        ) from exc
    if len(scores) != len(message_lists):
        raise JudgeError(
            f"RULER's judge {judge_model!r} gave {len(scores)} scores for {len(message_lists)} trajectories"
        )
    return scores


def _cut(judge_model: str, url: str, response: Any, params: dict[str, Any], count: int) -> str:
    """Why a judge's reply stopped before its JSON ended: the max_tokens asked for, or the judge's context."""
    asked = params.get("max_tokens") or params.get("max_completion_tokens")
    usage = getattr(response, "usage", None)
    written = getattr(usage, "completion_tokens", None)
    start = f"RULER's judge {judge_model!r} at {url} was cut off before its scores' JSON ended"
    if written is not None and asked is not None and written < asked:
        return (
            f"{start}: by its context window, after {written} tokens (its prompt: "
            f"{getattr(usage, 'prompt_tokens', '?')} tokens). Give the judge a longer context (max_seq_length) "
            "or judge smaller groups"
        )
    bound = reply_bound(count)
    if asked is None:  # extra_litellm_params gave max_tokens as None (or 0): the judge's own limit cut it
        given = {key: params[key] for key in ("max_tokens", "max_completion_tokens") if key in params}
        return (
            f"{start}: by the judge's own limit ({given} in extra_litellm_params); a reply for {count} trajectories "
            f"takes at most {bound} tokens: leave max_tokens out (RULER then asks for that many)"
        )
    todo = (
        "leave max_tokens out of extra_litellm_params (RULER then asks for that many) or raise it"
        if asked < bound
        else "the judge did not keep to the scores' schema: use a judge that enforces response_format"
    )
    return f"{start}: by max_tokens={asked}; a reply for {count} trajectories takes at most {bound} tokens: {todo}"


def _unreachable(exc: BaseException | None) -> bool:
    """A connection that failed somewhere under this error (litellm wraps httpx's and openai's)."""
    import httpx
    import openai

    while exc is not None:
        if isinstance(exc, (OSError, httpx.TransportError, openai.APIConnectionError)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


async def ruler_score_group(
    group: Any,
    judge_model: Any = "openai/o3",
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str = DEFAULT_RUBRIC,
    *,
    swallow_exceptions: bool = False,
    debug: bool = False,
) -> Any:
    """A copy of the group (art-sky's or ART's) whose rewards are the judge's scores, each trajectory's own reward
    kept in metrics["independent_reward"] and the score in metrics["ruler_score"]; None on a failure with
    `swallow_exceptions`. The group passed in is never changed."""
    trajectories = list(group.trajectories)
    if any(t.additional_histories for t in trajectories):
        raise ConfigError("RULER scores trajectories without additional_histories (as ART's)")
    copies = [
        t.model_copy(
            update={
                "messages_and_choices": list(t.messages_and_choices),
                "metrics": dict(t.metrics) | {"independent_reward": t.reward},
                "logs": list(t.logs),
                "metadata": copy.copy(t.metadata),
            }
        )
        for t in trajectories
    ]
    try:
        scores = await ruler(
            [t.messages() for t in copies],
            judge_model,
            extra_litellm_params,
            rubric,
            copies[0].tools if copies else None,
            debug=debug,
        )
    except JudgeError as exc:
        if swallow_exceptions:
            log.warning("RULER: %s", exc)
            return None
        raise
    for trajectory, score in zip(copies, scores, strict=False):
        trajectory.metrics["ruler_score"] = score.score
        trajectory.reward = score.score
        trajectory.log(f"RULER explanation: {score.explanation}")
    return type(group)(copies)
