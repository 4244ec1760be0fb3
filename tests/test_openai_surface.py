"""The OpenAI surface users rely on, at the cluster server's /v1 on both engines, with real clients: the openai SDK
and litellm, streaming (locally and through the SSH tunnel), tool_choice, response_format, unsupported parameters
refused by name, `name@step`, /v1/models/{id}, and a client that goes away mid-stream.

One server per engine per module: the portable engine in this Python, vLLM's CPU build from .venv-vllm.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys

import httpx
import openai
import pytest
from sshd import art_sky_home, sshd  # noqa: F401 (fixtures)
from vllm_cpu import vllm_backend

import art_sky as art
from art_sky.remote.install import BootstrapOptions

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches a price list on import otherwise
import litellm

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Tell me about the sea."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "look a word up",
            "parameters": {
                "type": "object",
                "required": ["word"],
                "properties": {"word": {"type": "string", "enum": ["sea", "sky"]}},
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "today's weather",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]


async def start(backend: art.Backend, name: str) -> tuple[art.Backend, art.TrainableModel]:
    model = art.TrainableModel(
        name=name, project="surface", base_model="art-sky/tiny", config=art.ModelConfig(max_seq_length=2048)
    )
    await model.register(backend)
    return backend, model


@pytest.fixture(scope="module")
async def portable(tmp_path_factory):
    backend = art.LocalBackend(
        path=tmp_path_factory.mktemp("art"),
        python=sys.executable,
        env={"ART_SKY_ENGINE": "portable", "ART_SKY_MAX_NEW_TOKENS_LIMIT": "256"},
    )
    try:
        yield await start(backend, "surf")
    finally:
        await backend.close()


@pytest.fixture(scope="module")
async def vllm(tmp_path_factory):
    backend = vllm_backend(tmp_path_factory.mktemp("art"))
    try:
        yield await start(backend, "vsurf")
    finally:
        await backend.close()


def sdk(backend: art.Backend) -> openai.AsyncOpenAI:
    """A plain openai client at the server's /v1, as a user would make one."""
    return openai.AsyncOpenAI(base_url=f"{backend.base_url}/v1", api_key=backend.api_key, max_retries=0)


async def collect(stream) -> dict:
    """Accumulate a streamed completion: text, token ids, logprobs and finish per choice, prompt ids, usage."""
    out: dict = {"choices": {}, "prompt_token_ids": None, "usage": None, "chunks": 0}
    async for chunk in stream:
        out["chunks"] += 1
        extra = chunk.model_extra or {}
        if extra.get("prompt_token_ids") is not None:
            out["prompt_token_ids"] = extra["prompt_token_ids"]
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        for choice in chunk.choices:
            acc = out["choices"].setdefault(
                choice.index, {"text": "", "token_ids": [], "logprobs": [], "tools": [], "finish": None}
            )
            acc["text"] += choice.delta.content or ""
            acc["token_ids"] += (choice.model_extra or {}).get("token_ids") or []
            if choice.logprobs and choice.logprobs.content:
                acc["logprobs"] += [t.logprob for t in choice.logprobs.content]
            acc["tools"] += choice.delta.tool_calls or []
            acc["finish"] = choice.finish_reason or acc["finish"]
    return out


async def check_stream_matches(backend: art.Backend, model: art.TrainableModel, **params) -> None:
    """Streaming and non-streaming with one seed: the same text, token ids, logprobs, prompt ids and usage."""
    client = sdk(backend)
    kwargs = (
        dict(
            model=model.name,
            messages=PROMPT,
            seed=11,
            logprobs=True,
            top_logprobs=2,
            extra_body={"return_tokens_as_token_ids": True},
        )
        | params
    )
    whole = await client.chat.completions.create(**kwargs)
    streamed = await collect(
        await client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert streamed["chunks"] > 3, "tokens arrive one chunk at a time"
    assert streamed["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]
    assert streamed["usage"].completion_tokens == whole.usage.completion_tokens
    assert streamed["usage"].prompt_tokens == whole.usage.prompt_tokens == len(streamed["prompt_token_ids"])
    assert len(streamed["choices"]) == len(whole.choices)
    for choice in whole.choices:
        acc = streamed["choices"][choice.index]
        extra = choice.model_extra
        assert extra["prompt_token_ids"] == streamed["prompt_token_ids"], "each choice carries its prompt's ids"
        assert acc["token_ids"] == extra["token_ids"]
        assert [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content] == extra["token_ids"]
        assert acc["logprobs"] == pytest.approx([t.logprob for t in choice.logprobs.content], abs=1e-4)
        assert acc["text"] == (choice.message.content or "")
        assert acc["finish"] == choice.finish_reason


# -- the portable engine -------------------------------------------------------------------------------------------


async def test_portable_streams_what_it_would_return(portable):
    backend, model = portable
    await check_stream_matches(backend, model, n=2, max_tokens=12)
    await check_stream_matches(backend, model, n=1, max_tokens=24, temperature=0, stop=["e", "a"])


async def test_portable_streams_to_litellm(portable):
    backend, model = portable
    common = dict(
        model=f"openai/{model.name}",
        api_base=f"{backend.base_url}/v1",
        api_key=backend.api_key,
        messages=PROMPT,
        max_tokens=10,
        temperature=0,
    )
    whole = await litellm.acompletion(**common)
    text, chunks = "", 0
    async for chunk in await litellm.acompletion(**common, stream=True):
        chunks += 1
        text += chunk.choices[0].delta.content or ""
    assert chunks > 3
    assert text == whole.choices[0].message.content


def json_object(choice) -> None:
    """A json_object reply, as every sample is one: compact JSON from its first byte, whole unless max_tokens cut it
    (an object's keys and values are free, so a random model's may run on)."""
    assert choice.message.content.startswith("{")
    if choice.finish_reason != "length":
        assert isinstance(json.loads(choice.message.content), dict)


async def test_portable_tool_choice(portable):
    backend, model = portable
    client = sdk(backend)

    async def prompt_tokens(**params) -> int:
        completion = await client.chat.completions.create(model=model.name, messages=PROMPT, max_tokens=1, **params)
        return completion.usage.prompt_tokens

    plain, with_tools = await prompt_tokens(), await prompt_tokens(tools=TOOLS)
    assert with_tools > plain + 100
    assert await prompt_tokens(tools=TOOLS, tool_choice="auto") == with_tools
    assert await prompt_tokens(tools=TOOLS, tool_choice="none") == plain, "tool_choice none hides the tools"
    named = {"type": "function", "function": {"name": "weather"}}
    only_weather = await prompt_tokens(tools=TOOLS[1:])
    # The named tool is the only one the model is shown, and the reply is constrained to its arguments (llguidance):
    # even the untrained tiny model always calls it, with arguments its schema allows
    for seed in range(3):
        reply = await client.chat.completions.create(
            model=model.name, messages=PROMPT, max_tokens=200, tools=TOOLS, tool_choice=named, seed=seed, logprobs=True
        )
        (call,) = reply.choices[0].message.tool_calls
        assert call.function.name == "weather" and json.loads(call.function.arguments) == {}
        ids = reply.choices[0].model_extra["token_ids"]
        assert len(ids) == len(reply.choices[0].logprobs.content)  # the ids sampled, each with its own logprob
    required = await client.chat.completions.create(
        model=model.name,
        messages=PROMPT,
        max_tokens=200,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        seed=3,
    )
    (call,) = required.choices[0].message.tool_calls  # parallel_tool_calls=false: one call
    assert call.function.name in ("lookup", "weather") and required.choices[0].finish_reason == "tool_calls"
    if call.function.name == "lookup":
        assert json.loads(call.function.arguments)["word"] in ("sea", "sky")
    streamed = await collect(
        await client.chat.completions.create(
            model=model.name, messages=PROMPT, max_tokens=200, tools=TOOLS, tool_choice=named, seed=0, stream=True
        )
    )
    assert [t.function.name for t in streamed["choices"][0]["tools"]] == ["weather"]
    assert streamed["choices"][0]["text"] == "", "a forced call's JSON is its arguments, never content"
    async with httpx.AsyncClient(
        base_url=f"{backend.base_url}/v1", timeout=60, headers={"authorization": f"Bearer {backend.api_key}"}
    ) as http:
        response = await http.post(
            "/chat/completions",
            json={"model": model.name, "messages": PROMPT, "max_tokens": 1, "tools": TOOLS, "tool_choice": named},
        )
        assert response.status_code == 422 and response.json()["error"]["param"] == "max_tokens", (
            "a forced call cut short by max_tokens says so"
        )
        probe = await http.post(
            "/chat/completions", json={"model": model.name, "messages": PROMPT, "max_tokens": 1, "tools": TOOLS[1:]}
        )
        assert probe.json()["usage"]["prompt_tokens"] == only_weather
    with pytest.raises(openai.BadRequestError, match="not among the request's tools") as refused:
        await client.chat.completions.create(
            model=model.name,
            messages=PROMPT,
            max_tokens=1,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert refused.value.body["param"] == "tool_choice"
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}]
    with pytest.raises(openai.BadRequestError, match="cannot be compiled") as refused:
        await client.chat.completions.create(
            model=model.name, messages=PROMPT, max_tokens=1, tools=bad_tool, tool_choice="required"
        )
    assert refused.value.body["param"] == "tools"


async def test_portable_response_format(portable):
    backend, model = portable
    client = sdk(backend)
    for seed in (0, 2, 3):
        reply = await client.chat.completions.create(
            model=model.name, messages=PROMPT, max_tokens=200, seed=seed, response_format={"type": "json_object"}
        )
        json_object(reply.choices[0])
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "word": {"enum": ["sea", "sky"]}},
        "required": ["ok", "word"],
        "additionalProperties": False,
    }
    form = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    reply = await client.chat.completions.create(
        model=model.name, messages=PROMPT, max_tokens=200, seed=1, response_format=form, logprobs=True
    )
    assert set(json.loads(reply.choices[0].message.content)) == {"ok", "word"}
    # the mask picks which token is drawn, not how it is recorded: the logprob is the model's own (unmasked)
    free = await client.chat.completions.create(
        model=model.name, messages=PROMPT, max_tokens=1, logprobs=True, extra_body={"top_k": 1}
    )
    first = reply.choices[0].logprobs.content[0]
    assert first.token == "{" and first.logprob < free.choices[0].logprobs.content[0].logprob
    for bad, param in (
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}},
            "response_format.json_schema.schema",
        ),
        ({"type": "json_schema"}, "response_format"),
        ({"type": "yaml"}, "response_format"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model=model.name, messages=PROMPT, max_tokens=2, response_format=bad)
        assert refused.value.body["param"] == param


async def test_portable_refuses_what_it_cannot_honour(portable):
    backend, model = portable
    client = sdk(backend)
    base = dict(model=model.name, messages=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="'frequency_penalty', 'logit_bias' are not supported"):
        await client.chat.completions.create(**base, frequency_penalty=0.5, logit_bias={"5": 2.0})
    with pytest.raises(openai.BadRequestError, match="'guided_json' is not a chat completion parameter"):
        await client.chat.completions.create(**base, extra_body={"guided_json": {"type": "object"}})
    with pytest.raises(openai.BadRequestError, match="'min_p' is not a chat completion parameter"):
        await litellm.acompletion(
            model=f"openai/{model.name}",
            api_base=f"{backend.base_url}/v1",
            api_key=backend.api_key,
            messages=PROMPT,
            max_tokens=2,
            extra_body={"min_p": 0.1},
        )
    # Harmless ones pass: bookkeeping, explicit nulls, values that ask for nothing, and vLLM's top_k / ignore_eos.
    accepted = await client.chat.completions.create(
        **base,
        user="u1",
        metadata={"run": "a"},
        store=False,
        frequency_penalty=0,
        presence_penalty=0,
        logit_bias={},
        response_format={"type": "text"},
        parallel_tool_calls=True,
        extra_body={"top_k": 5, "ignore_eos": True, "verbosity": None},
    )
    assert accepted.usage.completion_tokens == 2


async def test_portable_serves_older_steps_by_name(portable):
    backend, model = portable
    client = sdk(backend)

    async def greedy(name: str) -> list[float]:
        completion = await client.chat.completions.create(
            model=name, messages=PROMPT, max_tokens=6, temperature=0, logprobs=True
        )
        assert completion.model == f"{model.name}@{await model.get_step()}" if name == model.name else name
        return [t.logprob for t in completion.choices[0].logprobs.content]

    step = await model.get_step()
    before = await greedy(model.name)
    groups = []
    for seed in (1, 2):
        completion = await model.openai_client().chat.completions.create(
            model=model.name, messages=PROMPT, n=4, max_tokens=8, seed=seed
        )
        groups.append(
            art.TrajectoryGroup(
                art.Trajectory(messages_and_choices=[*PROMPT, c], reward=float(i % 2))
                for i, c in enumerate(completion.choices)
            )
        )
    await model.train(groups, art.TrainConfig(learning_rate=5e-2))
    after = await greedy(model.name)
    assert max(abs(a - b) for a, b in zip(after, before, strict=False)) > 1e-3, "the newest step serves under the name"
    assert await greedy(f"{model.name}@{step}") == pytest.approx(before, abs=1e-4), "name@step serves that step"
    assert await greedy(f"{model.name}@{step + 1}") == pytest.approx(after, abs=1e-4)
    card = await client.models.retrieve(f"{model.name}@{step}")
    assert (card.id, card.model_extra["parent"], card.model_extra["step"]) == (f"{model.name}@{step}", model.name, step)
    assert (await client.models.retrieve(model.name)).model_extra["step"] == step + 1
    listed = [m.id async for m in client.models.list()]
    assert {model.name, f"{model.name}@{step}", f"{model.name}@{step + 1}"} <= set(listed)
    with pytest.raises(openai.NotFoundError, match="no step 99 of model 'surf'"):
        await client.models.retrieve(f"{model.name}@99")
    with pytest.raises(openai.NotFoundError, match="not registered"):
        await client.chat.completions.create(model="nobody", messages=PROMPT, max_tokens=1)


async def test_a_client_gone_mid_stream_leaves_the_server_serving(portable):
    backend, model = portable
    async with httpx.AsyncClient(
        base_url=f"{backend.base_url}/v1", timeout=60, headers={"authorization": f"Bearer {backend.api_key}"}
    ) as http:
        body = {
            "model": model.name,
            "messages": PROMPT,
            "max_tokens": 200,
            "stream": True,
            "extra_body": None,
            "ignore_eos": True,
        }
        for _ in range(3):
            async with http.stream("POST", "/chat/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                assert (await anext(lines)).startswith("data: ")
            # closed after the first event: the batch goes on without it, and nothing waits for it
    client = sdk(backend)
    replies = await asyncio.wait_for(
        asyncio.gather(
            *(client.chat.completions.create(model=model.name, messages=PROMPT, max_tokens=4) for _ in range(4))
        ),
        60,
    )
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in replies)
    completion = await model.openai_client().chat.completions.create(
        model=model.name, messages=PROMPT, n=2, max_tokens=4, seed=3
    )
    group = art.TrajectoryGroup(
        art.Trajectory(messages_and_choices=[*PROMPT, c], reward=float(i)) for i, c in enumerate(completion.choices)
    )
    await asyncio.wait_for(model.train([group]), 120)  # the device gate was released by every stream


async def test_streams_through_the_ssh_tunnel(sshd, tmp_path, art_sky_home):
    options = BootstrapOptions(
        remote_dir=str(tmp_path / "remote"), python=sys.executable, env={"ART_SKY_ENGINE": "portable"}
    )
    backend = art.SSHBackend(sshd.target(), options=options)
    try:
        backend, model = await start(backend, "tunnelled")
        assert backend.base_url == backend.tunnel.base_url
        await check_stream_matches(backend, model, n=2, max_tokens=10)
        text = ""
        async for chunk in await litellm.acompletion(
            model=f"openai/{model.name}",
            api_base=f"{backend.base_url}/v1",
            api_key=backend.api_key,
            messages=PROMPT,
            max_tokens=10,
            temperature=0,
            stream=True,
        ):
            text += chunk.choices[0].delta.content or ""
        whole = await sdk(backend).chat.completions.create(
            model=model.name, messages=PROMPT, max_tokens=10, temperature=0
        )
        assert text == whole.choices[0].message.content
    finally:
        await backend.close()


# -- vLLM (its CPU build) --------------------------------------------------------------------------------------------


async def test_vllm_streams_with_token_ids(vllm):
    backend, model = vllm
    client = sdk(backend)
    streamed = await collect(
        await client.chat.completions.create(
            model=model.name,
            messages=PROMPT,
            max_tokens=12,
            n=2,
            seed=5,
            logprobs=True,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert streamed["prompt_token_ids"] and streamed["usage"].completion_tokens == 24
    for acc in streamed["choices"].values():
        assert len(acc["token_ids"]) == len(acc["logprobs"]) == 12
    text = ""
    async for chunk in await litellm.acompletion(
        model=f"openai/{model.name}",
        api_base=f"{backend.base_url}/v1",
        api_key=backend.api_key,
        messages=PROMPT,
        max_tokens=8,
        stream=True,
        temperature=0,
    ):
        text += chunk.choices[0].delta.content or ""
    whole = await client.chat.completions.create(model=model.name, messages=PROMPT, max_tokens=8, temperature=0)
    assert text == whole.choices[0].message.content
    assert whole.model == f"{model.name}@0" and whole.choices[0].model_extra["art_sky_step"] == 0
    assert whole.choices[0].model_extra["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]
    assert whole.choices[0].model_extra["token_ids"]


async def test_vllm_tool_choice(vllm):
    """vLLM constrains a forced call through its structural tags: the reply always opens as a call to the tool (36
    tokens at most, with the special <tool_call>); a strict tool's arguments follow its schema (OpenAI's rule), others
    are free. Their JSON may carry any whitespace there (vLLM 0.32 passes no whitespace option to the tags), which
    the untrained model may pad past max_tokens: what holds for every sample is a parsed call, or one cut short."""
    backend, model = vllm
    client = sdk(backend)

    def called(choice, names: str) -> list:
        if choice.finish_reason == "length":
            assert re.match(rf'<tool_call>\n?\{{"name": "({names})", "arguments": ', choice.message.content), choice
            return []
        return choice.message.tool_calls

    strict = [{"type": "function", "function": TOOLS[0]["function"] | {"strict": True}}, TOOLS[1]]
    named = await client.chat.completions.create(
        model=model.name,
        messages=PROMPT,
        max_tokens=100,
        tools=strict,
        tool_choice={"type": "function", "function": {"name": "lookup"}},
    )
    for call in called(named.choices[0], "lookup"):
        assert call.function.name == "lookup" and json.loads(call.function.arguments)["word"] in ("sea", "sky")
    required = await client.chat.completions.create(
        model=model.name, messages=PROMPT, max_tokens=40, tools=TOOLS, tool_choice="required"
    )
    assert all(call.function.name in ("lookup", "weather") for call in called(required.choices[0], "lookup|weather"))
    none = await client.chat.completions.create(
        model=model.name, messages=PROMPT, max_tokens=16, tools=TOOLS, tool_choice="none"
    )
    assert not none.choices[0].message.tool_calls


async def test_vllm_response_format(vllm):
    backend, model = vllm
    client = sdk(backend)
    reply = await client.chat.completions.create(
        model=model.name, messages=PROMPT, max_tokens=64, seed=1, response_format={"type": "json_object"}
    )
    json_object(reply.choices[0])
    # bounded (at most `{"n":999}`): a whole object whatever the untrained model samples
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["n"],
        "additionalProperties": False,
    }
    reply = await client.chat.completions.create(
        model=model.name,
        messages=PROMPT,
        max_tokens=64,
        seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "count", "schema": schema}},
    )
    assert isinstance(json.loads(reply.choices[0].message.content)["n"], int)
    # RULER's schema (its scores enumerated, its explanation bounded) under vLLM's grammar backend: a whole reply
    scores = await art.rewards.ruler([[*PROMPT, {"role": "assistant", "content": "It is wide."}]], model)
    assert [s.trajectory_id for s in scores] == ["1"] and 0 <= scores[0].score <= 1


async def test_both_engines_read_content_parts_and_the_developer_role_alike(portable, vllm):
    """The tiny model's template loops over content parts and knows no developer role: the portable engine renders
    what vLLM renders (the prompt it samples from and trains on)."""
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": " more."}]},
    ]
    prompts = []
    for backend, model in (portable, vllm):
        reply = await sdk(backend).chat.completions.create(model=model.name, messages=messages, max_tokens=1)
        prompts.append(reply.model_extra["prompt_token_ids"])
    assert prompts[0] == prompts[1]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[0\] has type 'image_url'"):
        await sdk(portable[0]).chat.completions.create(
            model=portable[1].name, max_tokens=1, messages=[{"role": "user", "content": [image]}]
        )
    with pytest.raises(openai.BadRequestError, match="tool 0 is not"):
        await sdk(portable[0]).chat.completions.create(
            model=portable[1].name, max_tokens=1, messages=PROMPT, tools=[{"type": "function"}]
        )


# What ART 0.5.21+'s own `model.openai_client()` adds to every request (art/model.py's extra_body defaults).
ART_EXTRA_BODY = {
    "return_token_ids": True,
    "return_tokens_as_token_ids": True,
    "nvext": {"extra_fields": ["engine_data"]},
    "chat_template_kwargs": {"preserve_thinking": True},
}


async def test_both_engines_take_what_arts_own_client_sends(portable, vllm):
    """ART's extra_body is accepted on both engines; every completion says how many tokens each choice sampled
    (`usage.completion_tokens`, which ART's PipelineTrainer reads) and which step sampled them (ART's
    `policy_token_spans`, which its eval checks); sampling options hidden in a vendor extension are refused by
    name, never dropped."""
    for backend, model in (portable, vllm):
        client = sdk(backend)
        reply = await client.chat.completions.create(
            model=model.name, messages=PROMPT, max_tokens=3, n=2, logprobs=True, extra_body=ART_EXTRA_BODY
        )
        counts = [len(choice.model_extra["token_ids"]) for choice in reply.choices]
        assert reply.usage.completion_tokens == sum(counts), backend
        step = await model.get_step()  # the portable model trained in the tests above
        for choice, count in zip(reply.choices, counts, strict=False):
            assert all(t.token.startswith("token_id:") for t in choice.logprobs.content)
            spans = choice.model_extra["policy_token_spans"]
            assert [(span["start_token"], span["end_token"], span["policy_version"]) for span in spans] == [
                (0, count, step)
            ]
        with pytest.raises(openai.BadRequestError, match=r"'nvext\.top_k' is not supported"):
            await client.chat.completions.create(
                model=model.name, messages=PROMPT, max_tokens=1, extra_body={"nvext": {"top_k": 5, "extra_fields": []}}
            )
    with pytest.raises(openai.BadRequestError, match=r"chat_template_kwargs \['tokenize'\]"):
        await sdk(portable[0]).chat.completions.create(
            model=portable[1].name,
            messages=PROMPT,
            max_tokens=1,
            extra_body={"chat_template_kwargs": {"tokenize": True}},
        )


async def test_vllm_refuses_what_it_would_ignore(vllm):
    backend, model = vllm
    client = sdk(backend)
    base = dict(model=model.name, messages=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="'audio' is not supported by the vllm engine"):
        await client.chat.completions.create(**base, audio={"voice": "alloy", "format": "wav"})
    with pytest.raises(openai.BadRequestError, match="'guided_json' is not a chat completion parameter"):
        await client.chat.completions.create(**base, extra_body={"guided_json": {"type": "object"}})
    with pytest.raises(openai.BadRequestError, match="vLLM: "):  # vLLM's own validation comes through
        await client.chat.completions.create(**base, extra_body={"top_k": "many"})
    accepted = await client.chat.completions.create(
        **base, user="u", frequency_penalty=0.1, extra_body={"top_k": 5, "min_p": 0.05, "ignore_eos": True}
    )
    assert accepted.usage.completion_tokens == 2
