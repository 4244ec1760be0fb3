"""A step train() has returned is never lost: the server answers a step once its checkpoint (LoRA, AdamW state,
record) is on disk, so a server killed with -9 at any moment after the answer comes back at that step. Real server
processes, real kills, at 0, 0.05, 0.1 and 0.2 s after train() returned (the window in which the background write
used to lose the step): every returned step is there after the restart, trained once, and the weights equal an
uninterrupted run's."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion import Choice

from art_sky import LocalBackend, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup
from art_sky.checkpoints import CheckpointDir, verify

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


def checkpoint_state(art: Path, step: int) -> dict[str, tuple[dict, dict]]:
    """The step's adapter and optimizer state as written (what a resumed run trains on): each file's tensors and
    metadata."""
    from safetensors import safe_open

    directory = CheckpointDir(art, "durable", "agent").step_dir(step)
    state = {}
    for path in sorted(directory.rglob("*.safetensors")):
        with safe_open(path, "pt") as handle:
            tensors = {key: handle.get_tensor(key).tolist() for key in handle.keys()}
            state[path.relative_to(directory).as_posix()] = (tensors, handle.metadata())
    return state


@pytest.mark.slow
async def test_a_step_train_returned_survives_kill_9_right_after(tmp_path):
    art, clean = tmp_path / "killed", tmp_path / "clean"
    agent, backend = model(), LocalBackend(path=art)
    try:
        await agent.register(backend)
        for step, delay in enumerate(KILL_AFTER, start=1):
            assert await train(agent, step) == step
            if delay:
                await asyncio.sleep(delay)
            os.kill(backend.server.pid, signal.SIGKILL)
            await backend.close(force=True)
            backend = LocalBackend(path=art)
            await agent.register(backend)  # a new server on the same checkpoints
            assert await agent.get_step() == step, f"step {step} was lost by a kill -9 {delay} s after train()"
    finally:
        await backend.close(force=True)

    checkpoints = CheckpointDir(art, "durable", "agent")
    assert checkpoints.steps() == [0, 1, 2, 3, 4]
    for step in checkpoints.steps():
        verify(checkpoints.step_dir(step), checkpoints.manifest(step))
    assert [entry["step"] for entry in checkpoints.history()] == [1, 2, 3, 4]  # each step trained once
    request_ids = [checkpoints.record(step).request_id for step in (1, 2, 3, 4)]
    assert len(set(request_ids)) == 4 and None not in request_ids

    agent, backend = model(), LocalBackend(path=clean)  # the same steps, never killed
    try:
        await agent.register(backend)
        for step in range(1, len(KILL_AFTER) + 1):
            assert await train(agent, step) == step
    finally:
        await backend.close()
    for step in (1, 4):
        assert checkpoint_state(art, step) == checkpoint_state(clean, step)
