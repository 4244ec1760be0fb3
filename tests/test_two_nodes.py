"""Two nodes on this machine. First through SkyPilot itself: `initialize_cluster(num_nodes=2)` on the local Slurm's
two nodes, each a slurmd in a network namespace of its own (tests/slurm_harness.py). Then, quicker, the shipped
task's own `run:` script (templates/cluster.yaml) on each node with SkyPilot's variables (SKYPILOT_NODE_RANK,
SKYPILOT_NODE_IPS, SKYPILOT_NUM_NODES), the nodes sharing one home as on SkyPilot's Slurm (its cluster home is on
NFS). The head serves and hosts the trainer's rendezvous; the other node
joins it: a replica in the fleet and its share of the trainer's ranks. A step trains on ranks of both nodes, both
replicas serve it, and losing the worker node loses no completion that had not started."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from fleet_nodes import API_KEY, Node, complete, load_until_replica_busy, wait_fleet
from loop import trajectory

from art_sky.layout import ServerLayout
from art_sky.remote import lifecycle
from art_sky.remote.runner import LocalRunner

pytestmark = pytest.mark.slow
TEMPLATE = Path(__file__).resolve().parents[1] / "templates" / "cluster.yaml"
MODEL = {"name": "tiny", "project": "nodes", "base_model": "art-sky/tiny"}


class SkyNode:
    """One node of the cluster: the template's run script as SkyPilot runs it there."""

    def __init__(self, root: Path, rank: int, head_port: int):
        self.home = root / "home"
        self.home.mkdir(exist_ok=True)
        env = os.environ | {
            "HOME": str(self.home),
            "ART_SKY_PYTHON": sys.executable,
            "ART_SKY_HEAD_PORT": str(head_port),
            "ART_SKY_API_KEY": API_KEY,
            "SKYPILOT_NUM_NODES": "2",
            "SKYPILOT_NODE_RANK": str(rank),
            "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1",
            "ART_SKY_TRAINER_CPU_RANKS": "1",
            "ART_SKY_TRAIN_MICROBATCH_TOKENS": "64",
        }
        run = yaml.safe_load(TEMPLATE.read_text())["run"]
        self.process = subprocess.Popen(
            ["bash", "-c", run],
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=(root / f"run{rank}.err").open("w"),
        )
        self.layout = ServerLayout.under(str(self.home / "art-sky" / (f"node{rank}" if rank else "")))
        try:
            self.server = lifecycle.wait_ready(
                LocalRunner(),
                self.layout,
                timeout=240,
                reach=lambda port: f"http://127.0.0.1:{port}",
                stop_on_timeout=True,
                waits_for_start=True,
            )  # a job still starting, as on SkyPilot
        except BaseException:
            self.stop()  # nothing of a node that did not come up outlives the test
            raise
        self.node = Node(self.layout, self.server)  # what the fleet tests' helpers take
        self.url = self.node.url

    def trainer_ranks(self) -> list[psutil.Process]:
        ranks = []
        for process in psutil.Process(self.process.pid).children(recursive=True):
            try:
                if "art_sky.cluster.training.sharded" in process.cmdline() and "LOCAL_RANK" in process.environ():
                    ranks.append(process)  # a rank (torchrun's own command line names the module too)
            except psutil.NoSuchProcess:
                continue
        return ranks

    def stop(self, sig: int = signal.SIGTERM) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


async def wait_fleet_of(backend, predicate, what: str, timeout: float = 180) -> list:
    """The fleet as the backend's /health shows it, once `predicate` holds for it."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate(fleet := (await backend.health()).fleet):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s; the fleet is {fleet}")
        await asyncio.sleep(0.5)
    return fleet


def cluster_processes(module: str, flag: str = "") -> dict[str, list[psutil.Process]]:
    """The processes on the two Slurm nodes that run `module` (with `flag`), by node."""
    import slurm_harness

    found: dict[str, list[psutil.Process]] = {}
    for process in psutil.process_iter():
        try:
            command = process.cmdline()
            runs = module in command and "torch.distributed.run" not in command  # torchrun's names a rank's too
            if runs and (not flag or flag in command) and (node := slurm_harness.node_of(process.pid)):
                found.setdefault(node, []).append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError):
            continue
    return found


@pytest.mark.slow
async def test_initialize_cluster_with_two_nodes_on_slurm(sky_slurm_pair, tmp_path, monkeypatch):
    """SkyPilot's own multi-node launch (its node IPs and rank variables): the server on the head node, the other
    node joined to it; a step's ranks span both nodes, both replicas serve it, and the worker's replica killed
    under load loses no completion that had not started, and is started again on its node."""
    import secrets

    import slurm_harness

    import art_sky as art
    from art_sky import SkyPilotBackend

    name = f"art-sky-test-{secrets.token_hex(3)}-nodes"
    monkeypatch.setenv("ART_SKY_REMOTE_PYTHON", sys.executable)  # the job runs this interpreter: nothing to install
    monkeypatch.setenv("ART_SKY_SERVER_START_TIMEOUT", "300")
    monkeypatch.setenv("ART_SKY_SSH_CONNECT_TIMEOUT", "90")  # each SSH connection is an `srun ... sshd -i`
    monkeypatch.setenv("ART_SKY_HOME", str(tmp_path / "art-sky-home"))
    server_env = tmp_path / "server.env"
    server_env.write_text("ART_SKY_TRAINER_CPU_RANKS=1\nART_SKY_TRAIN_MICROBATCH_TOKENS=64\n")  # a rank per node
    backend = None
    try:
        backend = await asyncio.wait_for(
            SkyPilotBackend.initialize_cluster(
                cluster_name=name,
                gpu=None,
                num_nodes=2,
                infra=sky_slurm_pair,
                resources={"cpus": 1, "memory": 1},
                autostop_minutes=None,
                api_key=API_KEY,
                env_path=server_env,
            ),
            900,
        )
        health = await backend.health()  # `up` returned once both nodes had joined
        assert (health.trainer, health.trainer_ranks) == ("sharded", 2)
        assert [r.url for r in health.fleet][0] == "local" and health.fleet[1].url.startswith("http://10.77.0."), (
            health.fleet
        )  # the worker joined at its own address on the "private network"
        (head_node,), (worker_node,) = (
            cluster_processes("art_sky.cluster", "--port"),
            cluster_processes("art_sky.cluster", "--join"),
        )
        assert {head_node, worker_node} == set(slurm_harness.PAIR)

        model = art.TrainableModel(
            name="tiny", project="nodes", base_model="art-sky/tiny", config=art.ModelConfig(max_seq_length=512)
        )
        await model.register(backend)
        await wait_fleet_of(backend, lambda f: [r.steps for r in f] == [{"tiny": 0}] * 2, "both replicas at step 0")
        client = model.openai_client().with_options(max_retries=0)  # a lost completion must show, not be retried
        prompt = [{"role": "user", "content": "hi"}]
        sampled = await client.chat.completions.create(
            model=model.get_inference_name(), messages=prompt, n=4, max_tokens=12, temperature=1.0, seed=3
        )
        group = art.TrajectoryGroup(
            [
                art.Trajectory(messages_and_choices=[*prompt, c], reward=float(i % 2))
                for i, c in enumerate(sampled.choices)
            ]
        )
        metrics = await asyncio.wait_for(model.train([group], config=art.TrainConfig(learning_rate=1e-3)), 600)
        assert metrics["step"] == 1
        ranks = cluster_processes("art_sky.cluster.training.sharded")
        assert {node: len(r) for node, r in ranks.items()} == {head_node: 1, worker_node: 1}  # the step's two ranks
        await wait_fleet_of(backend, lambda f: [r.steps for r in f] == [{"tiny": 1}] * 2, "both replicas at step 1")
        answers = await asyncio.gather(
            *(
                client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": f"after the step {i}"}], max_tokens=4
                )
                for i in range(12)
            )
        )
        assert {a.model for a in answers} == {"tiny@1"}

        # Load that lasts until the fleet has let the lost replica go: /health through the tunnel is slow next to a
        # tiny model's completions, so a fixed batch could end before the poll sees any in flight on the worker.
        lost = asyncio.Event()

        async def keep_loading(worker: int) -> int:
            answered = 0
            while not lost.is_set():
                await client.chat.completions.create(
                    model="tiny", max_tokens=24, messages=[{"role": "user", "content": f"load {worker}.{answered}"}]
                )
                answered += 1
            return answered

        load = [asyncio.ensure_future(keep_loading(worker)) for worker in range(8)]
        await wait_fleet_of(
            backend, lambda f: len(f) == 2 and f[1].outstanding > 0, "completions in flight on the worker node", 120
        )
        (replica,) = cluster_processes("art_sky.cluster", "--join")[worker_node]
        replica.kill()  # the node's server dies: nothing of it says goodbye
        try:  # its node's task starts it again (a failed task would end the job, the head's server with it)
            fleet = await wait_fleet_of(
                backend,
                lambda f: len(f) == 2 and f[1].pid not in (None, replica.pid) and f[1].steps == {"tiny": 1},
                "the worker's replica started again and serving",
            )
            assert fleet[1].rank == 1 and slurm_harness.node_of(fleet[1].pid) == worker_node
        finally:
            lost.set()
        done = await asyncio.gather(*load, return_exceptions=True)
        assert [a for a in done if isinstance(a, BaseException)] == [] and sum(done) > 0  # none lost, and some ran
    finally:
        if backend is not None:
            await backend.close()
        await asyncio.to_thread(slurm_harness.down_clusters, name)
    assert not slurm_harness.slurm_jobs(name)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """The head node of the two nodes below, shared by the tests in turn: each starts its own worker node, sharing
    the head's HOME (the second test's worker replaces the first test's, lost)."""
    root = tmp_path_factory.mktemp("nodes")
    node = SkyNode(root, 0, free_port())
    yield node
    node.stop()


async def test_a_two_node_cluster_trains_on_both_nodes_and_serves_from_both(head):
    head_port = head.server.port
    worker = None
    try:
        assert head.url.endswith(f":{head_port}")  # the head listens where the other nodes look for it
        async with httpx.AsyncClient(
            base_url=head.url, headers={"authorization": f"Bearer {API_KEY}"}, timeout=300
        ) as http:
            health = (await http.get("/health")).json()
            assert (health["trainer"], health["trainer_ranks"]) == ("sharded", 2)
            worker = SkyNode(head.home.parent, 1, head_port)  # SkyPilot starts every node's script at once
            assert (await http.post("/art/models", json=MODEL)).status_code == 200  # ranks on both nodes load it
            await asyncio.to_thread(
                wait_fleet,
                head.node,
                lambda f: len(f) == 2 and f[1]["steps"] == {"tiny": 0},
                "the worker node's replica serving tiny@0",
            )

            sampled = (
                await complete(http, "hi", n=8, logprobs=True, return_tokens_as_token_ids=True, seed=3, max_tokens=16)
            ).json()
            group = {"trajectories": [trajectory(c, float(i % 3)) for i, c in enumerate(sampled["choices"])]}
            response = await http.post(
                "/art/models/tiny/train", json={"groups": [group], "config": {"learning_rate": 1e-3}}
            )
            assert response.status_code == 200 and '"step":1' in response.text.replace(" ", ""), response.text[-800:]
            assert len(head.trainer_ranks()) == 1 and len(worker.trainer_ranks()) == 1  # the step's two ranks
            assert [
                r["steps"]
                for r in await asyncio.to_thread(wait_fleet, head.node, lambda f: len(f) == 2, "both replicas")
            ] == [{"tiny": 1}, {"tiny": 1}]
            answers = await asyncio.gather(*(complete(http, f"after the step {i}") for i in range(16)))
            assert {a.json()["model"] for a in answers} == {"tiny@1"}

            load = await load_until_replica_busy(head.node, lambda i: complete(http, f"load {i}", max_tokens=24))
            worker.stop(signal.SIGKILL)  # the node is lost: nothing of it says goodbye
            responses = await asyncio.gather(*load)
            assert [r.status_code for r in responses] == [200] * len(load), [
                r.text for r in responses if r.status_code != 200
            ]
            assert [
                r["url"]
                for r in await asyncio.to_thread(
                    wait_fleet, head.node, lambda f: len(f) == 1, "the lost node's replica gone"
                )
            ] == ["local"]
    finally:
        if worker is not None:
            worker.stop()


async def test_a_workers_replica_that_is_killed_starts_again_and_its_node_stays(head):
    """Only the worker's replica dies (out of memory, say): the node's script starts it again, it joins the fleet
    again and serves the model's step, and the script itself never fails (on SkyPilot a node's task that fails ends
    every node's, the head's server with it)."""
    worker = SkyNode(head.home.parent, 1, head.server.port)
    try:
        _, before = await asyncio.to_thread(
            wait_fleet, head.node, lambda f: len(f) == 2 and f[1]["steps"] == f[0]["steps"], "the worker serving"
        )
        (replica,) = [p for p in psutil.Process(worker.process.pid).children() if "--join" in p.cmdline()]
        replica.kill()
        fleet = await asyncio.to_thread(
            wait_fleet,
            head.node,
            lambda f: len(f) == 2 and f[1]["pid"] != before["pid"] and f[1]["steps"] == before["steps"],
            "the worker's replica started again, joined and serving",
        )
        assert (fleet[1]["node"], fleet[1]["rank"]) == (before["node"], 1) and worker.process.poll() is None
        assert "replica was killed (exit 137): starting it again" in (head.home.parent / "run1.err").read_text()
    finally:
        worker.stop()
    assert worker.process.returncode == 0  # stopped: the task ends well, as SkyPilot's `down` leaves it


async def test_a_node_that_never_joins_has_the_cluster_torn_down(tmp_path, monkeypatch):
    """`up` of a two-node SkyPilot cluster waits for the second node's replica; one that does not join in time
    (a node lost on the way) tears the cluster down, the one thing here that stands in for the cloud."""
    from fleet_nodes import start_node

    from art_sky import SkyPilotBackend
    from art_sky.errors import BackendUnavailableError
    from art_sky.provisioners import sky as provisioner
    from art_sky.provisioners.sky_task import ClusterSpec
    from art_sky.settings import Settings

    torn_down = []

    async def down(name: str) -> None:
        torn_down.append(name)

    monkeypatch.setattr(provisioner, "down", down)
    head = start_node(tmp_path, "head")
    replica = None
    try:
        spec = ClusterSpec(gpu="H100:8", num_nodes=2, python=sys.executable)
        backend = SkyPilotBackend("big", spec, api_key=API_KEY, settings=Settings(server_start_timeout=3))
        backend.base_url, backend.api_key = head.url, API_KEY  # as `up` leaves them once the tunnel is up
        with pytest.raises(BackendUnavailableError, match="1 of its 2 nodes joined within 3 s.*torn down"):
            await backend.check_server()
        assert torn_down == ["big"]
        replica = start_node(tmp_path, "replica", join=head.url)
        backend.settings = Settings(server_start_timeout=120)
        assert [r.url for r in (await backend.check_server()).fleet][1:] == [replica.url] and torn_down == ["big"]
        await backend.close()
    finally:
        for node in (replica, head):
            if node is not None:
                node.stop()


async def test_node_lost_mid_step_the_loop_goes_on_with_the_head_within_30_s(head):
    """A replacement for the worker node lost above joins, and the trainer's ranks take it in (torchrun's elastic
    range). Then every process of it is SIGKILLed while a step trains on both nodes: the step rolls back, the
    client trains it again (same request id), and the ranks go on with the head alone instead of waiting
    ART_SKY_SERVER_START_TIMEOUT (600 s) for the lost node: the step is trained again within 30 s of the loss.
    The loop finishes its steps, each trained once."""
    import time

    import art_sky as art
    from art_sky.checkpoints import CheckpointDir

    worker = SkyNode(head.home.parent, 1, head.server.port)
    backend = art.Backend(base_url=head.url, api_key=API_KEY)
    try:
        model = art.TrainableModel(
            name="tiny", project="nodes", base_model="art-sky/tiny", config=art.ModelConfig(max_seq_length=512)
        )
        await model.register(backend)
        client = model.openai_client()
        prompt = [{"role": "user", "content": "hi"}]

        async def group(seed: int) -> art.TrajectoryGroup:
            sampled = await client.chat.completions.create(
                model=model.get_inference_name(), messages=prompt, n=6, max_tokens=24, temperature=1.0, seed=seed
            )
            return art.TrajectoryGroup(
                [
                    art.Trajectory(messages_and_choices=[*prompt, c], reward=float(i % 2))
                    for i, c in enumerate(sampled.choices)
                ]
            )

        start = await model.get_step()  # where the test above left it
        config = art.TrainConfig(learning_rate=1e-3)
        assert (await model.train([await group(1)], config=config))["step"] == start + 1
        assert len(worker.trainer_ranks()) == 1  # the step's ranks span both nodes again

        groups = [await group(seed) for seed in (2, 20, 21, 22)]  # a step long enough for a poll to see it train
        step = asyncio.ensure_future(model.train(groups, config=config))
        while (await backend.model_info(model)).activity.phase != "training":
            assert not step.done(), "the step ended before its worker node could be lost mid-step"
            await asyncio.sleep(0.05)
        node = psutil.Process(worker.process.pid)
        lost = [node, *node.children(recursive=True)]  # the replica server, torchrun, the ranks: the whole node
        lost_at = time.time()
        for process in lost:
            process.kill()
        assert (await step)["step"] == start + 2
        trained_again = time.time() - lost_at  # (a poll of the phase can miss a tiny model's short one)
        assert trained_again < 30, trained_again  # not 600 s
        assert (await model.train([await group(3)], config=config))["step"] == start + 3
        assert [r.url for r in (await backend.health()).fleet] == ["local"]
        await backend.flush_checkpoints()  # each step's files are written in the background: on disk now
        checkpoints = CheckpointDir(Path(head.layout.art_path), "nodes", "tiny")
        ids = [checkpoints.record(s).request_id for s in range(1, start + 4)]
        assert len(set(ids)) == start + 3  # each step trained once, from its own request
    finally:
        await backend.close()
        worker.stop(signal.SIGKILL)
