"""Chats to token sequences: the prompt the engine samples from, and the training sequence of a trajectory.

Sampled assistant turns keep the exact token ids the engine produced (retokenizing sampled text drifts and
corrupts the PPO ratio); everything else is rendered with the model's chat template and masked out of the loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from art_sky.errors import TokenizationError
from art_sky.wire import WireChoice, WireHistory, WireMessage, WireTrajectory


@dataclass
class Sequence:
    token_ids: list[int]
    trained: list[bool]  # True where the model sampled the token
    old_logprobs: list[float]  # the engine's logprob of each sampled token; NaN where unknown
    advantage: float

    @property
    def trained_tokens(self) -> int:
        return sum(self.trained)


def render(tokenizer: Any, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
    )


def prompt_ids(tokenizer: Any, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The token ids an engine samples a reply to."""
    return _encode(tokenizer, render(tokenizer, messages, tools, generation_prompt=True))


def tokenize_trajectory(
    tokenizer: Any, trajectory: WireTrajectory | WireHistory, advantage: float, max_length: int
) -> Sequence:
    """One training sequence: template-rendered context (masked) around the choices' sampled ids (trained)."""
    messages: list[dict] = []
    ids: list[int] = []
    trained: list[bool] = []
    old: list[float] = []
    rendered_upto = ""  # text of the conversation already represented by `ids`
    for index, item in enumerate(trajectory.items):
        if isinstance(item, WireMessage):
            messages.append(item.model_dump(exclude_none=True))
            continue
        if not item.token_ids:
            raise TokenizationError(
                f"item {index} is a choice without sampled token ids: request completions with logprobs=True "
                "and return_tokens_as_token_ids=True (model.openai_client() does both by default)"
            )
        prompt = render(tokenizer, messages, trajectory.tools, generation_prompt=True)
        if not prompt.startswith(rendered_upto):
            raise TokenizationError(
                f"the chat template renders earlier turns differently once item {index} is added, so the "
                "sampled tokens cannot be placed exactly; use a model whose template keeps earlier turns unchanged"
            )
        context = _encode(tokenizer, prompt[len(rendered_upto):])
        ids += context
        trained += [False] * len(context)
        old += [math.nan] * len(context)
        ids += item.token_ids
        trained += [True] * len(item.token_ids)
        old += [math.nan if lp is None else lp for lp in (item.logprobs or [None] * len(item.token_ids))]
        messages.append(_as_message(item))
        after = render(tokenizer, messages, trajectory.tools, generation_prompt=False)
        tail = _turn_tail(tokenizer, after[len(prompt):], tokenizer.decode(item.token_ids, skip_special_tokens=False))
        tail_ids = _encode(tokenizer, tail)
        ids += tail_ids
        trained += [False] * len(tail_ids)
        old += [math.nan] * len(tail_ids)
        rendered_upto = after
    if not any(trained):
        raise TokenizationError("trajectory has no choice from the model to train on: add the Choice objects the "
                                "completions returned to messages_and_choices")
    if len(ids) > max_length:
        raise TokenizationError(
            f"trajectory is {len(ids)} tokens, longer than the model's max_seq_length {max_length}: shorten the "
            "rollout or register the model with a larger max_seq_length"
        )
    return Sequence(ids, trained, old, advantage)


def sft_sequence(tokenizer: Any, trajectory: WireTrajectory, max_length: int) -> Sequence:
    """ART's SFT sequence: the whole conversation rendered by the chat template; the tokens of every assistant
    turn (a choice or a written assistant message, with its end-of-turn marker) are trained, the rest masked."""
    messages = [_as_message(item) if isinstance(item, WireChoice) else item.model_dump(exclude_none=True)
                for item in trajectory.items]
    ids: list[int] = []
    trained: list[bool] = []
    rendered_upto = ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:index], trajectory.tools, generation_prompt=True)
        full = render(tokenizer, messages[: index + 1], trajectory.tools, generation_prompt=False)
        if not prompt.startswith(rendered_upto) or not full.startswith(prompt):
            raise TokenizationError(
                f"the chat template renders earlier turns differently once item {index} is added, so its assistant "
                "turn cannot be located; use a model whose template keeps earlier turns unchanged")
        context, turn = _encode(tokenizer, prompt[len(rendered_upto):]), _encode(tokenizer, full[len(prompt):])
        ids += context + turn
        trained += [False] * len(context) + [True] * len(turn)
        rendered_upto = full
    if not any(trained):
        raise TokenizationError("trajectory has no assistant turn to learn from: SFT trains on assistant messages")
    if len(ids) > max_length:
        raise TokenizationError(f"trajectory is {len(ids)} tokens, longer than the model's max_seq_length "
                                f"{max_length}: shorten it or register the model with a larger max_seq_length")
    return Sequence(ids, trained, [math.nan] * len(ids), 0.0)


def _as_message(choice: WireChoice) -> dict:
    message: dict = {"role": "assistant", "content": choice.content or ""}
    if choice.tool_calls:
        message["tool_calls"] = choice.tool_calls
    return message


def _turn_tail(tokenizer: Any, rendered_turn: str, sampled_text: str) -> str:
    """What the template adds after the sampled text to close the assistant turn (e.g. "<|im_end|>\\n")."""
    if rendered_turn.startswith(sampled_text):
        return rendered_turn[len(sampled_text):]
    # The template formats the turn differently from what was sampled (tool-call JSON, say): keep the sampled
    # tokens and take only the template's end-of-turn marker and what follows it.
    eos = tokenizer.eos_token or ""
    cut = rendered_turn.rfind(eos) if eos else -1
    if cut < 0:
        return ""
    return rendered_turn[cut + len(eos):] if sampled_text.endswith(eos) else rendered_turn[cut:]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
