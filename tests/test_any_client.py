"""Any client's rollouts train: a plain openai SDK client, litellm and LangChain against art-sky's endpoint, through a
real LocalBackend. Choices that carry the engine's ids train exactly; the rest are re-rendered with the chat template
(old logprobs missing: the on-policy path); each step reports how many trained tokens came from which."""

from __future__ import annotations

import os

import pytest
from langchain_structured import check_structured_output
from openai import AsyncOpenAI

import art_sky as art

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm reads its price list from the web otherwise

pytestmark = pytest.mark.slow
QUESTION = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 2?"}]
REWARDS = (0.0, 1.0, 3.0)  # no trajectory of a group sits at the mean: every one trains


@pytest.fixture(scope="module")
async def model(tmp_path_factory):
    backend = art.LocalBackend(path=tmp_path_factory.mktemp("art"))
    model = art.TrainableModel(
        name="clients", project="any", base_model="art-sky/tiny", config=art.ModelConfig(max_seq_length=1024)
    )
    await model.register(backend)
    yield model
    await backend.close()


async def train(model, rollout) -> dict[str, float]:
    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(reward) for reward in REWARDS) for _ in range(2)), pbar_desc=None
    )
    metrics = await model.train(groups, config=art.TrainConfig(learning_rate=1e-3))
    assert metrics["num_trajectories_skipped"] == 0 and metrics["trained_tokens"] > 0
    assert metrics["trained_tokens"] == metrics["trained_tokens_exact"] + metrics["trained_tokens_rerendered"]
    return metrics


async def test_plain_openai_sdk(model):
    client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)

    async def rollout(reward: float, keep: str, **request) -> art.Trajectory:
        messages, items = list(QUESTION), list(QUESTION)
        for turn in range(2):
            completion = await client.chat.completions.create(
                model=model.name, messages=messages, max_tokens=4, **request
            )
            choice = completion.choices[0]
            messages += [choice.message, {"role": "user", "content": f"Sure ({turn})?"}]  # OpenAI's docs' pattern
            items += [choice if keep == "choice" else choice.message, messages[-1]]
        return art.Trajectory(messages_and_choices=items, reward=reward)

    # the choices carry the ids the engine sampled from and sampled: every token trains exactly, with the engine's
    # logprobs where the request asked for them and on-policy where not
    for request in ({"logprobs": True}, {}):
        exact = await train(model, lambda reward, request=request: rollout(reward, "choice", **request))
        assert exact["trained_tokens_rerendered"] == 0
    # the assistant message objects kept instead (they carry no ids), or ids refused: the chat template renders the
    # turns again (ART's fallback)
    for keep, request in (("message", {}), ("choice", {"extra_body": {"return_token_ids": False}})):
        rerendered = await train(model, lambda reward, keep=keep, request=request: rollout(reward, keep, **request))
        assert rerendered["trained_tokens_exact"] == 0

    # what the endpoint returns: vLLM's fields, the prompt on every choice too, token strings left as text
    completion = await client.chat.completions.create(
        model=model.name, messages=QUESTION, max_tokens=3, logprobs=True, n=2
    )
    assert all(c.token_ids and c.prompt_token_ids == completion.prompt_token_ids for c in completion.choices)
    assert not any(t.token.startswith("token_id:") for c in completion.choices for t in c.logprobs.content)
    refused = await client.chat.completions.create(
        model=model.name, messages=QUESTION, max_tokens=3, extra_body={"return_token_ids": False}
    )
    assert "token_ids" not in (refused.choices[0].model_extra or {}) and "prompt_token_ids" not in refused.model_extra


async def test_litellm(model):
    import litellm

    async def rollout(reward: float) -> art.Trajectory:
        messages, items = list(QUESTION), list(QUESTION)
        for turn in range(2):
            response = await litellm.acompletion(
                model=f"openai/{model.name}",
                api_base=model.inference_base_url,
                api_key=model.inference_api_key,
                messages=messages,
                max_tokens=4,
            )
            message = response.choices[0].message
            messages += [message, {"role": "user", "content": f"Sure ({turn})?"}]
            items += [response if turn else response.choices[0], messages[-1]]  # a ModelResponse or its Choices
        return art.Trajectory(messages_and_choices=items, reward=reward)

    metrics = await train(model, rollout)
    assert metrics["trained_tokens_rerendered"] == 0  # litellm keeps the ids in provider_specific_fields


async def test_langchain(model):
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    def chat(**options) -> ChatOpenAI:
        return ChatOpenAI(
            model=model.name,
            base_url=model.inference_base_url,
            api_key=model.inference_api_key,
            max_tokens=4,
            **options,
        )

    async def rollout(reward: float, llm: ChatOpenAI) -> art.Trajectory:
        messages = [SystemMessage("Answer briefly."), HumanMessage("What is 2 + 2?")]
        for turn in range(2):
            messages += [await llm.ainvoke(messages), HumanMessage(f"Sure ({turn})?")]
        return art.Trajectory(messages_and_choices=messages, reward=reward)

    # LangChain keeps no token ids: its AIMessages are re-rendered...
    rerendered = await train(model, lambda reward: rollout(reward, chat()))
    assert rerendered["trained_tokens_exact"] == 0
    # ...unless the logprobs it keeps name the sampled ones (vLLM's return_tokens_as_token_ids); its prompt is still
    # rendered again, so its turns count as re-rendered (exact needs the engine's prompt ids too)
    with_ids = chat(logprobs=True, extra_body={"return_tokens_as_token_ids": True})
    sampled = await train(model, lambda reward: rollout(reward, with_ids))
    assert sampled["trained_tokens_exact"] == 0 and sampled["trained_tokens_rerendered"] > 0


async def test_a_langchain_turn_sampled_with_tools_does_not_train_without_them(model, caplog):
    """An AIMessage with its sampled ids trains in a prompt rendered again from the messages: sampled with tools, a
    Trajectory without tools= would render another prompt. Its length differs from the one the engine reported, so
    the trajectory is skipped, named in a warning; with the tools given it trains."""
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "look a word up",
                "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
            },
        }
    ]
    llm = ChatOpenAI(
        model=model.name,
        base_url=model.inference_base_url,
        api_key=model.inference_api_key,
        max_tokens=4,
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True},
    ).bind_tools(tools)

    async def rollout(reward: float, with_tools: bool) -> art.Trajectory:
        messages = [HumanMessage("What is 2 + 2?")]
        messages.append(await llm.ainvoke(messages))
        return art.Trajectory(messages_and_choices=messages, reward=reward, tools=tools if with_tools else None)

    with caplog.at_level("WARNING"):
        without = await model.train(
            await art.gather_trajectory_groups(
                [art.TrajectoryGroup(rollout(reward, False) for reward in REWARDS)], pbar_desc=None
            ),
            config=art.TrainConfig(learning_rate=1e-3),
        )
    assert without["num_trajectories_skipped"] == len(REWARDS) and without["trained_tokens"] == 0
    assert (
        "group 0, trajectory 0" in caplog.text and "a request with tools whose Trajectory has no tools=" in caplog.text
    )
    given = await train(model, lambda reward: rollout(reward, True))
    assert given["num_trajectories_skipped"] == 0 and given["trained_tokens_rerendered"] > 0


async def test_dict_assistant_turns_train_when_allowed(model, caplog):
    """ART's allow_training_without_logprobs: assistant turns written as dicts train, rendered by the chat template;
    without it they are context and a trajectory with nothing else is skipped, saying why."""

    def groups() -> list[art.TrajectoryGroup]:
        return [
            art.TrajectoryGroup(
                art.Trajectory(
                    messages_and_choices=[
                        *QUESTION,
                        {"role": "assistant", "content": f"{reward:.0f}"},
                        {"role": "user", "content": "Sure?"},
                        {"role": "assistant", "content": "Yes."},
                    ],
                    reward=reward,
                )
                for reward in REWARDS
            )
        ]

    allowed = art.TrainConfig(learning_rate=1e-3, allow_training_without_logprobs=True)
    metrics = await model.train(groups(), config=allowed)
    assert metrics["num_trajectories_skipped"] == 0
    assert metrics["trained_tokens"] == metrics["trained_tokens_rerendered"] > 0
    with caplog.at_level("WARNING"):
        skipped = await model.train(
            groups() + [art.TrajectoryGroup(await train_group(model))], config=art.TrainConfig(learning_rate=1e-3)
        )
    assert skipped["num_trajectories_skipped"] == len(REWARDS)
    assert "allow_training_without_logprobs=True" in caplog.text


async def train_group(model) -> list[art.Trajectory]:
    client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)
    trajectories = []
    for reward in REWARDS:
        completion = await client.chat.completions.create(model=model.name, messages=QUESTION, max_tokens=4)
        trajectories.append(art.Trajectory(messages_and_choices=[*QUESTION, completion.choices[0]], reward=reward))
    return trajectories


async def test_langchain_structured_output_on_the_portable_engine(model):
    """LangChain's with_structured_output, both methods: the reply is constrained, so even the untrained tiny model
    returns a parsed object."""
    await check_structured_output(model)


async def test_ruler_with_the_clusters_own_endpoint_as_judge(model):
    """RULER (art.rewards.ruler_score_group, ART's signature) judged by a base model registered next to the trained
    one on the same server: its reply is constrained to the scores' schema (compact, every field bounded) and RULER
    asks for as many tokens as the longest such reply takes, so even the untrained tiny model returns a scored group
    whatever it samples, which trains. A reply cut by a smaller max_tokens says so; an unreachable judge is an error
    naming it and its URL; the rollouts are kept."""
    judge = art.TrainableModel(
        name="judge",
        project="any",
        base_model="art-sky/tiny",  # room for the longest reply
        config=art.ModelConfig(max_seq_length=1024 + art.rewards.reply_bound(2)),
    )
    await judge.register(model._backend)
    client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)

    async def rollout() -> art.Trajectory:
        completion = await client.chat.completions.create(model=model.name, messages=QUESTION, max_tokens=4)
        return art.Trajectory(messages_and_choices=[*QUESTION, completion.choices[0]], reward=0.0)

    group = art.TrajectoryGroup([await rollout(), await rollout()])
    scored = await art.rewards.ruler_score_group(group, judge, rubric="Score correct answers higher.")
    assert [t.metrics["independent_reward"] for t in scored.trajectories] == [0.0, 0.0]
    assert all(0 <= t.reward <= 1 and t.metrics["ruler_score"] == t.reward for t in scored.trajectories)
    assert all(t.reward == 0.0 for t in group.trajectories), "the group passed in is unchanged"
    metrics = await model.train([scored], config=art.TrainConfig(learning_rate=1e-3))
    assert metrics["num_trajectories_skipped"] == 0

    with pytest.raises(
        art.rewards.JudgeError,
        match=r"cut off before its scores' JSON ended: by max_tokens=8; a "
        rf"reply for 2 trajectories takes at most {art.rewards.reply_bound(2)} tokens",
    ):
        await art.rewards.ruler_score_group(group, judge, {"max_tokens": 8})

    params = {"api_base": "http://127.0.0.1:9/v1", "api_key": "none", "num_retries": 0}
    with pytest.raises(art.rewards.JudgeError, match=r"'openai/absent' at http://127.0.0.1:9/v1 cannot be reached"):
        await art.rewards.ruler_score_group(group, "openai/absent", params)
    assert await art.rewards.ruler_score_group(group, "openai/absent", params, swallow_exceptions=True) is None


def test_a_judge_reply_cut_where_max_tokens_was_given_as_none_says_so():
    """extra_litellm_params={"max_tokens": None} asks for no limit, so RULER adds none and the judge's own cuts the
    reply: a JudgeError naming that setting (once a TypeError comparing None with the bound)."""
    from types import SimpleNamespace

    message = art.rewards._cut("judge", "http://judge/v1", SimpleNamespace(usage=None), {"max_tokens": None}, 2)
    assert message.startswith("RULER's judge 'judge' at http://judge/v1 was cut off before its scores' JSON ended")
    assert "by the judge's own limit ({'max_tokens': None} in extra_litellm_params)" in message
    assert f"at most {art.rewards.reply_bound(2)} tokens: leave max_tokens out" in message
