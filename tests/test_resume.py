"""Resume on a new cluster: a LocalBackend mirrors its checkpoints to a real S3 server (SeaweedFS); a second one,
with nothing local, restores the newest step from it and trains on. Store failures are reported, not fatal,
unless in strict mode."""

from __future__ import annotations

import shutil

import pytest

from art_sky import LocalBackend, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup
from art_sky.errors import CheckpointStoreError, ServerError
from art_sky.store import CheckpointStore

pytest_plugins = ["fixtures_s3"]
pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Say something."}]


def new_model() -> TrainableModel:
    return TrainableModel(name="agent", project="resume", base_model="art-sky/tiny")


async def train_step(model: TrainableModel) -> dict[str, float]:
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=PROMPT, max_tokens=6, n=4, temperature=1.0
    )
    group = TrajectoryGroup(
        Trajectory(messages_and_choices=[*PROMPT, choice], reward=float(i))
        for i, choice in enumerate(completion.choices)
    )
    return await model.train([group], TrainConfig(learning_rate=1e-3))


async def greedy(model: TrainableModel) -> tuple[str, list[float]]:
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=PROMPT, max_tokens=6, temperature=0.0, logprobs=True
    )
    choice = completion.choices[0]
    return choice.message.content, [token.logprob for token in choice.logprobs.content]


def files_of(directory) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def step_dir(root, step: int):
    return root / "resume" / "models" / "agent" / "checkpoints" / f"{step:04d}"


async def test_a_new_backend_resumes_from_the_store(s3_server, tmp_path, monkeypatch):
    uri = f"s3://{s3_server.new_bucket()}/runs"
    first = LocalBackend(path=tmp_path / "a", env=s3_server.env(), checkpoint_uri=uri)
    model = new_model()
    await model.register(first)
    for _ in range(2):
        await train_step(model)
    assert await model.get_step() == 2
    await first.flush_checkpoints()  # written in the background: on disk (and in the store) now
    adapter = files_of(step_dir(tmp_path / "a", 2))
    served_text, served_logprobs = await greedy(model)
    await first.close()  # waits for the uploads
    shutil.rmtree(tmp_path / "a")

    second = LocalBackend(path=tmp_path / "b", env=s3_server.env(), checkpoint_uri=uri)
    try:
        model = new_model()
        await model.register(second)
        info = await second.model_info(model)
        assert info.step == 2
        assert info.restored_from == f"{uri}/resume/models/agent/checkpoints/0002"
        assert files_of(step_dir(tmp_path / "b", 2)) == adapter
        text, logprobs = await greedy(model)  # the same adapter serves the same tokens (a new process's float
        assert text == served_text and logprobs == pytest.approx(served_logprobs, abs=1e-3)  # math may differ)

        assert (await train_step(model))["step"] == 3
        status = await second.flush_checkpoints()
        assert status.synced["agent"] == 3 and status.errors == [] and status.pending == []
    finally:
        await second.close(force=True)
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    manifests = await CheckpointStore(uri).manifests("resume", "agent")
    assert [m.step for m in manifests] == [0, 1, 2, 3]


async def test_a_store_that_breaks_is_reported_and_training_goes_on(s3_server, tmp_path):
    """The bucket was there at `register` (which refuses a missing one) and is deleted while training goes on."""
    bucket = s3_server.new_bucket()
    uri = f"s3://{bucket}/runs"
    backend = LocalBackend(path=tmp_path / "a", env=s3_server.env(), checkpoint_uri=uri)
    try:
        model = new_model()
        await model.register(backend)
        await backend.flush_checkpoints()  # step 0 is in the store
        client = s3_server.client()
        for entry in client.list_objects_v2(Bucket=bucket).get("Contents", []):
            client.delete_object(Bucket=bucket, Key=entry["Key"])
        client.delete_bucket(Bucket=bucket)
        assert (await train_step(model))["step"] == 1
        with pytest.raises(CheckpointStoreError, match=f"{uri}.*bucket does not exist"):
            await backend.flush_checkpoints()
        with pytest.raises(CheckpointStoreError, match="close\\(force=True\\)"):
            await backend.close()  # refuses: step 1 is not in the store
        assert (await backend.health()).models == ["agent"]  # still running
    finally:
        await backend.close(force=True)
    assert (step_dir(tmp_path / "a", 1) / "manifest.json").exists()


async def test_strict_mode_stops_training_when_an_upload_fails(s3_server, tmp_path):
    uri = f"s3://{s3_server.new_bucket()}/runs"
    env = s3_server.env(read_only=True) | {"ART_SKY_CHECKPOINT_STRICT": "true"}
    backend = LocalBackend(path=tmp_path / "a", env=env, checkpoint_uri=uri)
    try:
        model = new_model()
        await model.register(backend)  # reading the store is allowed: nothing to restore
        with pytest.raises(CheckpointStoreError, match="access denied"):
            await backend.flush_checkpoints()
        with pytest.raises(ServerError, match=f"{uri}.*access denied.*strict mode"):
            await train_step(model)
    finally:
        await backend.close(force=True)


def test_a_malformed_uri_fails_before_any_server_starts(tmp_path):
    with pytest.raises(Exception, match="gcs://bucket/x.*unknown scheme"):
        LocalBackend(path=tmp_path, checkpoint_uri="gcs://bucket/x")


async def test_the_server_restores_from_the_store_on_its_own_event_loop(tmp_path, monkeypatch):
    """Registration downloads from the store asynchronously on the server's loop (not a second loop in a thread)."""
    import asyncio

    import httpx

    from art_sky.cluster.server import create_app
    from art_sky.settings import Settings

    settings = Settings(checkpoint_uri=f"file://{tmp_path / 'store'}")
    body = {"name": "agent", "project": "resume", "base_model": "art-sky/tiny"}

    async def register(art_path) -> dict:
        app = create_app(art_path, "key", settings)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://server",
            headers={"authorization": "Bearer key"},
            timeout=120,
        ) as client:
            response = await client.post("/art/models", json=body)
            assert response.status_code == 200, response.text
            assert (await client.post("/art/checkpoints/flush")).json()["errors"] == []
            return response.json()

    await register(tmp_path / "first")  # step 0, uploaded
    loops = []
    restore = CheckpointStore.restore

    async def recording(self, checkpoints):
        loops.append(asyncio.get_running_loop())
        return await restore(self, checkpoints)

    monkeypatch.setattr(CheckpointStore, "restore", recording)
    info = await register(tmp_path / "second")
    assert info["restored_from"] == f"{settings.checkpoint_uri}/resume/models/agent/checkpoints/0000"
    assert loops == [asyncio.get_running_loop()]


def fixed_group(step: int) -> TrajectoryGroup:
    """The same group for a step in every run: fixed answers (re-rendered, no sampling), rewards that differ."""
    from openai.types.chat import ChatCompletionMessage
    from openai.types.chat.chat_completion import Choice

    answers = [f"answer {step}-{i}" for i in range(4)]
    return TrajectoryGroup(
        Trajectory(
            messages_and_choices=[
                *PROMPT,
                Choice(index=0, finish_reason="stop", message=ChatCompletionMessage(role="assistant", content=text)),
            ],
            reward=float(i),
        )
        for i, text in enumerate(answers)
    )


async def train_fixed(model: TrainableModel, steps: range) -> None:
    for step in steps:
        result = await model.train([fixed_group(step)], TrainConfig(learning_rate=1e-2))
        assert result["step"] == step + 1


def adapter_weights(step_directory) -> dict:
    from safetensors.torch import load_file

    return load_file(step_directory / "adapter_model.safetensors")


@pytest.mark.parametrize("ranks", [1, 2], ids=["one process", "two sharded ranks"])
async def test_resume_is_exact(s3_server, tmp_path, ranks):
    """N steps straight, or k steps, the server killed (kill -9), and N - k more on a fresh server restored from the
    object store: the same weights. The checkpoint carries what the next step depends on (AdamW's moments, the
    step's seed), not only the LoRA. Sharded over two CPU ranks too: the ranks gather the same checkpoint and
    load it back into their shards."""
    import os
    import signal

    total, first = 4, 2
    sharded = {"ART_SKY_TRAINER_CPU_RANKS": str(ranks)}
    straight = LocalBackend(path=tmp_path / "straight", env=sharded)
    try:
        model = new_model()
        await model.register(straight)
        await train_fixed(model, range(total))
    finally:
        await straight.close(force=True)
    expected = adapter_weights(step_dir(tmp_path / "straight", total))

    uri = f"s3://{s3_server.new_bucket()}/runs"
    killed = LocalBackend(path=tmp_path / "killed", env=s3_server.env() | sharded, checkpoint_uri=uri)
    try:
        model = new_model()
        await model.register(killed)
        await train_fixed(model, range(first))
        assert (await killed.flush_checkpoints()).synced["agent"] == first
        os.kill(killed.server.pid, signal.SIGKILL)
    finally:
        await killed.close(force=True)
    shutil.rmtree(tmp_path / "killed")

    fresh = LocalBackend(path=tmp_path / "fresh", env=s3_server.env() | sharded, checkpoint_uri=uri)
    try:
        model = new_model()
        await model.register(fresh)
        assert await model.get_step() == first
        assert (step_dir(tmp_path / "fresh", first) / "training_state" / "optimizer.safetensors").is_file()
        await train_fixed(model, range(first, total))
    finally:
        await fresh.close(force=True)
    resumed = adapter_weights(step_dir(tmp_path / "fresh", total))
    assert resumed.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch_close(resumed[name], tensor), name
    at_restore = adapter_weights(step_dir(tmp_path / "fresh", first))
    assert not all(torch_close(at_restore[name], tensor) for name, tensor in expected.items())  # the steps did train


def torch_close(a, b) -> bool:
    import torch

    return torch.allclose(a, b, rtol=1e-4, atol=1e-6)
