"""One lineage, one writer (cluster/lineage.py): two model names on one server, two servers on one folder, two
clusters on one store prefix (SeaweedFS), two `art-sky demo` in one folder. The second is refused, naming the owner;
the first trains on unharmed; history has no step twice; the owner killed (kill -9), the next one takes over."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import app_client

from art_sky import LocalBackend, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup
from art_sky.errors import ServerError
from art_sky.ownership import alive, held_by_another
from art_sky.settings import Settings
from art_sky.store import CheckpointStore

pytest_plugins = ["fixtures_s3"]

PROMPT = [{"role": "user", "content": "Say something."}]
TINY = "art-sky/tiny"


def model(name: str = "agent", run_name: str | None = None) -> TrainableModel:
    return TrainableModel(name=name, project="lineage", base_model=TINY, run_name=run_name)


async def train_step(model: TrainableModel) -> int:
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=PROMPT, max_tokens=4, n=2, temperature=1.0
    )
    group = TrajectoryGroup(
        Trajectory(messages_and_choices=[*PROMPT, choice], reward=float(i))
        for i, choice in enumerate(completion.choices)
    )
    await model.train([group], TrainConfig(learning_rate=1e-3))
    return await model.get_step()


def kill9(pid: int) -> None:
    """kill -9, and wait until the process has ended (its files closed: its locks let go)."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} outlived kill -9 by 30 s"
        time.sleep(0.05)


def history_steps(path) -> list[int]:
    lines = (path / "lineage" / "models" / "agent" / "history.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if line.strip()]


async def test_two_names_claiming_one_lineage_are_a_409_naming_the_holder(tmp_path):
    body = {"project": "lineage", "base_model": TINY}
    async with app_client(tmp_path, Settings(), body | {"name": "a"}, body | {"name": "x", "run_name": "r"}) as client:
        for claim, holder in [({"name": "b", "run_name": "a"}, "a"), ({"name": "y", "run_name": "r"}, "x")]:
            response = await client.post("/art/models", json=body | claim)
            assert response.status_code == 409, response.text
            detail = response.json()["detail"]
            assert f"which model {holder!r} holds on this server" in detail and "run_name of its own" in detail
        assert (await client.get("/art/models/a")).json()["step"] == 0  # the holders are unharmed
        again = await client.post("/art/models", json=body | {"name": "b", "run_name": "b2"})  # its own lineage
        assert again.status_code == 200, again.text
        assert (await client.post("/art/models", json=body | {"name": "a"})).status_code == 200  # a retry: the same


async def test_a_filesystem_that_cannot_lock_is_a_warning_and_registration_goes_on(tmp_path, monkeypatch, caplog):
    import errno
    import fcntl

    flock = fcntl.flock

    def no_locks(fd, operation):  # as an NFS mount without a lock manager answers, for the lineage's lock
        if os.readlink(f"/proc/self/fd/{fd}").endswith("lineage.lock"):
            raise OSError(errno.ENOLCK, "No locks available")
        return flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", no_locks)
    async with app_client(tmp_path, Settings(), {"name": "nolock", "project": "lineage", "base_model": TINY}):
        pass
    assert "cannot be locked (No locks available)" in caplog.text and "--art-path" in caplog.text


@pytest.mark.slow
async def test_two_servers_on_one_folder_the_second_is_refused_until_the_first_dies(tmp_path):
    first, second = LocalBackend(path=tmp_path), LocalBackend(path=tmp_path)
    try:
        owner = model()
        await owner.register(first)
        assert await train_step(owner) == 1
        with pytest.raises(ServerError) as refused:
            await model().register(second)
        message = str(refused.value)
        assert refused.value.status_code == 409, message
        assert f"pid {first.server.pid}" in message and socket.gethostname() in message, message
        assert "is written by another art-sky server" in message and "kill its pid" in message, message
        assert await train_step(owner) == 2  # the first is unharmed
        await first.flush_checkpoints()
        kill9(first.server.pid)  # its lock dies with it: the next writer takes over at once
        taker = model()
        await taker.register(second)
        assert await taker.get_step() == 2
        assert await train_step(taker) == 3
        await second.flush_checkpoints()
    finally:
        await first.close(force=True)
        await second.close(force=True)
    assert history_steps(tmp_path) == [1, 2, 3]


@pytest.mark.slow
async def test_two_clusters_on_one_store_prefix(s3_server, tmp_path, monkeypatch):
    """Two servers, each its own folder, one SeaweedFS prefix: the second cluster is refused while the first lives,
    naming it; the first trains on; killed (kill -9: its record stays), it is taken over at once on this host."""
    uri = f"s3://{s3_server.new_bucket()}/runs"
    env = s3_server.env() | {"ART_SKY_OWNER_STALE_AFTER": "4"}
    first = LocalBackend(path=tmp_path / "a", env=env, checkpoint_uri=uri, name="alpha")
    second = LocalBackend(path=tmp_path / "b", env=env, checkpoint_uri=uri, name="beta")
    try:
        owner = model()
        await owner.register(first)
        assert await train_step(owner) == 1
        time.sleep(2.5)  # past a refresh (every quarter of the bound): the record stays live
        with pytest.raises(ServerError) as refused:
            await model().register(second)
        message = str(refused.value)
        assert refused.value.status_code == 409, message
        assert "cluster 'alpha'" in message and f"pid {first.server.pid}" in message, message
        assert f"{uri}/lineage/models/agent/owner.json" in message, message
        assert not (tmp_path / "b" / "lineage" / "models" / "agent" / "checkpoints").exists()  # nothing written
        assert await train_step(owner) == 2
        assert (await first.flush_checkpoints()).synced["agent"] == 2
        kill9(first.server.pid)
        taker = model()
        await taker.register(second)  # restored from the store, then trains on
        assert await taker.get_step() == 2
        assert await train_step(taker) == 3
        assert (await second.flush_checkpoints()).synced["agent"] == 3
        for key, value in s3_server.env().items():
            monkeypatch.setenv(key, value)
        store = CheckpointStore(uri)
        record = json.loads((await store.owner("lineage", "agent"))[0])
        assert record["cluster"] == "beta" and record["pid"] == second.server.pid
    finally:
        await first.close(force=True)
        await second.close(force=True)
    history = [json.loads(line)["step"] for line in (await store.history("lineage", "agent")).decode().splitlines()]
    assert history == [1, 2, 3]
    assert await store.owner("lineage", "agent") is None  # a server that stops lets its records go


async def _record(store: CheckpointStore, **fields) -> None:
    now = time.time()
    owner = {"format": 1, "host": "elsewhere", "pid": 4242, "cluster": "gamma", "server": "/srv/run"}
    owner |= {"since": now - 100, "refreshed": now} | fields
    found = await store.owner("lineage", "agent")
    if found is not None:
        await store.delete_owner("lineage", "agent")
    await store.put_owner("lineage", "agent", json.dumps(owner).encode(), None)


@pytest.mark.slow
async def test_another_hosts_record_refuses_until_stale_and_odd_records_are_named(s3_server, tmp_path, monkeypatch):
    """Records another host wrote (its pid cannot be checked from here): live, refused; stale (older than the bound),
    taken over; a garbled one or one of another format: a message saying what it is."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    uri = f"s3://{s3_server.new_bucket()}/runs"
    store = CheckpointStore(uri)
    settings = Settings(checkpoint_uri=uri, owner_stale_after=30)
    register = {"name": "agent", "project": "lineage", "base_model": TINY}
    cases = [
        (lambda: _record(store), "cluster 'gamma', host elsewhere, pid 4242"),
        (lambda: store.put_owner("lineage", "agent", b"{not json", None), "is not one this art-sky reads"),
        (lambda: _record(store, format=2), "has format 2 (this art-sky writes 1)"),
    ]
    for write, said in cases:
        await store.delete_owner("lineage", "agent")
        await write()
        async with app_client(tmp_path / "a", settings) as client:
            response = await client.post("/art/models", json=register)
            assert response.status_code == 409 and said in response.json()["detail"], response.text
    await _record(store, refreshed=time.time() - 31)
    async with app_client(tmp_path / "a", settings, register):
        record = json.loads((await store.owner("lineage", "agent"))[0])
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()


async def test_a_store_without_conditional_writes_warns_and_the_folder_lock_guards(tmp_path, caplog):
    """file:// stores create conditionally but cannot update so (obstore's LocalStore): said once, and training goes
    on with the folder lock alone."""
    settings = Settings(checkpoint_uri=f"file://{tmp_path / 'store'}")
    async with app_client(tmp_path / "a", settings, {"name": "agent", "project": "lineage", "base_model": TINY}):
        pass
    assert "refuses conditional writes" in caplog.text and "folder lock" in caplog.text
    assert not (tmp_path / "store" / "lineage" / "models" / "agent" / "owner.json").exists()


@pytest.mark.slow
def test_a_second_demo_in_one_folder_says_the_first_is_running_and_where(tmp_path):
    demo = [
        sys.executable,
        "-m",
        "art_sky.cli",
        "demo",
        "--path",
        str(tmp_path / ".art"),
        "--plot",
        str(tmp_path / "p.png"),
    ]
    small = ["--groups", "1", "--group-size", "2"]
    lock = tmp_path / ".art" / "art-sky-demo" / "models" / "digits-0" / "lineage.lock"
    first = subprocess.Popen([*demo, *small, "--steps", "1000"], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not held_by_another(lock):
            assert first.poll() is None and time.monotonic() < deadline, "the first demo never took its lineage"
            time.sleep(0.5)
        second = subprocess.run(
            [*demo, *small, "--steps", "1"], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert second.returncode != 0
        said = second.stderr + second.stdout
        assert "another art-sky demo is running in this folder" in said and "pid " in said, said
        owner = json.loads((lock.parent / "owner.json").read_text())
        assert f"pid {owner['pid']}" in said and owner["server"] in said.replace("\n", ""), said
        assert first.poll() is None  # the first goes on
        assert (lock.parent / "checkpoints" / "0000").is_dir()  # and keeps its files
    finally:
        first.send_signal(signal.SIGINT)
        try:
            first.wait(60)
        except subprocess.TimeoutExpired:
            first.kill()
            first.wait()
