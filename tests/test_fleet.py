"""The inference fleet: a head server and a replica server joined to it (`python -m art_sky.cluster --join`), each its
own process and port on this machine. Completions spread over both; a trained step is served by both as soon as
train returns; a replica killed under load loses no completion that had not started streaming and leaves the
fleet; a join that cannot work is refused, saying why."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fleet_nodes import API_KEY, Node, complete, fleet, load_until_replica_busy, start_node, wait_fleet
from loop import trajectory
from typer.testing import CliRunner

from art_sky import clusters
from art_sky.cli import app
from art_sky.errors import BackendUnavailableError
from art_sky.layout import ServerLayout
from art_sky.remote import lifecycle
from art_sky.remote.runner import LocalRunner

pytestmark = pytest.mark.slow
MODEL = {"name": "tiny", "project": "fleet", "base_model": "art-sky/tiny"}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory) -> tuple[Node, Node]:
    root = tmp_path_factory.mktemp("fleet")
    head = start_node(root, "head")
    replica = None
    try:
        with head.client() as client:
            assert client.post("/art/models", json=MODEL).status_code == 200
        replica = start_node(root, "replica", join=head.url, rank=1)
        wait_fleet(head, lambda f: len(f) == 2 and f[1]["steps"] == {"tiny": 0}, "the replica serving tiny@0")
        yield head, replica
    finally:
        for node in (replica, head):
            if node is not None:
                node.stop()


def client(node: Node) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=node.url, headers={"authorization": f"Bearer {API_KEY}"}, timeout=120)


def served(head: Node) -> list[int]:
    """Completions each replica has served: the head's own engine, then the replica."""
    return [r["completions"] for r in fleet(head)]


async def test_completions_spread_over_both_replicas(nodes):
    head, _ = nodes
    before = served(head)
    async with client(head) as http:
        responses = await asyncio.gather(*(complete(http, f"conversation {i}") for i in range(24)))
    assert [r.status_code for r in responses] == [200] * 24
    assert {r.json()["model"] for r in responses} == {"tiny@0"}
    after = served(head)
    assert sum(after) - sum(before) == 24
    assert after[0] > before[0] and after[1] > before[1], (before, after)


async def test_a_conversations_turns_stay_on_one_replica(nodes):
    head, _ = nodes
    before = served(head)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first turn"}]
    async with client(head) as http:
        for turn in range(6):  # one at a time: both replicas idle, the conversation's own replica serves it
            response = await http.post(
                "/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 4}
            )
            assert response.status_code == 200
            messages += [
                {"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"turn {turn + 2}"},
            ]
    grew = [a - b for a, b in zip(served(head), before, strict=False)]
    assert sorted(grew) == [0, 6], grew


async def test_a_trained_step_is_served_by_every_replica_when_train_returns(nodes):
    head, _ = nodes
    async with client(head) as http:
        sampled = (await complete(http, "hi", n=4, logprobs=True, return_tokens_as_token_ids=True, seed=1)).json()
        group = {"trajectories": [trajectory(choice, float(i % 2)) for i, choice in enumerate(sampled["choices"])]}
        response = await http.post(
            "/art/models/tiny/train", json={"groups": [group], "config": {"learning_rate": 1e-3}}
        )
        lines = [json.loads(line) for line in response.text.splitlines() if line.strip()]
        assert lines[-1]["type"] == "result" and lines[-1]["step"] == 1, lines[-1]
        assert [r["steps"] for r in fleet(head)] == [{"tiny": 1}, {"tiny": 1}]  # every replica, at once
        before = served(head)
        responses = await asyncio.gather(*(complete(http, f"after the step {i}") for i in range(24)))
        assert {r.json()["model"] for r in responses} == {"tiny@1"}
        after = served(head)
        assert after[0] > before[0] and after[1] > before[1], (before, after)
        older = await http.post(
            "/v1/chat/completions",
            json={"model": "tiny@0", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
        assert older.status_code == 200 and older.json()["model"] == "tiny@0"  # the head has every checkpoint


def test_status_shows_each_replica_its_load_and_step(nodes, tmp_path, monkeypatch):
    head, replica = nodes
    monkeypatch.setenv("ART_SKY_HOME", str(tmp_path))
    clusters.save(
        tmp_path,
        clusters.ClusterRecord(
            name="two",
            kind="local",
            where="this machine",
            target=None,
            layout=head.layout,
            port=head.server.port,
            pid=head.server.pid,
            api_key=API_KEY,
        ),
    )
    result = CliRunner().invoke(app, ["status", "two", "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)[0]["server"]["fleet"]
    assert [(r["url"], r["steps"], r["outstanding"]) for r in shown] == [
        ("local", {"tiny": 1}, 0),
        (replica.url, {"tiny": 1}, 0),
    ]
    result = CliRunner().invoke(app, ["status", "two"])
    rows = {line.split()[0]: line for line in result.output.partition("REPLICA")[2].splitlines()[1:] if line}
    assert "REPLICA" in result.output and set(rows) == {"two/head", f"two/{replica.url}"}, result.output
    assert all("0 outstanding" in line and line.endswith("tiny@1") for line in rows.values()), result.output


async def test_joins_that_cannot_work_are_refused_saying_why(nodes, tmp_path):
    head, _ = nodes
    join = {"url": "http://127.0.0.1:1", "node": "elsewhere", "engine": "portable", "rank": 5}
    async with httpx.AsyncClient(base_url=head.url, timeout=60) as http:
        wrong_key = await http.post("/fleet/join", json=join, headers={"authorization": "Bearer wrong"})
        assert wrong_key.status_code == 401
        auth = {"authorization": f"Bearer {API_KEY}"}
        unreachable = await http.post("/fleet/join", json=join, headers=auth)
        assert (
            unreachable.status_code == 502
            and "cannot reach the replica at http://127.0.0.1:1" in unreachable.json()["detail"]
        )
        other_engine = await http.post("/fleet/join", json=join | {"engine": "vllm"}, headers=auth)
        assert other_engine.status_code == 409 and "ART_SKY_ENGINE" in other_engine.json()["detail"]
        for url in ("127.0.0.1:80/x", "http://0", "http://0.0.0.0:80", "http://node-b", "http://[::1:80"):
            not_a_url = await http.post("/fleet/join", json=join | {"url": url}, headers=auth)
            assert not_a_url.status_code == 422 and "url" in not_a_url.json()["detail"], (url, not_a_url.text)
        for url in ("http://127.0.0.1:80?x=1", "http://127.0.0.1:80#top", "http://node-b:80?"):
            extra = await http.post("/fleet/join", json=join | {"url": url}, headers=auth)
            assert extra.status_code == 422, (url, extra.text)
            assert f"{url!r} has more than http://HOST:PORT (a path, ?query or #fragment)" in extra.json()["detail"]
        for rank in ({"rank": None}, {"rank": 0}, {}):  # a worker's join always names its rank, 1 and up
            rankless = await http.post(
                "/fleet/join", json={k: v for k, v in join.items() if k != "rank"} | rank, headers=auth
            )
            assert rankless.status_code == 422 and "rank" in rankless.json()["detail"], rankless.text
    try:  # it listens, then the head refuses it and it exits: which of the two the readiness wait sees varies
        stranger = start_node(tmp_path, "stranger", join=head.url, key="not-the-head-key").layout
    except BackendUnavailableError:
        stranger = None
    log = Path(tmp_path / "stranger" / "run" / "server.log")
    deadline = time.monotonic() + 60
    while "could not join" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "this replica could not join the fleet: the head at " in log.read_text()
    assert "refused this node's API key: start it with the head's ART_SKY_API_KEY" in log.read_text()
    while stranger is not None and lifecycle.status(LocalRunner(), stranger).state != "stopped":
        assert time.monotonic() < deadline, "the refused replica did not exit"
        time.sleep(0.2)
    assert len(fleet(head)) == 2


async def test_a_node_has_one_replica_and_its_run_files_one_server(nodes):
    """A second replica of a node rank the fleet has is refused (409), naming the one that serves it; a second
    server on a run directory whose server runs exits before touching its files, naming that server."""
    head, replica = nodes
    async with client(head) as http:
        second = await http.post(
            "/fleet/join", json={"url": head.url, "node": "again", "engine": "portable", "rank": 1, "pid": 4242}
        )
    assert second.status_code == 409, second.text
    assert second.json()["detail"].startswith(
        f"node rank 1 is in the fleet already: the replica at {replica.url} "
        f"on {socket.gethostname()} (pid {replica.server.pid}) serves it"
    )
    assert [(r["url"], r["rank"]) for r in fleet(head)] == [("local", None), (replica.url, 1)]

    run = Path(replica.layout.run_dir)
    log = Path(replica.layout.log_file).read_bytes()
    files = {path.name: path.read_bytes() for path in run.iterdir() if path.name != "server.log"}
    started = subprocess.run(
        [
            sys.executable,
            "-m",
            "art_sky.cluster",
            "--run-dir",
            str(run),
            "--art-path",
            replica.layout.art_path,
            "--join",
            head.url,
            "--node-rank",
            "1",
        ],
        env=os.environ | {"ART_SKY_API_KEY": API_KEY, "ART_SKY_NODES": "2"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode != 0
    assert (
        f"the run directory {run} belongs to a cluster server that is running (pid {replica.server.pid}, "
        f"port {replica.server.port})" in started.stderr
    )
    assert {path.name: path.read_bytes() for path in run.iterdir() if path.name != "server.log"} == files
    assert Path(replica.layout.log_file).read_bytes().startswith(log)  # not rotated: the first one's, still growing
    assert lifecycle.status(LocalRunner(), replica.layout).state == "listening" and len(fleet(head)) == 2


def test_a_worker_names_its_rank_within_the_clusters_nodes(tmp_path):
    """A worker without --node-rank, with one past ART_SKY_NODES, or with a --join URL that is more than HOST:PORT
    does not start, saying what to give; a multi-node head refuses a join of a rank past its nodes (409)."""
    head = start_node(tmp_path, "head", env={"ART_SKY_NODES": "2"})
    try:

        def worker(*args: str, nodes: str = "2") -> str:
            run = tmp_path / "worker"
            command = [sys.executable, "-m", "art_sky.cluster", "--run-dir", str(run), *args]
            env = os.environ | {"ART_SKY_API_KEY": API_KEY, "ART_SKY_NODES": nodes}
            started = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
            assert started.returncode != 0 and not run.exists(), started  # refused before it took any file
            return started.stderr.strip()

        assert worker("--join", head.url) == (
            "--join needs --node-rank: this worker node's rank in the cluster, 1 to ART_SKY_NODES - 1 "
            "(SkyPilot's SKYPILOT_NODE_RANK); the head keeps one replica per rank"
        )
        assert worker("--join", head.url, "--node-rank", "2").startswith(
            "--node-rank 2 is not a worker of this cluster: ART_SKY_NODES is 2, so its workers are ranks 1 to 1."
        )
        assert "its workers are none (a one-node cluster)" in worker("--join", head.url, "--node-rank", "1", nodes="1")
        for url in (f"{head.url}?token=1", f"{head.url}#x", f"{head.url}/v1"):
            assert worker("--join", url, "--node-rank", "1").startswith(
                f"--join {url!r}: {url!r} has more than http://HOST:PORT (a path, ?query or #fragment)"
            )
        join = {"url": "http://127.0.0.1:1", "node": "far", "engine": "portable", "pid": 7}
        with head.client(timeout=30) as http:
            for rank in (2, 3, 65535):
                refused = http.post("/fleet/join", json=join | {"rank": rank})
                assert refused.status_code == 409, refused.text
                assert refused.json()["detail"].startswith(
                    f"node rank {rank} of the replica on far is not a worker of this cluster: it has 2 nodes "
                    "(ART_SKY_NODES), so the workers are ranks 1 to 1"
                )
            assert http.post("/fleet/join", json=join | {"rank": 1}).status_code == 502  # in range: tried
        assert len(fleet(head)) == 1
    finally:
        head.stop()


def test_a_replica_started_before_its_head_joins_once_the_head_answers(tmp_path):
    """SkyPilot starts every node's script at once: a replica whose head does not answer yet keeps trying, for
    ART_SKY_SERVER_START_TIMEOUT, then exits saying so."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    head_url = f"http://127.0.0.1:{port}"
    early = start_node(tmp_path, "early", join=head_url)
    try:  # it gives up 5 s after it starts: on a loaded machine, maybe before the readiness wait has seen it listen
        lonely = start_node(tmp_path, "lonely", join=head_url, env={"ART_SKY_SERVER_START_TIMEOUT": "5"}).layout
    except BackendUnavailableError:
        lonely = ServerLayout(run_dir=str(tmp_path / "lonely" / "run"), art_path=str(tmp_path / "lonely" / "art"))
    head = None
    try:
        log = Path(tmp_path / "lonely" / "run" / "server.log")
        deadline = time.monotonic() + 60
        while lifecycle.status(LocalRunner(), lonely).state != "stopped":
            assert time.monotonic() < deadline, "a replica whose head never answers did not give up"
            time.sleep(0.2)
        assert f"could not join the fleet: cannot reach the head at {head_url}" in log.read_text()
        assert "tried for 5 s (ART_SKY_SERVER_START_TIMEOUT)" in log.read_text()
        assert lifecycle.status(LocalRunner(), early.layout).state == "listening"  # still trying
        head = start_node(tmp_path, "head", port=port)
        assert [r["url"] for r in wait_fleet(head, lambda f: len(f) == 2, "the early replica joined")] == [
            "local",
            early.url,
        ]
    finally:
        for node in (head, early):
            if node is not None:
                node.stop()


async def test_a_replica_that_stops_answering_leaves_and_joins_again_once_it_answers(nodes):
    head, replica = nodes
    async with client(head) as http:
        requests = await load_until_replica_busy(head, lambda i: complete(http, f"stall {i}", max_tokens=32))
        os.kill(replica.server.pid, signal.SIGSTOP)
        try:  # three missed health checks later it leaves, and what it held is served by the head
            responses = await asyncio.gather(*requests)
            assert [r.status_code for r in responses] == [200] * len(requests)
            gone = await asyncio.to_thread(wait_fleet, head, lambda f: len(f) == 1, "the stopped replica gone", 60)
            assert [r["url"] for r in gone] == ["local"]
        finally:
            os.kill(replica.server.pid, signal.SIGCONT)
    await asyncio.to_thread(
        wait_fleet,
        head,
        lambda f: len(f) == 2 and f[1]["steps"] == {"tiny": 1},
        "the replica in the fleet again, serving tiny@1",
        60,
    )


async def test_a_replica_killed_under_load_loses_no_completion_and_leaves(nodes):
    head, replica = nodes
    async with client(head) as http:
        sent = await load_until_replica_busy(  # every 8th streamed
            head, lambda i: complete(http, f"load {i}", max_tokens=32 if i % 8 else 64, stream=not i % 8)
        )
        replica.kill()
        responses = await asyncio.gather(*sent)
    streamed = [r.text for i, r in enumerate(responses) if not i % 8]
    assert [r.status_code for r in responses] == [200] * len(sent), [r.text for r in responses if r.status_code != 200]
    for text in streamed:  # whole, or ended by an error event that says what happened
        assert text.endswith("data: [DONE]\n\n") or "failed after it had started streaming" in text, text[-500:]
    assert [r["url"] for r in wait_fleet(head, lambda f: len(f) == 1, "the killed replica gone")] == ["local"]
