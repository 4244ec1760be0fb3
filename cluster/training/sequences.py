"""Chats to token sequences: the prompt an engine samples from, and the training sequences of a trajectory.

A sampled turn trains in exactly the context the engine sampled it from: the prompt ids the engine reported for it,
or, for a choice that came without them, the prompt the chat template renders from the messages before it (what the
engine renders). Re-rendering a whole conversation instead drifts from what was sampled (templates strip reasoning
from earlier turns, re-serialise tool-call arguments, trim whitespace; tokenizers merge differently across a turn
boundary), and a context that differs corrupts the PPO ratio. Turns share one sequence only where the next prompt
starts with the sequence so far, token for token; otherwise the turn starts a sequence of its own.

Only sampled tokens are trained: the ids the engine sampled where the client kept them (old logprobs from the engine,
NaN where it reported none: the loss's on-policy path), else the template's rendering of the turn (ART's fallback)
with no old logprobs. A turn counts as exact only where both its prompt ids and its sampled ids are the engine's; a
turn whose prompt was rendered again counts as re-rendered, and is skipped where it provably is not the prompt the
engine sampled from (another length than the engine reported: a request made with tools, trained without them).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from art_sky.errors import TokenizationError
from art_sky.wire import WireChoice, WireHistory, WireMessage, WireTrajectory

from ..chat_template import encode, render


@dataclass
class Sequence:
    token_ids: list[int] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)  # True where the model sampled the token
    old_logprobs: list[float] = field(default_factory=list)  # the engine's logprob of each sampled token, or NaN
    advantage: float = 0.0

    @property
    def trained_tokens(self) -> int:
        return sum(self.trained)

    def extend(self, ids: list[int], trained: bool, logprobs: list[float] | None = None) -> None:
        self.token_ids += ids
        self.trained += [trained] * len(ids)
        self.old_logprobs += logprobs if logprobs is not None else [math.nan] * len(ids)


@dataclass
class Built:
    """What one trajectory becomes: its sequences, and where their trained tokens came from."""

    sequences: list[Sequence]
    exact_tokens: int  # trained tokens the engine sampled, in the prompt it sampled them from (both its ids)
    rerendered_tokens: int  # trained tokens whose turn or prompt the chat template rendered again


def build_sequences(
    tokenizer: Any,
    trajectory: WireTrajectory,
    max_length: int,
    vocab_size: int,
    eos_ids: set[int],
    dict_turns: bool = False,
) -> Built:
    """Every sampled turn of every history of the trajectory, in the context it was sampled from (advantage 0: the
    caller sets it once the group's trajectories are built). With `dict_turns` (ART's
    allow_training_without_logprobs), assistant turns written as dicts train too, rendered by the chat template.

    TokenizationError (the caller skips the trajectory and reports why) when a turn cannot be placed exactly, the
    trajectory has nothing to train, or a sequence is longer than `max_length`.
    """
    built = Built([], 0, 0)
    histories = trajectory.histories()
    for number, history in enumerate(histories):
        where = f"additional_histories[{number - 1}], " if number else ""
        _build_history(tokenizer, history, vocab_size, eos_ids, where, built, dict_turns)
    if not built.exact_tokens + built.rerendered_tokens:
        raise TokenizationError(
            "no sampled turn to train on: put the objects your completions returned in messages_and_choices (an "
            "openai Choice or ChatCompletion, a litellm ModelResponse, a LangChain AIMessage); assistant messages "
            "given as dicts are context, as in ART, unless TrainConfig(allow_training_without_logprobs=True)"
        )
    for sequence in built.sequences:
        if len(sequence.token_ids) > max_length:
            raise TokenizationError(
                f"a sequence is {len(sequence.token_ids)} tokens, longer than the model's max_seq_length "
                f"{max_length}: shorten the rollout or register the model with a larger max_seq_length"
            )
    return built


def _build_history(
    tokenizer: Any, history: WireHistory, vocab_size: int, eos_ids: set[int], where: str, built: Built, dict_turns: bool
) -> None:
    messages: list[dict] = []
    current: Sequence | None = None
    previous: list[int] = []  # the last choice's full prompt + sampled ids: what `prompt_shared` refers to
    for index, item in enumerate(history.items):
        if isinstance(item, WireMessage) and dict_turns and item.role == "assistant":
            item = WireChoice(
                content=item.content, tool_calls=item.tool_calls, reasoning_content=item.reasoning_content
            )  # trained as a choice without its ids
        if isinstance(item, WireMessage):
            messages.append(item.message())
            continue
        at = f"{where}messages_and_choices[{index}]"
        prompt_text = None
        if item.prompt_token_ids is None or item.token_ids is None:
            prompt_text = _render(tokenizer, messages, history, True, at)
        if item.prompt_token_ids is None:
            assert prompt_text is not None  # rendered above
            prompt = encode(tokenizer, prompt_text)
            if item.token_ids is not None and item.prompt_tokens not in (None, len(prompt)):
                raise TokenizationError(
                    f"{at}: the engine sampled this turn from a prompt of {item.prompt_tokens} tokens, but the "
                    f"messages before it render to {len(prompt)}: the trajectory is not what was sampled (a request "
                    "with tools whose Trajectory has no tools=?). Give the Trajectory what the request had, or keep "
                    "the openai Choice (its prompt ids come along)"
                )
        else:
            if item.prompt_shared > len(previous):
                raise TokenizationError(
                    f"{at}: prompt_shared is {item.prompt_shared} but the previous choice with prompt ids has "
                    f"{len(previous)} ids: send the full prompt_token_ids"
                )
            prompt = previous[: item.prompt_shared] + item.prompt_token_ids
        if item.token_ids is not None:
            sampled, logprobs = item.token_ids, _old_logprobs(item)
            if item.prompt_token_ids is not None:
                built.exact_tokens += len(sampled)
            else:
                built.rerendered_tokens += len(sampled)
        else:
            assert prompt_text is not None  # rendered above
            sampled = _rerendered(tokenizer, messages, item, history, prompt_text, eos_ids, at)
            logprobs = None
            built.rerendered_tokens += len(sampled)
        _check_vocabulary(prompt, vocab_size, at, "prompt")
        _check_vocabulary(sampled, vocab_size, at, "sampled")
        if item.prompt_token_ids is not None:
            previous = prompt + (item.token_ids or [])
        messages.append(item.message())
        if not sampled:
            continue
        shared = len(current.token_ids) if current is not None else 0
        if current is None or prompt[:shared] != current.token_ids:
            current, shared = Sequence(), 0
            built.sequences.append(current)
        current.extend(prompt[shared:], trained=False)
        current.extend(sampled, trained=True, logprobs=logprobs)


def sft_sequences(
    tokenizer: Any, trajectory: WireTrajectory, max_length: int, assistant_turns: str = "all"
) -> list[Sequence]:
    """ART's SFT: the conversation rendered by the chat template, the tokens of its assistant turns trained (a
    choice or a written assistant message, with its end-of-turn marker; `assistant_turns` "last": the final one
    only, the earlier ones context), the rest masked.

    Each trained turn is what the template writes for it after the context it renders before it (the conversation
    so far and as much of the generation prompt as the turn's own rendering keeps: a generation prompt that opens an
    empty think block, say, gives way to the turn's reasoning). Turns share a sequence while each context starts with
    the sequence so far, token for token; a template that rewrites earlier turns once a later one is added (one that
    drops past reasoning, moves the system message) starts a sequence for that turn."""
    history = trajectory.histories()[0]
    messages = [item.message() for item in trajectory.items]
    turns = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    if assistant_turns == "last":
        turns = turns[-1:]
    if not turns:
        raise TokenizationError("trajectory has no assistant turn to learn from: SFT trains on assistant messages")
    sequences: list[Sequence] = []
    current: Sequence | None = None
    for index in turns:
        at = f"messages_and_choices[{index}]"
        prompt = _render(tokenizer, messages[:index], history, True, at)
        full = _render(tokenizer, messages[: index + 1], history, False, at)
        start = len(os.path.commonprefix([prompt, full]))
        if start == len(full):
            raise TokenizationError(f"{at}: the chat template renders nothing for this assistant turn")
        context, turn = encode(tokenizer, full[:start]), encode(tokenizer, full[start:])
        shared = len(current.token_ids) if current is not None else 0
        if current is None or context[:shared] != current.token_ids:
            current, shared = Sequence(), 0
            sequences.append(current)
        current.extend(context[shared:], trained=False)
        current.extend(turn, trained=True)
    for sequence in sequences:
        if len(sequence.token_ids) > max_length:
            raise TokenizationError(
                f"a sequence is {len(sequence.token_ids)} tokens, longer than the model's "
                f"max_seq_length {max_length}: shorten it or register the model with a larger "
                "max_seq_length"
            )
    return sequences


def _old_logprobs(choice: WireChoice) -> list[float]:
    if choice.logprobs is None:
        return [math.nan] * len(choice.token_ids or [])
    return [lp if lp is not None and math.isfinite(lp) else math.nan for lp in choice.logprobs]


def _rerendered(
    tokenizer: Any,
    messages: list[dict],
    choice: WireChoice,
    history: WireHistory,
    prompt_text: str,
    eos_ids: set[int],
    at: str,
) -> list[int]:
    """A choice without sampled ids: the template's text for the turn, up to and including the end-of-turn token the
    model samples (what follows it, a newline say, is the template's)."""
    after = _render(tokenizer, [*messages, choice.message()], history, False, at)
    if not after.startswith(prompt_text):
        raise TokenizationError(
            f"{at}: this choice came without sampled token ids and the chat template renders its turn differently "
            "from the prompt it was sampled from, so it cannot be re-rendered: request logprobs (the server then "
            "returns the sampled ids) and keep the Choice objects"
        )
    ids = encode(tokenizer, after[len(prompt_text) :])
    end = next((i + 1 for i, token in enumerate(ids) if token in eos_ids), len(ids))
    return ids[:end]


def _render(tokenizer: Any, messages: list[dict], history: WireHistory, generation_prompt: bool, at: str) -> str:
    """The template's text, with the history's tools and chat template arguments (as its turns were sampled)."""
    try:
        return render(tokenizer, messages, history.tools, generation_prompt, history.chat_template_kwargs)
    except Exception as exc:  # the model's own template code: any error it raises means "cannot render this"
        raise TokenizationError(f"{at}: the chat template cannot render the messages before it: {exc}") from exc


def _check_vocabulary(ids: list[int], vocab_size: int, at: str, what: str) -> None:
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(i for i in ids if i < 0 or i >= vocab_size)
        raise TokenizationError(
            f"{at}: {what} token id {bad} is outside the model's vocabulary (0..{vocab_size - 1})"
            ": the ids must come from this model's engine"
        )
