"""Reasoning apart from content, as vLLM's `--reasoning-parser` splits it (issue 39 item 6): the parsers' semantics
are vLLM 0.32's (the cases below are what its own qwen3 and deepseek_r1 parsers return); a model asks for one by
art-sky's ModelConfig or ART's `_internal_config.engine_args`; the portable engine answers the OpenAI SDK with
`reasoning_content` in responses and stream deltas; the sampled token ids train token-exact, reasoning in place;
history with reasoning_content renders as the template does. The models answer a fixed reply (tests/chat_templates.py
`forced_model`), so every split is known."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
from chat_templates import forced_model
from pydantic import ValidationError
from transformers import AutoTokenizer

import art_sky as art
from art_sky.art_compat.models import model_config
from art_sky.cluster.chat_template import prompt_ids
from art_sky.cluster.inference.reasoning_parsers import PARSERS
from art_sky.cluster.inference.vllm_engine import VllmEngine, reasoning_event, vllm_command
from art_sky.cluster.node.placement import Placement
from art_sky.errors import ConfigError, ConflictError
from art_sky.settings import Settings
from art_sky.wire import ModelConfig, RegisterRequest

REPLY = "R</think>C"  # what both forced models answer: reasoning "R", content "C"
HI = [{"role": "user", "content": "hi"}]

# vLLM 0.32's extract_reasoning on these replies (its parsers run on a tokenizer with <think> and </think> added)
VLLM_CASES = [
    ("qwen3", {}, "<think>abc</think>hello", ("abc", "hello")),
    ("qwen3", {}, "abc</think>hello", ("abc", "hello")),
    ("qwen3", {}, "hello", ("hello", None)),
    ("qwen3", {}, "<think>abc", ("abc", None)),
    ("qwen3", {}, "pre<think>abc</think>hi", ("preabc", "hi")),
    ("qwen3", {}, "<think></think>hello", (None, "hello")),
    ("qwen3", {}, "<think>\nabc\n</think>\n\nhello", ("\nabc\n", "\n\nhello")),
    ("qwen3", {}, "abc</think>hello</think>x", ("abc", "hellox")),
    ("qwen3", {}, "<think>a<tool_call>{}</tool_call>", ("a", "<tool_call>{}</tool_call>")),
    ("qwen3", {}, "a</think>b<think>c</think>d", ("a", "b<think>cd")),
    ("qwen3", {}, "", (None, None)),
    ("qwen3", {"enable_thinking": False}, "<think>abc</think>hello", (None, "<think>abc</think>hello")),
    ("deepseek_r1", {}, "<think>abc</think>hello", ("abc", "hello")),
    ("deepseek_r1", {}, "abc</think>hello", ("abc", "hello")),
    ("deepseek_r1", {}, "hello", ("hello", None)),
    ("deepseek_r1", {}, "<think>abc", ("abc", None)),
    ("deepseek_r1", {}, "pre<think>abc</think>hi", ("abc", "hi")),
    ("deepseek_r1", {}, "<think></think>hello", ("", "hello")),
    ("deepseek_r1", {}, "abc</think>hello</think>x", ("abc", "hello</think>x")),
    ("deepseek_r1", {}, "<think>a<tool_call>{}</tool_call>", ("a<tool_call>{}</tool_call>", None)),
    ("deepseek_r1", {"enable_thinking": False}, "abc</think>hello", ("abc", "hello")),
]


@pytest.mark.parametrize("name, kwargs, text, split", VLLM_CASES)
def test_the_split_is_vllms(name, kwargs, text, split):
    assert PARSERS[name].split(text, kwargs) == split


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_a_stream_holds_back_a_marker_until_it_is_whole(name):
    parser, seen = PARSERS[name], []
    for end in range(1, len("abc</think>hello") + 1):
        seen.append(parser.partial("abc</think>hello"[:end], {}))
    assert ("abc", "") in seen and ("abc</", "") not in seen  # "</" may begin </think>: held, never sent
    for (reasoning, content), (later_reasoning, later_content) in zip(seen, seen[1:], strict=False):
        assert later_reasoning.startswith(reasoning) and later_content.startswith(content)
    assert seen[-1] == ("abc", "hello")


def test_a_model_asks_for_a_parser_by_art_skys_config_or_arts_engine_args(caplog):
    assert ModelConfig(reasoning_parser="qwen3").reasoning_parser == "qwen3"
    art_model = types.SimpleNamespace(
        _internal_config={"engine_args": {"reasoning_parser": "deepseek_r1", "gpu_memory_utilization": 0.5}}
    )
    assert model_config(art_model).reasoning_parser == "deepseek_r1"
    assert "engine_args.gpu_memory_utilization" in caplog.text  # the rest of ART's engine tuning: ignored, named


def test_an_unknown_parser_is_refused_naming_the_known_ones():
    with pytest.raises(ValidationError, match="'qwen2'.*deepseek_r1, qwen3"):
        ModelConfig(reasoning_parser="qwen2")
    art_model = types.SimpleNamespace(_internal_config={"engine_args": {"reasoning_parser": "qwen2"}})
    with pytest.raises(ConfigError, match="reasoning_parser.*'qwen2'.*deepseek_r1, qwen3"):
        model_config(art_model)


def test_vllms_reasoning_reaches_clients_as_reasoning_content_too():
    """vLLM 0.32 names a delta's parsed reasoning `reasoning`; the proxy adds `reasoning_content`, which LangChain,
    litellm and the OpenAI SDK's users read. Other lines pass as they came."""
    line = b'data: {"choices": [{"index": 0, "delta": {"reasoning": "R"}}]}'
    assert json.loads(reasoning_event(line)[6:])["choices"][0]["delta"] == {"reasoning": "R", "reasoning_content": "R"}
    for other in (b"data: [DONE]", b"", b": ping", b'data: {"choices": [{"delta": {"content": "C"}}]}'):
        assert reasoning_event(other) == other


def test_vllm_gets_the_parser_and_one_child_takes_one():
    request = RegisterRequest(
        name="m", project="p", base_model="/models/q", config=ModelConfig(reasoning_parser="deepseek_r1")
    )
    args, _ = vllm_command(Settings(), Placement("cpu"), "/models/q", request, 8001, 8, False, False, "key")
    assert args[args.index("--reasoning-parser") + 1] == "deepseek_r1"
    plain = request.model_copy(update={"config": ModelConfig()})
    assert (
        "--reasoning-parser" not in vllm_command(Settings(), Placement("cpu"), "/q", plain, 1, 8, False, False, "k")[0]
    )
    engine = VllmEngine(Settings(), Path("/nonexistent"), "key", Placement("cpu"))
    engine._process, engine.base_model, engine.max_lora_rank, engine.reasoning_parser = (
        object(),
        "/models/q",
        8,
        "qwen3",
    )
    with pytest.raises(ConflictError, match="reasoning parser 'deepseek_r1'.*started with 'qwen3'"):
        engine.check(request)
    engine.check(request.model_copy(update={"config": ModelConfig(reasoning_parser="qwen3")}))


# -- the portable engine behind a real server, the OpenAI SDK as the client ----------------------------------------
@pytest.fixture(scope="module")
async def backend(tmp_path_factory):
    backend = art.LocalBackend(path=tmp_path_factory.mktemp("art"))
    yield backend
    await backend.close()


async def _register(backend, root, parser: str, art_style: bool, name: str) -> tuple[art.TrainableModel, AutoTokenizer]:
    path = forced_model(root, parser, REPLY)
    if art_style:  # as ART users set vLLM's parser
        model = art.TrainableModel(
            name=name,
            project="reasoning",
            base_model=str(path),
            _internal_config={"engine_args": {"reasoning_parser": parser}, "init_args": {"max_seq_length": 512}},
        )
    else:
        model = art.TrainableModel(
            name=name,
            project="reasoning",
            base_model=str(path),
            config=art.ModelConfig(max_seq_length=512, reasoning_parser=parser),
        )
    await model.register(backend)
    return model, AutoTokenizer.from_pretrained(path)


@pytest.mark.slow
@pytest.mark.parametrize("parser, art_style", [("qwen3", False), ("deepseek_r1", True)])
async def test_reasoning_comes_apart_and_trains_token_exact(backend, tmp_path, parser, art_style):
    model, tokenizer = await _register(backend, tmp_path, parser, art_style, f"r-{parser.replace('_', '-')}")
    client = model.openai_client()
    completion = await client.chat.completions.create(model=model.name, messages=HI, max_tokens=16)
    choice = completion.choices[0]
    assert (choice.message.reasoning_content, choice.message.content) == ("R", "C")
    assert choice.message.model_extra["reasoning"] == "R"  # vLLM 0.32's name too
    assert tokenizer.decode(choice.token_ids) == REPLY + "<|im_end|>"  # the sampled ids, reasoning in place

    stream = await client.chat.completions.create(model=model.name, messages=HI, max_tokens=16, stream=True)
    reasoning, content, ids = "", "", []
    async for chunk in stream:
        for streamed in chunk.choices:
            extra = streamed.delta.model_extra or {}
            reasoning += extra.get("reasoning_content") or ""
            content += streamed.delta.content or ""
            ids += (streamed.model_extra or {}).get("token_ids") or []
    assert (reasoning, content) == ("R", "C")
    assert ids == choice.token_ids

    # the next turn's history carries the reasoning apart: the engine renders it as the template does
    history = [*HI, {"role": "assistant", "content": "C", "reasoning_content": "R"}, {"role": "user", "content": "go"}]
    second = (await client.chat.completions.create(model=model.name, messages=history, max_tokens=16)).choices[0]
    assert second.prompt_token_ids == prompt_ids(tokenizer, history, None)

    groups = [
        art.TrajectoryGroup(
            [
                art.Trajectory(messages_and_choices=[*HI, choice], reward=1.0),
                art.Trajectory(messages_and_choices=[*history, second], reward=0.0),
            ]
        )
    ]
    metrics = await model.train(groups, config=art.TrainConfig(learning_rate=1e-4))
    assert metrics["trained_tokens"] == metrics["trained_tokens_exact"] == 2 * len(choice.token_ids)
    assert metrics["trained_tokens_rerendered"] == 0


@pytest.mark.slow
async def test_qwen3_without_thinking_is_all_content(backend, tmp_path):
    model, _ = await _register(backend, tmp_path, "qwen3", False, "r-no-thinking")
    completion = await model.openai_client().chat.completions.create(
        model=model.name, messages=HI, max_tokens=16, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    message = completion.choices[0].message
    assert (message.reasoning_content, message.content) == (None, REPLY)
