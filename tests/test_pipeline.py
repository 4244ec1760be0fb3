"""Pipelined GRPO: completions name the step that sampled them, `train(wait=False)` steps train in turn, rollouts
more than `max_steps_off_policy` behind are dropped and counted, stale ones train against their own logprobs, and
the pipelined loop learns the demo task as the sequential one does."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from conftest import API_KEY, train_lines

import art_sky as art
from art_sky.checkpoints import CheckpointDir
from art_sky.client.pipeline import drop_stale, group_versions
from art_sky.client.trajectories import wire_groups, wire_item
from art_sky.demo import PROMPTS, digit_share
from art_sky.errors import ConfigError

PROMPT = [{"role": "user", "content": "say hi"}]


# -- every completion says which adapter step sampled it ---------------------------------------------------------


async def test_completions_carry_the_step_that_sampled_them(server):
    body = {"model": "tiny", "messages": PROMPT, "max_tokens": 4, "n": 2, "logprobs": True}
    first = (await server.post("/v1/chat/completions", json=body)).json()
    assert [c["art_sky_step"] for c in first["choices"]] == [0, 0]
    assert wire_item(first["choices"][0]).step == 0
    trajectories = [
        {"messages_and_choices": [*PROMPT, c], "reward": r} for c, r in zip(first["choices"], (0, 1), strict=False)
    ]
    group = wire_groups([{"trajectories": trajectories}])[0]
    assert [c.step for t in group.trajectories for c in t.items[1:]] == [0, 0]
    status, lines = await train_lines(server, "tiny", {"groups": [json.loads(group.model_dump_json())]})
    assert status == 200 and lines[-1]["step"] == 1, lines

    newest = (await server.post("/v1/chat/completions", json=body)).json()
    assert newest["model"] == "tiny@1" and {c["art_sky_step"] for c in newest["choices"]} == {1}
    older = (await server.post("/v1/chat/completions", json=body | {"model": "tiny@0"})).json()
    assert {c["art_sky_step"] for c in older["choices"]} == {0}

    stream = await server.post("/v1/chat/completions", json=body | {"stream": True})
    events = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    steps = {c["art_sky_step"] for e in events for c in e["choices"] if "token_ids" in c}
    assert steps == {1}


def test_the_step_travels_on_the_wire_from_any_client_type():
    choice = {
        "message": {"role": "assistant", "content": "x"},
        "token_ids": [5],
        "prompt_token_ids": [1, 2],
        "logprobs": {"content": [{"token": "x", "logprob": -0.5}]},
    }
    assert wire_item(choice | {"art_sky_step": 3}).step == 3
    assert wire_item(choice | {"provider_specific_fields": {"art_sky_step": 4}}).step == 4  # litellm keeps it here
    assert wire_item({"choices": [choice], "model": "agent@7"}).step == 7  # a completion: its model names the step
    assert wire_item({"choices": [choice], "model": "agent"}).step is None
    assert wire_item(choice).step is None


# -- inference goes on while a step trains -------------------------------------------------------------------------


async def _phase(server) -> str:
    return (await server.get("/art/models/tiny")).json()["activity"]["phase"]


@pytest.mark.slow
async def test_completions_go_on_while_a_step_trains_sampled_by_the_previous_step(server):
    """The portable engine samples from its own copy of the adapter: during a step, completions are served (not
    held) by the previous step, exactly as before the step began; the gate closes only for the swap, and the new
    step's weights are what the new step's checkpoint holds."""
    assert (await server.get("/health")).json()["serves_while_training"] is True
    probe = {"model": "tiny", "messages": PROMPT, "max_tokens": 6, "logprobs": True, "seed": 7}
    before = (await server.post("/v1/chat/completions", json=probe)).json()["choices"][0]
    previous = before["art_sky_step"]
    body = {"model": "tiny", "messages": PROMPT, "max_tokens": 32, "n": 8, "logprobs": True, "seed": 1}
    choices = (await server.post("/v1/chat/completions", json=body)).json()["choices"]
    trajectories = [{"messages_and_choices": [*PROMPT, c], "reward": i % 2} for i, c in enumerate(choices)]
    group = json.loads(wire_groups([{"trajectories": trajectories}])[0].model_dump_json())
    step = asyncio.create_task(
        train_lines(server, "tiny", {"groups": [group] * 16, "config": {"learning_rate": 5e-2}})
    )  # a few seconds of training on this machine
    while await _phase(server) != "training":
        assert not step.done(), step.result()
        await asyncio.sleep(0.02)
    during = []
    while not step.done() and len(during) < 5:
        choice = (await server.post("/v1/chat/completions", json=probe)).json()["choices"][0]
        during.append((choice, await _phase(server)))
    served_while_training = [choice for choice, phase in during if phase == "training"]
    assert served_while_training, f"no completion came back while the step trained: {during}"
    for choice in served_while_training:  # the previous step's weights, untouched by the training going on
        assert choice["art_sky_step"] == previous and choice["token_ids"] == before["token_ids"]
        assert _logprobs(choice) == _logprobs(before)

    status, lines = await step
    assert status == 200 and lines[-1]["step"] == previous + 1, lines
    metrics = lines[-1]["metrics"]
    assert metrics["time/step_inference_paused_s"] < metrics["time/step_trainer_s"] / 2, metrics  # the swap only
    after = (await server.post("/v1/chat/completions", json=probe)).json()
    assert after["model"] == f"tiny@{previous + 1}" and _logprobs(after["choices"][0]) != _logprobs(before)
    # what the engine serves as the new step is its checkpoint: once a step follows, it is loaded from disk
    status, lines = await train_lines(server, "tiny", {"groups": [group]})
    assert status == 200 and lines[-1]["step"] == previous + 2, lines
    from_disk = (await server.post("/v1/chat/completions", json=probe | {"model": after["model"]})).json()
    assert from_disk["choices"][0]["token_ids"] == after["choices"][0]["token_ids"]
    assert _logprobs(from_disk["choices"][0]) == pytest.approx(_logprobs(after["choices"][0]), abs=1e-4)


@pytest.mark.slow
async def test_an_engine_that_pauses_holds_completions_for_the_whole_step(tmp_path, monkeypatch):
    """Where the engine must give the trainer the device (vLLM asleep on a shared GPU; here the portable engine as
    when it cannot copy a model), ART's semantics: a completion sent during a step waits and is served by the new
    step, and the step's metrics say inference waited for all of it."""
    from art_sky.cluster.inference.portable_engine import PortableEngine
    from art_sky.cluster.server import create_app
    from art_sky.settings import Settings

    monkeypatch.setattr(PortableEngine, "serves_while_training", False)
    app = create_app(tmp_path, API_KEY, Settings(max_new_tokens_limit=64))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://server",
        timeout=120,
        headers={"authorization": f"Bearer {API_KEY}"},
    ) as server:
        response = await server.post("/art/models", json={"name": "tiny", "project": "t", "base_model": "art-sky/tiny"})
        assert response.status_code == 200, response.text
        assert (await server.get("/health")).json()["serves_while_training"] is False
        body = {"model": "tiny", "messages": PROMPT, "max_tokens": 32, "n": 8, "logprobs": True, "seed": 1}
        choices = (await server.post("/v1/chat/completions", json=body)).json()["choices"]
        trajectories = [{"messages_and_choices": [*PROMPT, c], "reward": i % 2} for i, c in enumerate(choices)]
        group = json.loads(wire_groups([{"trajectories": trajectories}])[0].model_dump_json())
        step = asyncio.create_task(train_lines(server, "tiny", {"groups": [group] * 8}))
        while await _phase(server) != "training":
            assert not step.done(), step.result()
            await asyncio.sleep(0.02)
        held = (await server.post("/v1/chat/completions", json=body | {"n": 1, "max_tokens": 4})).json()
        assert held["choices"][0]["art_sky_step"] == 1 and held["model"] == "tiny@1"
        status, lines = await step
        assert status == 200 and lines[-1]["step"] == 1, lines
        metrics = lines[-1]["metrics"]
        assert metrics["time/step_inference_paused_s"] >= metrics["time/step_trainer_s"], metrics


def _logprobs(choice: dict) -> list[float]:
    return [entry["logprob"] for entry in choice["logprobs"]["content"]]


# -- the staleness bound -------------------------------------------------------------------------------------------


def _group(step: int | None, logprobs: bool = True, reward_offset: float = 0.0) -> dict:
    choice = {"message": {"role": "assistant", "content": "7"}, "token_ids": [55], "prompt_token_ids": [1, 2]}
    if logprobs:
        choice["logprobs"] = {"content": [{"token": "7", "logprob": -1.0}]}
    if step is not None:
        choice["art_sky_step"] = step
    return {
        "trajectories": [{"messages_and_choices": [*PROMPT, choice], "reward": r + reward_offset} for r in (0.0, 1.0)]
    }


@pytest.mark.parametrize("bound", [0, 1, 2])
def test_groups_beyond_the_bound_are_dropped_and_counted(bound):
    groups = [_group(10), _group(9), _group(8), _group(7), _group(None)]
    wired = wire_groups(groups)
    versions = group_versions(groups, wired)
    assert versions == [10, 9, 8, 7, None]
    kept, metrics = drop_stale(wired, versions, 10, bound)
    # kept: every group at most `bound` steps behind step 10, and the one whose version is unknown
    assert len(kept) == bound + 2 and metrics["discarded_stale_groups"] == 3 - bound
    assert kept[: bound + 1] == wired[: bound + 1] and kept[-1] is wired[-1]
    assert metrics["steps_off_policy"] == pytest.approx(sum(range(bound + 1)) * 2 / ((bound + 2) * 2))


def test_a_group_is_as_old_as_its_oldest_turn_and_needs_logprobs_when_behind():
    mixed = _group(10)
    mixed["trajectories"][1]["messages_and_choices"].append(_group(8)["trajectories"][0]["messages_and_choices"][-1])
    art_versioned = {
        "trajectories": [
            art.Trajectory(
                messages_and_choices=[*PROMPT, {"role": "assistant", "content": "7"}],
                reward=r,
                initial_policy_version=6,
            )
            for r in (0.0, 1.0)
        ]
    }
    groups = [mixed, _group(9, logprobs=False), _group(10, logprobs=False), art_versioned]
    wired = wire_groups(groups)
    versions = group_versions(groups, wired)
    assert versions == [8, 9, 10, 6]
    kept, metrics = drop_stale(wired, versions, 10, 2)
    # behind without logprobs: its ratio could only be taken against the current policy, so it is dropped
    assert kept == [wired[0], wired[2]] and metrics["discarded_stale_groups"] == 2


def test_the_bound_must_be_a_whole_number():
    from art_sky.client.pipeline import check_bound

    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ConfigError, match="max_steps_off_policy"):
            check_bound(bad)


# -- through a server: train(wait=False), the bound, stale rollouts' own logprobs ---------------------------------


@pytest.fixture(scope="module")
async def backend(tmp_path_factory):
    backend = art.LocalBackend(path=tmp_path_factory.mktemp("art"))
    try:
        yield backend
    finally:
        await backend.close()


async def _rollouts(model: art.TrainableModel, groups: int = 2, size: int = 4, seed: int = 0) -> list:
    rng = random.Random(seed)

    async def one(prompt: str) -> art.Trajectory:
        messages = [{"role": "user", "content": prompt}]
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(),
            messages=messages,
            max_tokens=8,
            temperature=1.0,
            seed=rng.randrange(2**31),
        )
        choice = completion.choices[0]
        return art.Trajectory(messages_and_choices=[*messages, choice], reward=digit_share(choice.message.content))

    return [await art.TrajectoryGroup(one(p) for _ in range(size)) for p in rng.sample(PROMPTS, groups)]


@pytest.mark.slow
async def test_steps_train_in_turn_and_the_bound_holds(backend):
    model = art.TrainableModel(name="turns", project="pipe", base_model="art-sky/tiny")
    await model.register(backend)
    config = art.TrainConfig(learning_rate=1e-3)
    old = await _rollouts(model, seed=1)
    assert {c.art_sky_step for g in old for t in g for c in t.messages_and_choices[1:]} == {0}
    batches = [await _rollouts(model, seed=2), await _rollouts(model, seed=3)]  # both sampled at step 0
    first = await model.train(batches[0], config, wait=False)
    second = await model.train(batches[1], config, wait=False)
    assert isinstance(first, asyncio.Task) and isinstance(second, asyncio.Task)
    one, two = await first, await second
    assert (one["step"], two["step"]) == (1, 2)  # in the order asked for
    assert one["discarded_stale_groups"] == 0 and two["steps_off_policy"] == 1  # trained at step 1

    # the old rollouts (step 0) are 2 behind step 2: dropped under the default bound, the step does not run
    skipped = await model.train(old, config)
    assert skipped["discarded_stale_groups"] == len(old) and skipped["step"] == 2
    assert await model.get_step() == 2
    kept = await model.train(old, config, max_steps_off_policy=2)
    assert kept["discarded_stale_groups"] == 0 and kept["steps_off_policy"] == 2 and kept["step"] == 3
    # ART 0.5's form takes the same keywords and returns a TrainResult
    handle = await backend.train(model, await _rollouts(model, seed=4), learning_rate=1e-3, wait=False)
    assert (await handle).step == 4


@pytest.mark.slow
async def test_a_stale_rollout_trains_against_its_own_sampled_logprobs(backend):
    """On-policy, the first optimizer step's ratio is exactly 1 (nothing is clipped); rollouts sampled two steps
    back, after large updates, have ratios far from 1 against their own logprobs, so PPO clips some tokens. Were
    the old logprobs recomputed with the current policy, the ratio would be 1 again and nothing clipped."""
    model = art.TrainableModel(name="stale", project="pipe", base_model="art-sky/tiny")
    await model.register(backend)
    config = art.TrainConfig(learning_rate=2e-2, loss_fn="ppo", epsilon=0.05)
    stale = await _rollouts(model, groups=4, seed=5)
    fresh_metrics = []
    for seed in (6, 7):
        fresh_metrics.append(await model.train(await _rollouts(model, groups=4, seed=seed), config))
    assert all(m["clip_fraction"] == 0 for m in fresh_metrics), fresh_metrics
    metrics = await model.train(stale, config, max_steps_off_policy=2)
    assert metrics["steps_off_policy"] == 2 and metrics["clip_fraction"] > 0, metrics


@pytest.mark.slow
async def test_close_trains_the_steps_asked_for_first(tmp_path):
    """A step asked for with wait=False holds the user's rollouts: closing the backend trains it before the server
    stops (close(force=True) would cancel it)."""
    backend = art.LocalBackend(path=tmp_path)
    model = art.TrainableModel(name="closing", project="pipe", base_model="art-sky/tiny")
    try:
        await model.register(backend)
        step = await model.train(await _rollouts(model), art.TrainConfig(learning_rate=1e-3), wait=False)
        assert not step.done()
    finally:
        await backend.close()
    assert step.done() and (await step)["step"] == 1
    assert CheckpointDir(tmp_path, "pipe", "closing").steps() == [0, 1]


# -- the pipelined loop learns as the sequential one does ---------------------------------------------------------


async def _demo_batch(model: art.TrainableModel, rng: random.Random) -> list:
    async def one(prompt: str, seed: int) -> art.Trajectory:
        messages = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": prompt}]
        completion = await model.openai_client().chat.completions.create(
            model=model.inference_model_name, messages=messages, max_tokens=8, temperature=1.0, seed=seed
        )
        choice = completion.choices[0]
        await asyncio.sleep(0.05)  # an environment's answer: lets the next batch overlap the step
        return art.Trajectory(messages_and_choices=[*messages, choice], reward=digit_share(choice.message.content))

    return await art.gather_trajectory_groups(
        (art.TrajectoryGroup(one(rng.choice(PROMPTS), rng.randrange(2**31)) for _ in range(8)) for _ in range(6)),
        pbar_desc=None,
    )


@pytest.mark.slow
async def test_the_pipelined_loop_learns_the_demo_task_as_the_sequential_one(backend):
    steps, config = 10, art.TrainConfig(learning_rate=5e-3, loss_fn="cispo")  # the pipeline's default loss
    sequential = art.TrainableModel(name="seq", project="pipe", base_model="art-sky/tiny")
    await sequential.register(backend)
    rng = random.Random(0)
    seq_rewards = []
    for _ in range(steps):
        batch = await _demo_batch(sequential, rng)
        seq_rewards.append(sum(t.reward for g in batch for t in g) / sum(len(g) for g in batch))
        await sequential.train(batch, config)

    pipelined = art.TrainableModel(name="pipe", project="pipe", base_model="art-sky/tiny")
    await pipelined.register(backend)
    rng = random.Random(0)
    results = await art.pipeline(pipelined, lambda i: _demo_batch(pipelined, rng), steps, config=config)
    pipe_rewards = [m["reward"] for m in results]
    assert [m["step"] for m in results] == list(range(1, steps + 1))
    assert all(m["discarded_stale_groups"] == 0 for m in results)  # one step ahead is within the default bound
    assert any(m["steps_off_policy"] > 0 for m in results)  # and the overlap really sampled from the older step

    # the policies after the same number of steps, on the same evaluation batch: a pipelined batch's own reward
    # lags (some of it was sampled by the step before), what it learned must not
    evaluated = []
    for model in (sequential, pipelined):
        batch = await _demo_batch(model, random.Random(99))
        evaluated.append(sum(t.reward for g in batch for t in g) / sum(len(g) for g in batch))
    seq_final, pipe_final = evaluated
    assert seq_final >= seq_rewards[0] + 0.4 and pipe_final >= pipe_rewards[0] + 0.4, (
        seq_rewards,
        pipe_rewards,
        evaluated,
    )
    assert pipe_final >= seq_final - 0.15, (seq_rewards, pipe_rewards, evaluated)
