"""ART's own rollout patterns run unchanged but for the import and the backend, against a real LocalBackend."""

import pytest

import art_sky as art
from art_sky.errors import AuthError, BackendUnavailableError, ConfigError, VersionMismatchError


@pytest.fixture(scope="module")
async def backend(tmp_path_factory):
    backend = art.LocalBackend(path=tmp_path_factory.mktemp("art"))
    yield backend
    await backend.close()


# -- pattern 1: the multiplication rollout, reward +1 / -1 -------------------------------------------------------
async def multiplication_rollout(model: art.Model, a: int, b: int) -> art.Trajectory:
    client = model.openai_client()
    messages = [{"role": "user", "content": f"What is {a} * {b}? Answer with just the number."}]
    chat_completion = await client.chat.completions.create(
        model=model.inference_model_name, messages=messages, max_tokens=4
    )
    choice = chat_completion.choices[0]
    trajectory = art.Trajectory(messages_and_choices=[*messages, choice], reward=0)
    trajectory.reward = 1 if (choice.message.content or "").strip() == str(a * b) else -1
    return trajectory


# -- pattern 2: OpenEnv's echo environment: system prompt, one completion, reward from the environment -----------
class EchoEnvironment:
    """OpenEnv's echo env in miniature: it echoes the message and rewards its length (0.1 per character)."""

    def reset(self) -> str:
        return "Say something and I will echo it."

    def step(self, message: str) -> float:
        return len(message) * 0.1


async def echo_rollout(model: art.Model, env: EchoEnvironment, seed: int) -> art.Trajectory:
    observation = env.reset()
    messages = [
        {"role": "system", "content": "You are an agent in an echo environment."},
        {"role": "user", "content": observation},
    ]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_completion_tokens=8, seed=seed
    )
    choice = completion.choices[0]
    reward = env.step(choice.message.content or "")
    return art.Trajectory(messages_and_choices=[*messages, choice], reward=reward).finish()


async def test_multiplication_pattern_trains_two_steps(backend):
    model = art.TrainableModel(name="multiply", project="patterns", base_model="art-sky/tiny")
    await model.register(backend)
    assert await model.get_step() == 0
    trained = []
    for expected in (1, 2):
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(multiplication_rollout(model, a, a + 1) for _ in range(4)) for a in range(3)),
            pbar_desc="gather",
        )
        metrics = await model.train(groups, config=art.TrainConfig(learning_rate=1e-5))
        assert metrics["step"] == expected and metrics["num_groups"] == 3
        trained.append(metrics["trained_tokens"] > 0)
    assert await model.get_step() == 2
    # a step that trained nothing (every group's rewards equal) takes over its predecessor's checkpoint, as ART's
    # layout has it; step 0 stays
    expected_steps = [0, 1, 2] if trained[1] else [0, 2]
    assert [c.step for c in await model.list_checkpoints()] == expected_steps, trained


async def test_echo_environment_pattern_trains_two_steps(backend):
    model = art.TrainableModel(name="echo", project="patterns", base_model="art-sky/tiny")
    await model.register(backend)
    env = EchoEnvironment()
    taught = []
    for step in range(2):  # each rollout its own seed: what the untrained model writes is the same every run
        groups = await art.gather_trajectory_groups(
            [
                art.TrajectoryGroup(echo_rollout(model, env, seed=8 * step + 4 * g + i) for i in range(4))
                for g in range(2)
            ]
        )
        metrics = await model.train(groups, config=art.TrainConfig(learning_rate=1e-4, beta=0.1))
        # a group whose replies are all as long has no advantage to teach (GRPO skips it, as ART does)
        varied = any(len({t.reward for t in group.trajectories}) > 1 for group in groups)
        assert (metrics["trained_tokens"] > 0) == varied, (metrics, [[t.reward for t in g] for g in groups])
        assert metrics["kl"] >= 0.0
        taught.append(varied)
        await model.log(groups, split="train")
    assert await model.get_step() == 2
    assert taught[0], "the seeded replies of step 1 (the untrained model's) differ in length"


async def test_rollout_exceptions_within_budget_are_kept_apart(backend):
    model = art.TrainableModel(name="flaky", project="patterns", base_model="art-sky/tiny")
    await model.register(backend)

    async def flaky(i: int) -> art.Trajectory:
        if i == 0:
            raise RuntimeError("tool timed out")
        return await multiplication_rollout(model, 2, 3)

    groups = await art.gather_trajectory_groups([art.TrajectoryGroup(flaky(i) for i in range(3))], max_exceptions=1)
    assert len(groups[0].trajectories) == 2 and len(groups[0].exceptions) == 1
    with pytest.raises(art.client.TooManyRolloutErrors, match="tool timed out"):
        await art.gather_trajectory_groups([art.TrajectoryGroup(flaky(i) for i in range(3))])


async def test_malformed_trajectory_is_refused_before_sending(backend):
    model = art.TrainableModel(name="multiply", project="patterns", base_model="art-sky/tiny")
    await model.register(backend)
    bad = art.Trajectory(messages_and_choices=[{"role": "wizard", "content": "x"}], reward=1.0)
    with pytest.raises(ConfigError, match="malformed trajectory"):
        await model.train([art.TrajectoryGroup([bad, bad])])
    nan = art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], reward=float("nan"))
    with pytest.raises(ConfigError, match="finite"):
        await model.train([art.TrajectoryGroup([nan, nan])])
    with pytest.raises(ConfigError, match="no trajectory groups"):
        await model.train([])


async def test_wrong_api_key_version_mismatch_and_dead_server(backend, monkeypatch):
    await backend.health()
    intruder = art.Backend(base_url=backend.base_url, api_key="wrong")
    model = art.TrainableModel(name="multiply", project="patterns", base_model="art-sky/tiny")
    with pytest.raises(AuthError, match="API key"):
        await model.register(intruder)
    await intruder.close()

    monkeypatch.setattr(art, "__version__", "0.0.0-other")
    with pytest.raises(VersionMismatchError, match="0.0.0-other"):
        await backend.check_server()
    monkeypatch.undo()

    dead = art.Backend(base_url="http://127.0.0.1:9", api_key="k")
    dead._started = True  # skip the health check: talk to the dead port directly
    with pytest.raises(BackendUnavailableError, match="cannot reach"):
        await dead.log(model, "val", {"reward": 1.0})


async def test_server_that_cannot_start_reports_its_log(tmp_path):
    backend = art.LocalBackend(path=tmp_path, env={"ART_SKY_ENGINE": "bogus"})
    with pytest.raises(
        BackendUnavailableError,
        match=r"ART_SKY_ENGINE=bogus \(in the environment\) is not a valid setting: use one of auto, vllm, portable",
    ):
        await backend.health()
    await backend.close()
