"""Turning trajectories into training sequences: exact sampled ids, template-rendered context, masking."""

import math

import pytest

from art_sky.cluster.sequences import tokenize_trajectory
from art_sky.cluster.tiny_model import tiny_model_path
from art_sky.errors import TokenizationError
from art_sky.settings import Settings
from art_sky.wire import WireChoice, WireMessage, WireTrajectory

CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path(Settings().cache_dir))


def enc(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_multi_turn_with_tool_message_trains_only_sampled_tokens(tokenizer):
    first = enc(tokenizer, CALL_TEXT + "<|im_end|>")  # the model called a tool and ended its turn
    second = enc(tokenizer, "sum is 2")  # cut by max_tokens: no end-of-turn token sampled
    trajectory = WireTrajectory(
        items=[WireMessage(role="system", content="S"), WireMessage(role="user", content="U"),
               WireChoice(content=None, tool_calls=[TOOL_CALL], token_ids=first, logprobs=[-0.5] * len(first)),
               WireMessage(role="tool", content="2", tool_call_id="c1"),
               WireChoice(content="sum is 2", token_ids=second, logprobs=[None] * len(second))],
        reward=1.0, tools=TOOLS)
    seq = tokenize_trajectory(tokenizer, trajectory, advantage=0.7, max_length=8192)

    system = tokenizer.apply_chat_template([{"role": "system", "content": "S"}], tools=TOOLS, tokenize=False)
    prompt1 = enc(tokenizer, system + "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")
    between = enc(tokenizer, "\n<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n"
                             "<|im_start|>assistant\n")
    closing = enc(tokenizer, "<|im_end|>\n")
    assert seq.token_ids == prompt1 + first + between + second + closing
    assert seq.trained == ([False] * len(prompt1) + [True] * len(first) + [False] * len(between)
                           + [True] * len(second) + [False] * len(closing))
    trained_old = [lp for lp, t in zip(seq.old_logprobs, seq.trained) if t]
    assert trained_old[: len(first)] == [-0.5] * len(first)
    assert all(math.isnan(lp) for lp in trained_old[len(first):])  # the engine reported none: detached later
    assert all(math.isnan(lp) for lp, t in zip(seq.old_logprobs, seq.trained) if not t)
    assert seq.advantage == 0.7


def test_sampled_ids_are_kept_even_when_retokenizing_would_differ(tokenizer):
    # ids that decode to "ab" but are not what the tokenizer produces for "ab": the sequence must keep them
    sampled = [tokenizer.convert_tokens_to_ids("a"), tokenizer.convert_tokens_to_ids("b")]
    odd = [sampled[1], sampled[0]]  # "ba" sampled while the content claims "ab"
    trajectory = WireTrajectory(items=[WireMessage(role="user", content="x"),
                                       WireChoice(content="ab", token_ids=odd)], reward=0.0)
    seq = tokenize_trajectory(tokenizer, trajectory, 1.0, 8192)
    assert [i for i, t in zip(seq.token_ids, seq.trained) if t] == odd


def test_tool_call_json_formatted_differently_still_closes_the_turn(tokenizer):
    sampled = enc(tokenizer, '<tool_call>{"name":"add","arguments":{"a":1}}</tool_call><|im_end|>')
    trajectory = WireTrajectory(items=[WireMessage(role="user", content="x"),
                                       WireChoice(tool_calls=[TOOL_CALL], token_ids=sampled),
                                       WireMessage(role="tool", content="2")], reward=0.0, tools=TOOLS)
    seq = tokenize_trajectory(tokenizer, trajectory, 1.0, 8192)
    trained_end = max(i for i, t in enumerate(seq.trained) if t)
    assert seq.token_ids[trained_end + 1:] == enc(tokenizer, "\n")  # only the newline after <|im_end|>


def test_choice_without_token_ids_is_refused_with_a_fix(tokenizer):
    trajectory = WireTrajectory(items=[WireMessage(role="user", content="x"), WireChoice(content="y")], reward=0)
    with pytest.raises(TokenizationError, match="logprobs=True"):
        tokenize_trajectory(tokenizer, trajectory, 1.0, 8192)


def test_trajectory_without_choices_is_refused(tokenizer):
    trajectory = WireTrajectory(items=[WireMessage(role="user", content="x")], reward=0)
    with pytest.raises(TokenizationError, match="no choice"):
        tokenize_trajectory(tokenizer, trajectory, 1.0, 8192)


def test_too_long_trajectory_is_refused(tokenizer):
    trajectory = WireTrajectory(items=[WireMessage(role="user", content="x" * 100),
                                       WireChoice(content="y", token_ids=[1])], reward=0)
    with pytest.raises(TokenizationError, match="max_seq_length 50"):
        tokenize_trajectory(tokenizer, trajectory, 1.0, 50)
