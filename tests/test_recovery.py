"""Recovery of a lost SkyPilot cluster on the local Slurm (tests/slurm_harness.py): the cluster's Slurm job ended
(`scancel`, as a preemption ends a spot VM) in the middle of a train() step, and again while rollouts are in flight.
The user's loop (an art-sky loop in this process; an unchanged openpipe-art program in its own) finishes its steps,
each trained once (the step records' request ids), with the weights of a run that was never interrupted
(test_resume's method); the downtime is measured and printed. A cluster that cannot come back (its Slurm partition
down) ends in a clear error within the bound, nothing left running. One launch serves them all: each loss relaunches
the same cluster, recorded with `recover=True` and attached to as a script after `art-sky up --recover` would."""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import slurm_harness
from test_openpipe_art import run_program
from typer.testing import CliRunner

import art_sky
from art_sky import TrainableModel, TrainConfig, Trajectory, TrajectoryGroup, clusters
from art_sky.backends import SkyPilotBackend, attach
from art_sky.cli import app
from art_sky.errors import BackendUnavailableError, ConfigError, NotFoundError
from art_sky.layout import STEP_RECORD
from art_sky.provisioners import sky as provisioner
from art_sky.settings import Settings
from art_sky.store import CheckpointStore

pytest_plugins = ["fixtures_s3"]

PREFIX = f"art-sky-test-{secrets.token_hex(3)}"
CLUSTER = f"{PREFIX}-recover"
PARTITION = "debug"  # the cluster is pinned to it: with it down, no other partition can take the relaunch
API_KEY = secrets.token_urlsafe(24)
STEPS, LOST_AT = 5, 2  # the art-sky loop's steps, and the first that may be in flight when its cluster is lost
SERVER_ENV = {"ART_SKY_TRAIN_MICROBATCH_TOKENS": "16"}  # many micro-batches: a step long enough to be cut
PROMPT = [{"role": "user", "content": "Say something."}]
LIMIT = 900


def fixed_group(step: int) -> TrajectoryGroup:
    """The same group for a step in every run (fixed answers, no sampling), rewards that differ."""
    from openai.types.chat import ChatCompletionMessage
    from openai.types.chat.chat_completion import Choice

    return TrajectoryGroup(
        Trajectory(
            messages_and_choices=[
                *PROMPT,
                Choice(
                    index=0,
                    finish_reason="stop",
                    message=ChatCompletionMessage(role="assistant", content=f"answer {step}-{i} " * 3),
                ),
            ],
            reward=float(i),
        )
        for i in range(24)
    )


def lose_the_disk(backend, jobs: list[str]) -> None:
    """Once the ended job's processes are gone, its checkpoints go too: a preempted VM's disk goes with it, while
    the local Slurm's cluster HOME would outlive the job (a relaunch must resume from the object store)."""
    ended = time.monotonic()
    slurm_harness.wait_jobs_gone(jobs)
    print(f"\nthe cancelled Slurm job ended {time.monotonic() - ended:.0f} s after scancel")
    shutil.rmtree(backend.server.layout.art_path, ignore_errors=True)


def adapter(step_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(step_dir / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def store(s3_server) -> str:
    return f"s3://{s3_server.new_bucket()}/runs"


async def train_uninterrupted(root: Path) -> dict:
    """The weights after STEPS steps of a run nothing interrupted (this machine's own server)."""
    backend = art_sky.LocalBackend(path=root, env=SERVER_ENV)
    try:
        model = TrainableModel(name="agent", project="recover", base_model="art-sky/tiny")
        await model.register(backend)
        for step in range(STEPS):
            assert (await model.train([fixed_group(step)], TrainConfig(learning_rate=1e-2)))["step"] == step + 1
    finally:
        await backend.close(force=True)
    return adapter(root / "recover" / "models" / "agent" / "checkpoints" / f"{STEPS:04d}")


@pytest.fixture(scope="module")
def cluster(sky_slurm, s3_server, store, tmp_path_factory):
    """The recorded cluster, launched once with recovery on and the object store, and meanwhile the weights of an
    uninterrupted run (`cluster.uninterrupted`); torn down at the end."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in (
            s3_server.env().items()
            | {
                "ART_SKY_REMOTE_PYTHON": sys.executable,
                "ART_SKY_SERVER_START_TIMEOUT": "300",
                "ART_SKY_SSH_CONNECT_TIMEOUT": "90",
                "ART_SKY_RECOVER_AFTER": "3",
                "ART_SKY_RECOVER_TIMEOUT": "420",
                "ART_SKY_HOME": str(tmp_path_factory.mktemp("art-sky-home")),
            }.items()
        ):
            patch.setenv(key, value)
        patch.delenv("ART_SKY_API_KEY", raising=False)
        env_file = tmp_path_factory.mktemp("env") / "server.env"
        env_file.write_text("".join(f"{k}={v}\n" for k, v in SERVER_ENV.items()))

        async def launch() -> float:
            started = time.monotonic()
            backend = await SkyPilotBackend.initialize_cluster(
                cluster_name=CLUSTER,
                gpu=None,
                infra=f"{slurm_harness.INFRA}/{PARTITION}",
                env_path=env_file,
                resources={"cpus": 1, "memory": 1},
                autostop_minutes=None,
                api_key=API_KEY,
                recover=True,
                checkpoint_uri=store,
            )
            await backend.close()
            return time.monotonic() - started

        async def both() -> tuple[float, dict]:
            return await asyncio.gather(launch(), train_uninterrupted(tmp_path_factory.mktemp("uninterrupted")))

        try:
            took, weights = asyncio.run(asyncio.wait_for(both(), LIMIT))
            print(f"\nlaunched {CLUSTER} in {took:.0f} s")
            yield Launched(CLUSTER, weights)
        finally:
            slurm_harness.set_partition(PARTITION, "UP")
            slurm_harness.down_clusters(PREFIX)


async def step_records(store: str, name: str, steps: int, tmp: Path) -> list[dict]:
    """Each step's record, as the object store has it (what a new cluster resumes from)."""
    records = []
    for step in range(1, steps + 1):
        dest = tmp / f"{name}-{step}"
        await CheckpointStore(store).download_step("recover" if name == "agent" else "art-compat", name, step, dest)
        records.append(json.loads((dest / STEP_RECORD).read_text()) | {"dir": dest})
    return records


@dataclass
class Launched:
    name: str  # the recorded cluster's
    uninterrupted: dict  # the weights after STEPS steps of a run nothing interrupted


def test_recover_without_an_object_store_is_refused_before_anything_is_rented(monkeypatch, tmp_path):
    monkeypatch.delenv("ART_SKY_CHECKPOINT_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # no .env with a store
    monkeypatch.setenv("ART_SKY_HOME", str(tmp_path / "home"))
    with pytest.raises(
        ConfigError,
        match=r"recover=True needs an object store: .*start from step 0.*"
        r"ART_SKY_CHECKPOINT_URI.*recover='from-scratch'",
    ):
        SkyPilotBackend.for_cluster(cluster_name="never", gpu=None, recover=True, settings=Settings())
    spot = SkyPilotBackend.for_cluster(cluster_name="never", gpu=None, spot=True, settings=Settings())
    assert spot.recovery is None  # on by default only where it is safe
    stored = SkyPilotBackend.for_cluster(
        cluster_name="never", gpu=None, spot=True, checkpoint_uri="s3://b/p", settings=Settings()
    )
    assert stored.recovery is not None and stored.recover is True


STEP_PHASES = ("preparing", "waiting", "training", "saving", "swapping")


@pytest.mark.slow
async def test_preempted_mid_train_and_mid_rollouts_both_loops_finish_each_step_once_with_uninterrupted_weights(
    cluster, store, tmp_path
):
    """One loss, two loops on the cluster, each recovering in its own process. This process's art-sky loop trains
    with wait=False and rolls its next batch out meanwhile: the cluster's job ends with a train() step and those
    rollouts in flight. An unchanged openpipe-art program (echo, in its own process, its backend line attaching to
    the cluster) is in the middle of its run. One process relaunches the cluster, the other finds it relaunched and
    reconnects; both loops finish their steps, each trained once, this loop's with the weights of a run that was
    never interrupted. `art-sky status` says `recovering` meanwhile."""
    art_program = asyncio.ensure_future(
        asyncio.to_thread(run_program, "echo", tmp_path, f"art_sky.attach({cluster.name!r})")
    )
    backend = attach(cluster.name)
    model = TrainableModel(name="agent", project="recover", base_model="art-sky/tiny")
    await model.register(backend)
    client = model.openai_client()
    echo = art_sky.Model(name="echo", project="art-compat")
    while not art_program.done():  # the ART program is on the cluster before the loss, and not done at it
        try:
            await backend.model_info(echo)
            break
        except NotFoundError:
            await asyncio.sleep(0.5)
    rolling_out = asyncio.Event()
    lost: list[tuple[int, float]] = []  # the step in flight when the cluster was lost, and when

    async def preempt_mid_step_and_mid_rollouts() -> None:
        while True:
            await rolling_out.wait()
            step = (backend.known_step("agent") or 0) + 1
            info = await backend.model_info(model)
            if step >= LOST_AT and rolling_out.is_set() and info.activity.phase in STEP_PHASES:
                assert (await backend.model_info(echo)).step < 2, "the ART program ended before the loss"
                jobs = slurm_harness.preempt(cluster.name)
                lost.append((step, time.monotonic()))
                assert jobs
                status.append(asyncio.ensure_future(asyncio.to_thread(status_while_recovering)))
                await asyncio.to_thread(lose_the_disk, backend, jobs)
                return
            await asyncio.sleep(0.02)

    shown: list[str] = []
    status: list[asyncio.Future] = []

    def status_while_recovering() -> None:  # `art-sky status`, as a user would run it once recovery is under way
        deadline = time.monotonic() + LIMIT
        while time.monotonic() < deadline:
            recovery = clusters.load(Settings().home, cluster.name).recovery
            if recovery is not None and recovery.state == "recovering":
                result = CliRunner().invoke(app, ["status", cluster.name, "--json"])
                assert result.exit_code == 0, result.output
                shown.append(json.loads(result.stdout)[0]["server"]["state"])
                return
            time.sleep(0.5)

    preempting = asyncio.ensure_future(preempt_mid_step_and_mid_rollouts())
    results, sampled = [], []
    for step in range(STEPS):  # the loop, as a user writes it: the next batch rolls out while a step trains
        training = await model.train([fixed_group(step)], TrainConfig(learning_rate=1e-2), wait=False)
        rolling_out.set()
        sampled += await asyncio.gather(
            *(
                client.chat.completions.create(model=model.get_inference_name(), messages=PROMPT, max_tokens=24)
                for _ in range(6)
            )
        )
        rolling_out.clear()
        results.append(await asyncio.wait_for(training, LIMIT))
    if not lost:  # else waiting for it would wait for ever
        preempting.cancel()
        pytest.fail("no poll saw a step in flight while rollouts were: the cluster was never lost")
    await preempting
    ((lost_step, lost_at),) = lost
    after = results[-1]
    print(
        f"\nrecovery (art-sky loop, step {lost_step} and rollouts in flight): {after['cluster/downtime_s']:.0f} s of "
        f"downtime, {after['cluster/steps_replayed']:.0f} step(s) trained again, "
        f"{after['cluster/lost_gpu_hours']:.4f} machine-hours lost"
    )
    assert [r["step"] for r in results] == list(range(1, STEPS + 1))
    assert after["cluster/recoveries"] == 1 and after["cluster/downtime_s"] > 0 and after["cluster/lost_gpu_hours"] > 0
    assert all(r["discarded_stale_groups"] == 0 for r in results)  # the staleness bound held across the switch
    assert len(sampled) == 6 * STEPS and all(c.model.startswith("agent@") for c in sampled)  # none lost
    assert model.openai_client().base_url == client.base_url  # the loop's OpenAI endpoint did not change
    await backend.flush_checkpoints()
    await backend.close()

    seen = await asyncio.wait_for(art_program, LIMIT)
    await status[0]
    assert seen["get_step"] == 2 and seen["refused"].startswith("ConfigError")
    assert "recovering" in shown
    record = clusters.load(Settings().home, cluster.name).recovery
    assert record.state == "recovered" and record.recoveries == 1
    print(f"recovery (ART program, in its own process): {record.downtime_s:.0f} s of downtime")

    records = await step_records(store, "agent", STEPS, tmp_path)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert len({r["request_id"] for r in records}) == STEPS  # no step trained twice, none lost
    assert len({r["request_id"] for r in await step_records(store, "echo", 2, tmp_path)}) == 2
    import torch

    resumed = adapter(records[-1]["dir"])
    assert resumed.keys() == cluster.uninterrupted.keys()
    for name, tensor in cluster.uninterrupted.items():
        assert torch.allclose(resumed[name], tensor, rtol=1e-4, atol=1e-6), name


@pytest.mark.slow
async def test_a_cluster_that_cannot_come_back_ends_in_an_error_within_the_bound_nothing_left_running(cluster):
    backend = attach(cluster.name)
    model = TrainableModel(name="agent", project="recover", base_model="art-sky/tiny")
    await model.register(backend)
    slurm_harness.set_partition(PARTITION, "INACTIVE")  # no capacity anywhere the cluster may run
    try:
        assert slurm_harness.preempt(cluster.name)
        started = time.monotonic()
        with pytest.raises(BackendUnavailableError) as raised:
            await asyncio.wait_for(model.train([fixed_group(9)], TrainConfig(learning_rate=1e-2)), LIMIT)
        took = time.monotonic() - started
    finally:
        slurm_harness.set_partition(PARTITION, "UP")
        await backend.close()
    message = str(raised.value)
    assert "could not be brought back" in message and "torn down: nothing is left running or billing" in message
    assert "initialize_cluster again" in message
    assert took < Settings().recover_timeout + 120, took  # the bound, and SkyPilot's own teardown
    print(f"\nunrecoverable cluster: error after {took:.0f} s: {message.splitlines()[0][:300]}")
    assert not slurm_harness.slurm_jobs(cluster.name)
    assert await provisioner.cluster_status(cluster.name) is None
    assert clusters.load(Settings().home, cluster.name).recovery.state == "failed"
