"""A step train() has returned is never lost: the server answers a step once its checkpoint (LoRA, AdamW state,
record) is on disk, so a server killed with -9 at any moment after the answer comes back at that step. Real server
processes, real kills, at 0, 0.05, 0.1 and 0.2 s after train() returned (the window in which the background write
used to lose the step): every returned step is there after the restart, trained once, and the weights equal an
uninterrupted run's."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fixtures_s3 import s3_server  # noqa: F401 (fixture)
from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion import Choice
from sshd import art_sky_home, sshd  # noqa: F401 (fixtures)

from art_sky import LocalBackend, SSHBackend, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup
from art_sky.checkpoints import CheckpointDir, verify
from art_sky.remote.install import BootstrapOptions
from art_sky.store import CheckpointStore

PROMPT = [{"role": "user", "content": "hi"}]
KILL_AFTER = (0.0, 0.05, 0.1, 0.2)  # seconds between train() returning and kill -9


def groups(step: int) -> list[TrajectoryGroup]:
    """Step `step`'s groups: fixed answers (no sampling), so every run trains the same steps."""
    answers = [
        Choice(index=0, finish_reason="stop", message=ChatCompletionMessage(role="assistant", content=f"{step} {i}"))
        for i in range(4)
    ]
    return [
        TrajectoryGroup(Trajectory(messages_and_choices=[*PROMPT, a], reward=float(i)) for i, a in enumerate(answers))
    ]


def model() -> TrainableModel:
    return TrainableModel(name="agent", project="durable", base_model="art-sky/tiny")


async def train(agent: TrainableModel, step: int) -> int:
    await agent.train(groups(step), TrainConfig(learning_rate=1e-2))
    return await agent.get_step()


def checkpoint_state(checkpoints: CheckpointDir, step: int) -> dict[str, tuple[dict, dict]]:
    """The step's adapter and optimizer state as written (what a resumed run trains on): each file's tensors and
    metadata."""
    from safetensors import safe_open

    directory = checkpoints.step_dir(step)
    state = {}
    for path in sorted(directory.rglob("*.safetensors")):
        with safe_open(path, "pt") as handle:
            tensors = {key: handle.get_tensor(key).tolist() for key in handle.keys()}
            state[path.relative_to(directory).as_posix()] = (tensors, handle.metadata())
    return state


def checkpoints_under(root: Path) -> CheckpointDir:
    """The model's checkpoints wherever the server keeps its checkpoint root under `root`."""
    [found] = root.rglob("durable/models/agent/checkpoints")
    return CheckpointDir(found.parents[3], "durable", "agent")


@pytest.fixture(scope="module")
async def uninterrupted(tmp_path_factory) -> dict[int, dict]:
    """The checkpoints of the same steps on a server never killed."""
    clean = tmp_path_factory.mktemp("uninterrupted")
    agent, backend = model(), LocalBackend(path=clean)
    try:
        await agent.register(backend)
        for step in range(1, len(KILL_AFTER) + 1):
            assert await train(agent, step) == step
    finally:
        await backend.close()
    checkpoints = CheckpointDir(clean, "durable", "agent")
    return {step: checkpoint_state(checkpoints, step) for step in (1, len(KILL_AFTER))}


async def kill_after_each_step(make_backend: Callable[[], Any], root: Path, uninterrupted: dict[int, dict]) -> None:
    """Train the steps, kill -9 the server `KILL_AFTER[i]` s after each train() returned, start a new one (on the
    same machine and directory) after each kill: it is at the step train() returned; the run ends as one never
    killed."""
    agent, backend = model(), make_backend()
    try:
        await agent.register(backend)
        for step, delay in enumerate(KILL_AFTER, start=1):
            assert await train(agent, step) == step
            if delay:
                await asyncio.sleep(delay)
            os.kill(backend.server.pid, signal.SIGKILL)
            await backend.close(force=True)
            backend = make_backend()
            await agent.register(backend)  # a new server on the same checkpoints
            assert await agent.get_step() == step, f"step {step} was lost by a kill -9 {delay} s after train()"
    finally:
        await backend.close(force=True)

    checkpoints = checkpoints_under(root)
    assert checkpoints.steps() == [0, 1, 2, 3, 4]
    for step in checkpoints.steps():
        verify(checkpoints.step_dir(step), checkpoints.manifest(step))
    assert [entry["step"] for entry in checkpoints.history()] == [1, 2, 3, 4]  # each step trained once
    request_ids = [checkpoints.record(step).request_id for step in (1, 2, 3, 4)]
    assert len(set(request_ids)) == 4 and None not in request_ids
    for step, state in uninterrupted.items():
        assert checkpoint_state(checkpoints, step) == state


@pytest.mark.slow
async def test_a_step_train_returned_survives_kill_9_right_after(tmp_path, uninterrupted):
    await kill_after_each_step(lambda: LocalBackend(path=tmp_path), tmp_path, uninterrupted)


@pytest.mark.slow
async def test_over_ssh_a_step_train_returned_survives_kill_9_right_after(sshd, tmp_path, art_sky_home, uninterrupted):
    options = BootstrapOptions(remote_dir=str(tmp_path / "remote"), python=sys.executable)
    await kill_after_each_step(lambda: SSHBackend(sshd.target(), options=options), tmp_path, uninterrupted)


@pytest.mark.slow
async def test_with_an_s3_store_a_step_train_returned_survives_kill_9_right_after(s3_server, tmp_path, uninterrupted):
    """The store's upload follows the step; the answer does not wait for it, the local disk keeps the step. At the
    end the store holds every step too."""
    uri = f"s3://{s3_server.new_bucket()}/durable"
    env = s3_server.env()
    await kill_after_each_step(
        lambda: LocalBackend(path=tmp_path, checkpoint_uri=uri, env=env), tmp_path, uninterrupted
    )
    store = CheckpointStore(uri, credentials=env)
    assert [manifest.step for manifest in await store.manifests("durable", "agent")] == [0, 1, 2, 3, 4]
