"""Faults: a full disk during a step's save, a server killed mid-step, a save killed mid-way, a retried request.
Each asserts that no step is lost, none is trained twice, no partial checkpoint is visible, and the client gets the
step's result or a clear error."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
from conftest import app_client as server_app
from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion import Choice

from art_sky import LocalBackend, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup
from art_sky.checkpoints import CheckpointDir, verify
from art_sky.errors import BackendUnavailableError
from art_sky.settings import Settings

PROMPT = [{"role": "user", "content": "hi"}]


def group(request_id: str | None = None, size: int = 4) -> dict:
    """A train request on fixed answers (no sampling): the same step in every run."""
    body = {
        "groups": [
            {
                "trajectories": [
                    {"items": [*PROMPT, {"kind": "choice", "content": f"answer {i}"}], "reward": float(i)}
                    for i in range(size)
                ]
            }
        ],
        "config": {"learning_rate": 1e-2},
    }
    return body | ({"request_id": request_id} if request_id else {})


def app_client(art_path: Path):
    """The real server app in this process; the tiny model registered."""
    return server_app(art_path, Settings(), {"name": "tiny", "project": "faults", "base_model": "art-sky/tiny"})


async def train(client: httpx.AsyncClient, body: dict) -> dict:
    """The last line of the step's stream: its result or its error."""
    response = await client.post("/art/models/tiny/train", json=body)
    assert response.status_code == 200, response.text
    return json.loads(response.text.splitlines()[-1])


async def served(client: httpx.AsyncClient) -> list[float]:
    """The live adapter's greedy logprobs."""
    response = await client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": PROMPT, "max_tokens": 6, "temperature": 0.0, "logprobs": True},
    )
    return [token["logprob"] for token in response.json()["choices"][0]["logprobs"]["content"]]


def weights(art_path: Path, step: int) -> bytes:
    return (CheckpointDir(art_path, "faults", "tiny").step_dir(step) / "adapter_model.safetensors").read_bytes()


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs: room for the tiny model's checkpoints, until it is filled."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path, room: int = 0) -> Path:
    """Fill the disk but for `room` bytes (and a few KiB): the next checkpoint cannot be written whole."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as out:
        with contextlib.suppress(OSError):
            while True:
                out.write(b"\0" * 4096)
        out.truncate(max(out.tell() - room, 0))
    return filler


def trainer_figures(replayed: dict, trained: dict) -> bool:
    """A replay answers with the step's recorded result: the trainer's figures, as the first answer had them (the
    first answer also had the step's time split and cost, which belong to that call)."""
    return bool(replayed["metrics"]) and replayed["metrics"].items() <= trained["metrics"].items()


# A step's checkpoint is written in the background once the step commits, so the room it needs (its staged
# tensors) is checked before it commits: a disk with room for part of it (here 256 KiB) fails the step at once, rolled
# back, with HTTP's 507, naming the disk and what to free. (A write that fails later anyway: the test below.)
async def test_a_full_disk_rolls_the_step_back_and_its_retry_trains_it_once(small_disk, tmp_path):
    async with app_client(small_disk / "art") as client:
        before = await served(client)
        filler = fill(small_disk, 256 << 10)
        failed = await train(client, group("r-1"))
        assert failed["type"] == "error" and "rolled back" in failed["message"], failed
        assert failed["status"] == 507 and f"the disk is full: writing {small_disk}/art/" in failed["message"]
        assert f"{small_disk} has " in failed["message"] and "No space left on device" in failed["message"]
        assert "await model.delete_checkpoints()" in failed["message"]
        assert (await client.get("/art/models/tiny")).json()["step"] == 0
        assert await served(client) == before  # the live LoRA is as before the step
        checkpoints = CheckpointDir(small_disk / "art", "faults", "tiny")
        assert checkpoints.steps() == [0] and not [p for p in checkpoints.path.iterdir() if p.name.startswith(".tmp")]

        filler.unlink()
        result = await train(client, group("r-1"))  # the same request id: it was not recorded, so it trains now
        assert result["type"] == "result" and result["step"] == 1 and not result.get("replayed")
        again = await train(client, group("r-1"))
        assert again["step"] == 1 and again["replayed"] and trainer_figures(again, result)
        assert (await client.get("/art/models/tiny")).json()["step"] == 1

    async with app_client(tmp_path / "clean") as client:  # the same step on a server that never failed
        assert (await train(client, group("r-1")))["step"] == 1
    assert weights(small_disk / "art", 1) == weights(tmp_path / "clean", 1)  # weights and AdamW were restored


async def test_a_step_whose_write_fails_is_not_answered_until_it_is_on_disk(tmp_path):
    """Step 2 commits (served) and its checkpoint cannot be written (the checkpoints directory was moved away, a file
    put in its place): its answer is an error saying so, not a result the client would take as kept. Step 3 writes
    step 2 again first, fails the same way and is rolled back: the model stays at step 2, in memory and served. The
    directory back, step 2's retried request is answered once it is written, step 3 trains, and the run ends with the
    weights, checkpoints and history of a server that never failed."""
    art = tmp_path / "art"
    checkpoints = CheckpointDir(art, "faults", "tiny")
    async with app_client(art) as client:
        assert (await train(client, group("s1")))["step"] == 1
        os.rename(checkpoints.path, tmp_path / "aside")
        checkpoints.path.write_text("not a directory")
        unwritten = await train(client, group("s2"))
        assert unwritten["type"] == "error", unwritten
        assert "step 2 of tiny (trained and served) is not on disk yet" in unwritten["message"], unwritten
        assert (await client.get("/art/models/tiny")).json()["step"] == 2
        failed = await train(client, group("s3"))
        assert failed["type"] == "error" and "rolled back" in failed["message"], failed
        assert "step 2 of tiny (trained and served) is not on disk yet" in failed["message"], failed["message"]
        assert (await client.get("/art/models/tiny")).json()["step"] == 2
        checkpoints.path.unlink()
        os.rename(tmp_path / "aside", checkpoints.path)
        retried = await train(client, group("s2"))
        assert retried["step"] == 2 and retried["replayed"], retried
        assert checkpoints.steps() == [0, 1, 2]  # answered once on disk
        assert (await train(client, group("s3")))["step"] == 3
    assert checkpoints.steps() == [0, 1, 2, 3]
    assert [entry["step"] for entry in checkpoints.history()] == [1, 2, 3]
    async with app_client(tmp_path / "clean") as client:
        for request_id in ("s1", "s2", "s3"):
            await train(client, group(request_id))
    assert weights(art, 3) == weights(tmp_path / "clean", 3)


async def test_registering_on_a_full_disk_is_a_507_that_names_the_disk(small_disk):
    """Not only a step: any request that writes (here a new model's step 0 checkpoint) says the disk is full."""
    async with app_client(small_disk / "art") as client:
        fill(small_disk)
        response = await client.post(
            "/art/models", json={"name": "other", "project": "faults", "base_model": "art-sky/tiny"}
        )
        assert response.status_code == 507, response.text
        detail = response.json()["detail"]
        assert detail.startswith("the disk is full: writing ") and f"{small_disk} has " in detail, detail
        assert "await model.delete_checkpoints()" in detail


async def test_a_restarted_server_answers_a_retried_request_with_its_step(tmp_path):
    async with app_client(tmp_path) as client:
        first = await train(client, group("retry-me"))
        assert first["step"] == 1
    async with app_client(tmp_path) as client:  # a new server on the same checkpoints
        again = await train(client, group("retry-me"))
        assert again["replayed"] and again["step"] == 1 and trainer_figures(again, first)
        assert (await train(client, group("next")))["step"] == 2
    assert CheckpointDir(tmp_path, "faults", "tiny").steps() == [0, 1, 2]


async def test_what_a_killed_save_left_is_removed_at_the_next_start(tmp_path):
    checkpoints = CheckpointDir(tmp_path, "faults", "tiny")
    async with app_client(tmp_path) as client:
        assert (await train(client, group()))["step"] == 1
    stale = checkpoints.path / ".tmp-0002-killed"
    (stale / "training_state").mkdir(parents=True)
    (stale / "adapter_model.safetensors").write_bytes(b"half a file")
    async with app_client(tmp_path) as client:
        assert (await client.get("/art/models/tiny")).json()["step"] == 1
        assert not stale.exists()
        assert (await train(client, group()))["step"] == 2


@pytest.mark.slow
async def test_a_server_killed_during_a_step_loses_nothing(tmp_path):
    """kill -9 while a step trains: the client's call ends with a clear error (its retries find no server), the
    disk holds whole steps only, and a new server resumes at the last committed one."""
    backend = LocalBackend(path=tmp_path, settings=Settings(train_retry_timeout=3))
    model = TrainableModel(name="agent", project="faults", base_model="art-sky/tiny")
    try:
        await model.register(backend)
        answer = Choice(
            index=0, finish_reason="stop", message=ChatCompletionMessage(role="assistant", content="x" * 300)
        )
        groups = [
            TrajectoryGroup(Trajectory(messages_and_choices=[*PROMPT, answer], reward=float(i)) for i in range(8))
            for _ in range(8)
        ]
        call = asyncio.create_task(model.train(groups, TrainConfig(learning_rate=1e-3)))
        log = Path(backend.log_path)
        for _ in range(600):
            if "training agent step 1" in log.read_text():
                break
            await asyncio.sleep(0.05)
        os.kill(backend.server.pid, signal.SIGKILL)
        with pytest.raises(BackendUnavailableError, match="not lost.*get_step"):
            await call
    finally:
        await backend.close(force=True)
    checkpoints = CheckpointDir(tmp_path, "faults", "agent")
    for step in checkpoints.steps():
        verify(checkpoints.step_dir(step), checkpoints.manifest(step))  # every step directory is whole
    committed = checkpoints.steps()[-1]
    assert committed == 0  # killed within 50 ms of the step's start: it had not committed
    restarted = LocalBackend(path=tmp_path)
    try:
        await model.register(restarted)
        assert await model.get_step() == committed
        assert not [p for p in checkpoints.path.iterdir() if p.name.startswith(".tmp")]
    finally:
        await restarted.close(force=True)


@pytest.mark.slow
def test_a_local_server_ends_with_the_script_that_started_it(tmp_path):
    """A user script killed (kill -9) before its `close()` leaves no server behind, and the next LocalBackend
    removes the dead one's run directory; a closed backend leaves none."""
    import sys
    import time

    script = tmp_path / "script.py"
    script.write_text(f"""
import asyncio, art_sky
async def main():
    backend = art_sky.LocalBackend(path={str(tmp_path / "art")!r})
    await backend.health()
    print(backend.server.pid, flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
""")
    user = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    server_pid = int(user.stdout.readline())
    user.kill()
    user.wait()
    for _ in range(300):
        if not Path(f"/proc/{server_pid}").exists():
            break
        time.sleep(0.1)
    else:
        os.kill(server_pid, signal.SIGKILL)
        pytest.fail("the server outlived the script that started it")
    [dead] = (tmp_path / "art" / "run").iterdir()

    async def start_and_close():
        backend = LocalBackend(path=tmp_path / "art")
        await backend.health()
        assert not dead.exists()
        await backend.close()

    asyncio.run(start_and_close())
    assert list((tmp_path / "art" / "run").iterdir()) == []


@pytest.mark.slow
async def test_history_holds_one_line_per_step_whatever_the_restarts(tmp_path, caplog):
    """Each start checks that the newest step's history line is there: after kill -9 and after graceful restarts,
    with a step between them and without, history.jsonl holds one line per step; a file an older server filled with
    copies is repaired at the next start (the first line of each step kept), saying how many it removed."""
    from fleet_nodes import start_node

    art_path = tmp_path / "server" / "art"
    checkpoints = CheckpointDir(art_path, "faults", "tiny")

    def lines_per_step() -> dict[int, int]:
        steps = [entry["step"] for entry in checkpoints.history()]
        return {step: steps.count(step) for step in sorted(set(steps))}

    node = start_node(tmp_path, "server")  # a server process, killed with -9 after its step
    try:
        with node.client() as client:
            assert (
                client.post(
                    "/art/models", json={"name": "tiny", "project": "faults", "base_model": "art-sky/tiny"}
                ).status_code
                == 200
            )
            assert json.loads(client.post("/art/models/tiny/train", json=group()).text.splitlines()[-1])["step"] == 1
            client.post("/art/checkpoints/flush")  # the step's checkpoint, written in the background, is on disk
    finally:
        node.kill()
    async with app_client(art_path):  # restarted: the step's line is there already
        pass
    async with app_client(art_path) as client:
        assert lines_per_step() == {1: 1}
        assert (await train(client, group()))["step"] == 2
    async with app_client(art_path):
        assert lines_per_step() == {1: 1, 2: 1}
    # as an older server left it: the newest step's record line again after each of three starts
    with open(checkpoints.model_dir / "history.jsonl", "a") as history:
        history.write(3 * (json.dumps(checkpoints.record(2).history) + "\n"))
    with caplog.at_level("WARNING", logger="art_sky.cluster"):
        async with app_client(art_path):
            assert lines_per_step() == {1: 1, 2: 1}
    assert "history of tiny: removed 3 line(s) written twice by earlier restarts" in caplog.text
