"""Trajectories to training sequences: each sampled turn in the exact context it was sampled from, merged with the
turns before it only where the prefix matches token for token; re-rendered where the client kept no ids."""

import math

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from openai.types.chat import ChatCompletionMessage

from art_sky.client.trajectories import wire_groups, wire_item, wire_trajectory
from art_sky.cluster.chat_template import prompt_ids
from art_sky.cluster.tiny_model import tiny_model_path
from art_sky.cluster.training.sequences import build_sequences
from art_sky.errors import ConfigError, TokenizationError
from art_sky.settings import Settings
from art_sky.wire import WireChoice, WireHistory, WireMessage, WireTrajectory

TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
USER = {"role": "user", "content": "U"}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path(Settings().cache_dir))


def enc(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def build(tokenizer, items, max_length=8192, **fields):
    trajectory = items if isinstance(items, WireTrajectory) else WireTrajectory(items=items, reward=0, **fields)
    return build_sequences(tokenizer, trajectory, max_length, len(tokenizer), {tokenizer.eos_token_id})


def spans(sequence):
    """(start, end) of each run of trained tokens."""
    runs, start = [], None
    for i, trained in enumerate([*sequence.trained, False]):
        if trained and start is None:
            start = i
        elif not trained and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_a_turn_trains_on_the_engines_ids_with_its_logprobs(tokenizer):
    prompt = enc(tokenizer, "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")
    sampled = enc(tokenizer, "hi<|im_end|>")
    logprobs = [-0.5, None, None][: len(sampled)]
    built = build(
        tokenizer,
        [WireMessage(**USER), WireChoice(content="hi", token_ids=sampled, logprobs=logprobs, prompt_token_ids=prompt)],
    )
    [seq] = built.sequences
    assert seq.token_ids == prompt + sampled and seq.trained == [False] * len(prompt) + [True] * len(sampled)
    assert seq.old_logprobs[len(prompt)] == -0.5
    assert all(math.isnan(lp) for lp in seq.old_logprobs[len(prompt) + 1 :])  # missing: on-policy
    assert all(math.isnan(lp) for lp in seq.old_logprobs[: len(prompt)])
    assert (built.exact_tokens, built.rerendered_tokens) == (len(sampled), 0)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, 0.5])
def test_a_logprob_that_no_engine_samples_is_refused_at_the_boundary(bad):
    with pytest.raises(ValueError, match="logprobs.1"):
        WireChoice(content="hi", token_ids=[1, 2], logprobs=[-0.5, bad])


def test_sampled_ids_are_kept_even_where_retokenizing_would_differ(tokenizer):
    odd = [tokenizer.convert_tokens_to_ids("b"), tokenizer.convert_tokens_to_ids("a")]  # "ba" sampled, "ab" claimed
    [seq] = build(tokenizer, [WireMessage(**USER), WireChoice(content="ab", token_ids=odd)]).sequences
    assert [i for i, t in zip(seq.token_ids, seq.trained, strict=False) if t] == odd
    assert seq.token_ids[:-2] == prompt_ids(tokenizer, [USER], None)  # no prompt ids: rendered as the engine does


def test_turns_share_a_sequence_where_the_next_prompt_extends_it(tokenizer):
    messages = [USER]
    first = enc(tokenizer, '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><|im_end|>')
    p1 = prompt_ids(tokenizer, messages, TOOLS)
    after_first = [
        *messages,
        {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "content": "2", "tool_call_id": "c1"},
    ]
    p2 = prompt_ids(tokenizer, after_first, TOOLS)
    assert p2[: len(p1) + len(first)] == p1 + first  # the template writes the call back as it was sampled
    second = enc(tokenizer, "sum is 2")  # cut by max_tokens
    built = build(
        tokenizer,
        [
            WireMessage(**USER),
            WireChoice(tool_calls=[TOOL_CALL], token_ids=first, prompt_token_ids=p1),
            WireMessage(role="tool", content="2", tool_call_id="c1"),
            WireChoice(content="sum is 2", token_ids=second, prompt_token_ids=p2),
        ],
        tools=TOOLS,
    )
    [seq] = built.sequences
    assert seq.token_ids == p2 + second
    assert spans(seq) == [(len(p1), len(p1) + len(first)), (len(p2), len(p2) + len(second))]


def test_a_turn_whose_prompt_differs_starts_its_own_sequence(tokenizer):
    p1 = enc(tokenizer, "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")
    first = enc(tokenizer, "a  b<|im_end|>")
    p2 = enc(
        tokenizer,
        "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\na b<|im_end|>\n"
        "<|im_start|>user\nV<|im_end|>\n<|im_start|>assistant\n",
    )  # history rewritten
    second = enc(tokenizer, "c<|im_end|>")
    built = build(
        tokenizer,
        [
            WireMessage(**USER),
            WireChoice(content="a  b", token_ids=first, prompt_token_ids=p1),
            WireMessage(role="user", content="V"),
            WireChoice(content="c", token_ids=second, prompt_token_ids=p2),
        ],
    )
    assert [s.token_ids for s in built.sequences] == [p1 + first, p2 + second]
    assert built.exact_tokens == len(first) + len(second)


def test_prompt_ids_go_on_the_wire_once_and_are_rebuilt_exactly(tokenizer):
    """The client sends each prompt after what it shares with the previous prompt and sampled ids."""
    p1, s1 = [1, 2, 3], [4, 5]
    p2, s2 = [1, 2, 3, 4, 5, 6, 7], [8]  # extends turn 1
    p3, s3 = [1, 2, 9], [10]  # rewrites history after its second id
    choices = [
        {"message": {"role": "assistant", "content": "x"}, "token_ids": s, "prompt_token_ids": p}
        for p, s in ((p1, s1), (p2, s2), (p3, s3))
    ]
    wire = wire_trajectory({"messages_and_choices": [USER, *choices], "reward": 1.0})
    assert [(c.prompt_shared, c.prompt_token_ids) for c in wire.items[1:]] == [(0, p1), (5, [6, 7]), (2, [9])]
    built = build(tokenizer, wire)
    assert [s.token_ids for s in built.sequences] == [p2 + s2, p3 + s3]
    bad = WireTrajectory(items=[WireChoice(token_ids=[1], prompt_token_ids=[2], prompt_shared=3)], reward=0)
    with pytest.raises(TokenizationError, match="prompt_shared is 3"):
        build(tokenizer, bad)


def test_a_choice_without_ids_is_rerendered_up_to_its_end_of_turn(tokenizer):
    built = build(
        tokenizer,
        [
            WireMessage(**USER),
            WireChoice(content="ok"),
            WireMessage(role="user", content="V"),
            WireChoice(tool_calls=[TOOL_CALL]),
        ],
        tools=TOOLS,
    )
    [seq] = built.sequences  # rendered from one template, so the turns extend each other
    trained = [[seq.token_ids[i] for i in range(a, b)] for a, b in spans(seq)]
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert trained == [enc(tokenizer, "ok<|im_end|>"), enc(tokenizer, call + "<|im_end|>")]
    assert (built.exact_tokens, built.rerendered_tokens) == (0, sum(map(len, trained)))
    assert all(math.isnan(lp) for lp in seq.old_logprobs)
    assert seq.token_ids[: spans(seq)[0][0]] == prompt_ids(tokenizer, [USER], TOOLS)


def test_additional_histories_train_as_their_own_sequences(tokenizer):
    other = WireHistory(items=[WireMessage(role="user", content="W"), WireChoice(content="z", token_ids=[7])])
    trajectory = WireTrajectory(
        items=[WireMessage(**USER), WireChoice(content="y", token_ids=[5])], reward=0, additional_histories=[other]
    )
    built = build(tokenizer, trajectory)
    assert [s.token_ids for s in built.sequences] == [
        prompt_ids(tokenizer, [USER], None) + [5],
        prompt_ids(tokenizer, [{"role": "user", "content": "W"}], None) + [7],
    ]


@pytest.mark.parametrize(
    ("items", "problem"),
    [
        ([WireMessage(**USER)], "no sampled turn"),
        ([WireMessage(**USER), WireMessage(role="assistant", content="a dict is context")], "no sampled turn"),
        ([], "no sampled turn"),
        ([WireMessage(**USER), WireChoice(token_ids=[10**6])], "outside the model's vocabulary"),
        ([WireMessage(**USER), WireChoice(token_ids=[1], prompt_token_ids=[10**6])], "outside the model's vocabulary"),
        ([WireMessage(role="user", content="x" * 100), WireChoice(content="y", token_ids=[1])], "max_seq_length 50"),
    ],
)
def test_trajectories_that_cannot_be_built_say_why(tokenizer, items, problem):
    with pytest.raises(TokenizationError, match=problem):
        build(tokenizer, items, max_length=50)


def test_a_template_that_cannot_render_is_reported(tokenizer):
    refusing = type(tokenizer).from_pretrained(tiny_model_path(Settings().cache_dir))
    refusing.chat_template = "{{ raise_exception('this template refuses') }}"
    trajectory = WireTrajectory(items=[WireMessage(**USER), WireChoice(content="y")], reward=0)
    with pytest.raises(TokenizationError, match=r"messages_and_choices\[1\]: the chat template cannot render.*refuses"):
        build_sequences(refusing, trajectory, 8192, len(refusing), set())


def test_any_clients_items_convert_and_bad_ones_are_named():
    call = {"name": "add", "args": {"a": 1}, "id": "c1", "type": "tool_call"}
    assert wire_item(AIMessage("", tool_calls=[call])).tool_calls[0]["function"] == {
        "name": "add",
        "arguments": '{"a": 1}',
    }
    assert isinstance(wire_item(AIMessageChunk("streamed")), WireChoice)  # a streamed reply is sampled too
    assert wire_item(HumanMessage("hi")) == WireMessage(role="user", content="hi")
    assert wire_item(ToolMessage("2", tool_call_id="c1")) == WireMessage(role="tool", content="2", tool_call_id="c1")
    assert isinstance(wire_item(ChatCompletionMessage(role="assistant", content="x")), WireChoice)
    assert isinstance(wire_item({"role": "assistant", "content": "x"}), WireMessage)  # a dict is context, as in ART
    reasoned = wire_item({"message": {"role": "assistant", "content": "4", "reasoning": "2+2"}, "token_ids": [1]})
    assert (reasoned.reasoning_content, reasoned.token_ids, reasoned.logprobs) == ("2+2", [1], None)
    with pytest.raises(ConfigError, match=r"group 0, trajectory 1, messages_and_choices\[1\]\): object is neither"):
        wire_groups(
            [
                {
                    "trajectories": [
                        {"messages_and_choices": [USER], "reward": 0},
                        {"messages_and_choices": [USER, object()], "reward": 0},
                    ]
                }
            ]
        )
    with pytest.raises(ConfigError, match="2 choices: put the one"):
        wire_item({"choices": [{"message": USER}, {"message": USER}]})
    with pytest.raises(ConfigError, match="group 0, trajectory 0: reward is nan, not a finite number"):
        wire_groups([{"trajectories": [{"messages_and_choices": [USER], "reward": math.nan}] * 2}])
