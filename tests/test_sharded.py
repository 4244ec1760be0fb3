"""The sharded trainer on CPU ranks (FSDP2 over gloo, launched by torchrun): two ranks train as one process does,
and a rank killed mid-step rolls the step back on every rank while the next step trains."""

from __future__ import annotations

import asyncio
import random
import re
import signal

import psutil
import pytest
import torch
from safetensors.torch import load_file

from art_sky import LocalBackend, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup
from art_sky.cluster.model_state import create_model_state
from art_sky.cluster.training.peft_trainer import PeftTrainer
from art_sky.cluster.training.rank_group import RankGroup, ShardedTrainer
from art_sky.cluster.training.sequences import Sequence
from art_sky.cluster.training.weights import read_optimizer
from art_sky.settings import Settings
from art_sky.wire import RegisterRequest

pytestmark = pytest.mark.slow
PROMPT = [{"role": "user", "content": "Say something."}]


def batch(step: int) -> list[Sequence]:
    """A step's sequences: different lengths and prompts, some with old logprobs; five of them, so two ranks get
    unequal shares and different numbers of micro-batches."""
    rng = random.Random(step)
    sequences = []
    for _ in range(5):
        length = rng.randint(10, 48)
        prompt = rng.randint(2, length - 3)
        ids = [rng.randint(3, 250) for _ in range(length)]
        old = [float("nan")] * prompt + [rng.uniform(-6.0, -4.0) for _ in range(length - prompt)]
        sequences.append(
            Sequence(ids, [False] * prompt + [True] * (length - prompt), old, rng.choice([-1.0, -0.5, 0.5, 1.0]))
        )
    return sequences


def test_two_cpu_ranks_train_as_one_process(tmp_path):
    """Three steps of GRPO (micro-batched, clipped, AdamW) on two ranks leave the adapter one process leaves, within
    1e-4; the checkpoints the ranks write are PEFT adapters with name-keyed optimizer state."""
    settings = Settings(train_microbatch_tokens=64, cache_dir=tmp_path / "cache")
    request = RegisterRequest(name="m", project="p", base_model="art-sky/tiny")
    config = TrainConfig(learning_rate=1e-3)
    single = PeftTrainer(settings.train_microbatch_tokens)
    one = create_model_state(request, tmp_path / "one", settings, single.load_model, None, single.load_weights)
    sharded = ShardedTrainer(RankGroup(settings, ranks_per_node=2), mirrored=False)
    try:
        two = create_model_state(request, tmp_path / "two", settings, sharded.load_model, None, sharded.load_weights)
        for step in range(3):
            expected = single.train(one, batch(step), config)
            got = sharded.train(two, batch(step), config)
            assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)
            assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
            assert (got["trained_tokens"], got["sequences"]) == (expected["trained_tokens"], 5.0)
        two.weights.save(tmp_path / "saved")
    finally:
        sharded.close()
    adapter = load_file(tmp_path / "saved" / "adapter_model.safetensors")
    trained = {name.replace(".default", ""): p for name, p in one.model.named_parameters() if p.requires_grad}
    assert adapter.keys() == trained.keys()
    for name, tensor in adapter.items():
        assert torch.allclose(tensor, trained[name].detach(), atol=1e-4, rtol=0), name
    optimizer = read_optimizer(tmp_path / "saved")
    assert set(optimizer["state"]) == {n for n, p in one.model.named_parameters() if p.requires_grad}


async def sampled_group(model: TrainableModel) -> TrajectoryGroup:
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=PROMPT, max_tokens=24, n=8, temperature=1.0, logprobs=True
    )
    return TrajectoryGroup(
        Trajectory(messages_and_choices=[*PROMPT, choice], reward=float(i % 3))
        for i, choice in enumerate(completion.choices)
    )


def ranks_of(server_pid: int) -> dict[int, psutil.Process]:
    """The server's trainer ranks, by local rank (torchrun's children)."""
    found = {}
    for process in psutil.Process(server_pid).children(recursive=True):
        try:
            if "art_sky.cluster.training.sharded" in " ".join(process.cmdline()):
                found[int(process.environ()["LOCAL_RANK"])] = process
        except (psutil.NoSuchProcess, KeyError):
            continue
    return found


async def test_a_rank_killed_mid_step_rolls_the_step_back_and_it_trains_again(tmp_path, caplog):
    """The step in flight is rolled back on every rank (503: the ranks restart from the last commit) and the
    client trains it again with its request id: it commits once, on the restarted ranks."""
    backend = LocalBackend(
        path=tmp_path / "art", env={"ART_SKY_TRAINER_CPU_RANKS": "2", "ART_SKY_TRAIN_MICROBATCH_TOKENS": "48"}
    )
    try:
        model = TrainableModel(name="agent", project="sharded", base_model="art-sky/tiny")
        await model.register(backend)
        health = await backend.health()
        assert (health.trainer, health.trainer_ranks) == ("sharded", 2)
        first = await model.train([await sampled_group(model) for _ in range(2)], TrainConfig(learning_rate=1e-3))
        assert first["step"] == 1
        await backend.flush_checkpoints()  # written in the background: on disk now
        steps_dir = tmp_path / "art" / "sharded" / "models" / "agent" / "checkpoints"
        at_one = load_file(steps_dir / "0001" / "adapter_model.safetensors")

        groups = [await sampled_group(model) for _ in range(8)]
        training = asyncio.create_task(model.train(groups, TrainConfig(learning_rate=1e-3)))
        while (await backend.server_client.model("agent")).activity.phase != "training":
            assert not training.done(), "the step ended before a rank could be killed mid-step"
            await asyncio.sleep(0.05)
        ranks = ranks_of(backend.server.pid)
        assert set(ranks) == {0, 1}
        ranks[1].send_signal(signal.SIGKILL)
        second = await training
        assert second["step"] == 2 and "the step was rolled back during train" in caplog.text
        await backend.flush_checkpoints()
        assert sorted(p.name for p in steps_dir.iterdir()) == ["0000", "0001", "0002"]
        # the 503 in the cluster's words: which step rolled back, which rank saw what, what happens next; gloo's own
        # text stays in the server log
        assert "training agent step 2 failed and was rolled back: the model is as it was at step 1" in caplog.text
        assert re.search(
            r"rank \d \(on .+\) lost its connection to the other ranks during train|the trainer's ranks "
            r"stopped during train: the leading rank's connection closed",
            caplog.text,
        ), caplog.text
        assert "reload the last committed step" in caplog.text and "pair.cc" not in caplog.text
        assert "()" not in caplog.text
        restarted = ranks_of(backend.server.pid)
        assert set(restarted) == {0, 1} and restarted[1].pid != ranks[1].pid
        assert load_file(steps_dir / "0001" / "adapter_model.safetensors").keys() == at_one.keys()
        at_two = load_file(steps_dir / "0002" / "adapter_model.safetensors")
        assert any(not torch.equal(at_two[name], at_one[name]) for name in at_one)

        # a rank lost between steps (a worker node that left and joined again): the group restarts as the next
        # step begins, which waits for the new ranks instead of failing
        restarted[1].send_signal(signal.SIGKILL)
        caplog.clear()
        third = await model.train(groups, TrainConfig(learning_rate=1e-3))
        assert third["step"] == 3 and ranks_of(backend.server.pid)[1].pid != restarted[1].pid
        assert "rolled back" not in caplog.text, "the step waited for the ranks: nothing to retry"
    finally:
        await backend.close(force=True)


def test_more_ranks_than_a_step_has_sequences(tmp_path):
    """Three ranks, two sequences: a rank with no share still joins every collective (idle micro-batches)."""
    settings = Settings(train_microbatch_tokens=64, cache_dir=tmp_path / "cache")
    request = RegisterRequest(name="m", project="p", base_model="art-sky/tiny")
    single = PeftTrainer(settings.train_microbatch_tokens)
    one = create_model_state(request, tmp_path / "one", settings, single.load_model, None, single.load_weights)
    sharded = ShardedTrainer(RankGroup(settings, ranks_per_node=3), mirrored=True)
    try:
        three = create_model_state(
            request, tmp_path / "three", settings, sharded.load_model, None, sharded.load_weights
        )
        expected = single.train(one, batch(0)[:2], TrainConfig(learning_rate=1e-3))
        got = sharded.train(three, batch(0)[:2], TrainConfig(learning_rate=1e-3))
        assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)
        three.weights.save(tmp_path / "saved")  # the server's own copy follows the ranks
        mirror = {n: p for n, p in three.model.named_parameters() if p.requires_grad}
        for name, param in one.model.named_parameters():
            if param.requires_grad:
                assert torch.allclose(mirror[name], param, atol=1e-4, rtol=0), name
    finally:
        sharded.close()
