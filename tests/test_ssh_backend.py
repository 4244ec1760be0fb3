"""SSHBackend against a real sshd on this machine: bootstrap "remotely", chat and train through the tunnel,
survive a dropped SSH connection, and fail clearly on bad input."""

from __future__ import annotations

import asyncio
import re
import socket
import sys
from pathlib import Path

import httpx
import openai
import pytest
from sshd import art_sky_home, free_port, sshd  # noqa: F401 (fixtures)

import art_sky
from art_sky.errors import BackendUnavailableError, SSHError
from art_sky.remote.install import BootstrapOptions
from art_sky.remote.ssh import SSHRunner
from art_sky.settings import Settings
from art_sky.store import CheckpointStore

# A prepared interpreter with torch & co.: the tests' own (the venv tests/run.sh made), never the base one.
BASE_PYTHON = sys.executable
PROMPT = [{"role": "user", "content": "say hi"}]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def rollout(model: art_sky.TrainableModel, reward: float) -> art_sky.Trajectory:
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=PROMPT, max_tokens=8, temperature=1.0
    )
    assert completion.choices[0].logprobs is not None
    return art_sky.Trajectory(messages_and_choices=[*PROMPT, completion.choices[0]], reward=reward)


@pytest.mark.slow
async def test_bootstrap_chat_train_and_survive_a_dropped_connection(sshd, tmp_path, art_sky_home, capsys):
    remote_dir = tmp_path / "remote"
    # A fresh venv on the "host", which has no GPU: the CPU stack, with the CPU build of torch this machine has on
    # disk (pip's configuration here names it: no PyTorch index, which is out of reach).
    options = BootstrapOptions(remote_dir=str(remote_dir), venv_python=BASE_PYTHON, cpu_index=None)
    backend = art_sky.SSHBackend(
        f"{sshd.target().user}@127.0.0.1:{sshd.port}", key_path=sshd.client_key, options=options
    )
    model = art_sky.TrainableModel(name="agent", project="ssh", base_model="art-sky/tiny")
    try:
        await model.register(backend)
        assert_phases_in_order(
            capsys.readouterr().err,
            [
                f"connecting to {backend.where} ... ",
                f"Python {sys.version.split()[0]} at {BASE_PYTHON}",
                "building this client's wheel ... ",
                "uploading art_sky-",
                "stack: art-sky[cluster] with the CPU build of torch: no GPU (no nvidia-smi on its PATH)",
                f"creating the venv {remote_dir}/venv ... ",
                "installing art-sky[cluster] with the CPU build of torch ... ",
                " packages installed",
                "installing this build of art-sky ... ",
                f"starting the cluster server on {backend.where} ... ",
                "waiting until the server answers ... ",
                f"cluster server ready on {backend.where}, port {backend.server.port} there, in ",
                "loading the base model art-sky/tiny for agent ...",
                "agent ready at step 0: art-sky/tiny loaded in ",
            ],
        )
        assert backend.base_url == f"http://127.0.0.1:{backend.tunnel.local_port}"
        assert model.inference_base_url == f"{backend.base_url}/v1"  # one tunnel, inference included
        assert (await backend.health()).version == art_sky.__version__
        # The server runs the shipped wheel, installed in its own directory's lib/ (an unnamed backend's is
        # clusters/default), with the host's venv; it got its key by environment only.
        assert (remote_dir / "venv" / "bin" / "python").exists()
        assert (remote_dir / "clusters" / "default" / "lib" / "art_sky" / "cluster" / "server.py").exists()
        pid = backend.server.pid
        assert backend.api_key not in Path(f"/proc/{pid}/cmdline").read_text()
        assert f"ART_SKY_API_KEY={backend.api_key}" in Path(f"/proc/{pid}/environ").read_text().split("\0")

        group = art_sky.TrajectoryGroup([await rollout(model, 0.0), await rollout(model, 1.0)])
        metrics = await model.train([group])
        assert metrics["step"] == 1.0

        assert sshd.drop_connections() >= 1  # the tunnel's SSH connection dies mid-run
        assert await model.get_step() == 1  # retried until the tunnel is back
        assert backend.tunnel.reconnects >= 1
        await rollout(model, 0.5)  # chat completions go through the new connection too
        assert backend.server.pid == pid and alive(pid)  # the detached server never noticed

        # A drop during a completion stream: the client's stream ends with an error (never hangs, never looks
        # complete), and the next completion goes through the reconnected tunnel; training is untouched.
        outcome = await asyncio.wait_for(stream_through_a_drop(model, sshd), 120)
        assert outcome in ("error", "complete"), outcome
        await rollout(model, 0.5)
        assert await model.get_step() == 1

        group = art_sky.TrajectoryGroup([await rollout(model, 0.0), await rollout(model, 1.0)])
        call = asyncio.create_task(model.train([group]))
        await asyncio.sleep(0.3)
        sshd.drop_connections()  # during train(): the call is retried with its request id, trained once
        assert (await call)["step"] == 2.0
        assert await model.get_step() == 2
    finally:
        await backend.close()
    assert not alive(pid)
    assert not (remote_dir / "clusters" / "default" / "run" / "server.pid").exists()


def assert_phases_in_order(stderr: str, expected: list[str]) -> None:
    """Each of `expected` is in a timestamped line of `stderr`, in this order."""
    lines = iter(stderr.splitlines())
    for part in expected:
        assert any(part in line and re.match(r"\[\d\d:\d\d:\d\d\] ", line) for line in lines), (part, stderr)


async def stream_through_a_drop(model: art_sky.TrainableModel, sshd) -> str:
    """Stream a long completion, drop the SSH connections after its first chunk, read on: "error" when the stream
    raised (a truncated stream), "complete" when every choice had finished before the drop reached it."""
    stream = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=PROMPT, max_tokens=400, n=8, temperature=1.0, stream=True
    )
    finished: set[int] = set()
    dropped = False
    try:
        async for chunk in stream:
            if not dropped:
                dropped = sshd.drop_connections() >= 1  # right after the first chunk arrived
            finished |= {choice.index for choice in chunk.choices if choice.finish_reason}
    except (openai.APIError, httpx.HTTPError) as exc:
        assert not isinstance(exc, openai.APIStatusError), exc  # a lost connection, not a server error
        return "error"
    assert finished == set(range(8)), f"the stream ended quietly with choices {sorted(finished)} finished"
    return "complete"


@pytest.fixture
def prepared(tmp_path) -> BootstrapOptions:
    """A host with a prepared Python environment: only the wheel is installed, --no-deps."""
    return BootstrapOptions(remote_dir=str(tmp_path / "remote"), python=BASE_PYTHON)


async def test_unreachable_host(sshd, prepared, art_sky_home):
    backend = art_sky.SSHBackend(sshd.target().model_copy(update={"port": free_port()}), options=prepared)
    with pytest.raises(SSHError, match="cannot reach"):
        await backend.health()


async def test_wrong_key(sshd, prepared, art_sky_home):
    backend = art_sky.SSHBackend(sshd.target(key=sshd.other_key), options=prepared)
    with pytest.raises(SSHError, match="refused the login"):
        await backend.health()


@pytest.mark.parametrize("field", ["python", "venv_python"])
async def test_host_without_python(sshd, prepared, art_sky_home, field):
    options = prepared.model_copy(update={"python": None, field: "/nonexistent/bin/python3"})
    backend = art_sky.SSHBackend(sshd.target(), options=options)
    with pytest.raises(SSHError, match="no Python >= 3.11 at '/nonexistent/bin/python3'"):
        await backend.health()


@pytest.mark.slow
async def test_remote_port_already_in_use(sshd, prepared, art_sky_home):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        backend = art_sky.SSHBackend(sshd.target(), options=prepared.model_copy(update={"port": port}))
        with pytest.raises(
            BackendUnavailableError,
            match=rf"exited before it was listening(.|\n)*cannot bind "
            rf"127.0.0.1:{port}",
        ):
            await backend.health()


async def test_server_that_never_gets_healthy(sshd, prepared, tmp_path, art_sky_home, monkeypatch):
    """The error names the timeout and carries the server log's last lines; the stuck server is stopped."""
    pid_file = tmp_path / "stuck.pid"
    fake = tmp_path / "python"
    # A server that never listens: it starts detached as `python -m art_sky.cluster --detach --run-dir D` does
    # (its pid in D/server.pid, its output in D/server.log), then only loads weights.
    fake.write_text(f"""#!/bin/sh
case "$*" in
  *art_sky.cluster*)
    while [ $# -gt 0 ]; do [ "$1" = --run-dir ] && run="$2"; shift; done
    mkdir -p "$run"
    setsid sh -c 'echo "loading weights, slowly"; exec sleep 600' >"$run/server.log" 2>&1 </dev/null &
    echo $! >"$run/server.pid"; echo $! >{pid_file}; exit 0;;
esac
exec {BASE_PYTHON} "$@"
""")
    fake.chmod(0o755)
    monkeypatch.setenv("ART_SKY_SERVER_START_TIMEOUT", "3")
    backend = art_sky.SSHBackend(sshd.target(), options=prepared.model_copy(update={"python": str(fake)}))
    with pytest.raises(BackendUnavailableError, match=r"not healthy within 3s(.|\n)*loading weights, slowly"):
        await backend.health()
    assert not alive(int(pid_file.read_text()))


async def test_logs_and_stop_reach_the_remote_server(sshd, prepared, art_sky_home):
    """keep_server leaves the server running after close(); stop_server() ends it."""
    backend = art_sky.SSHBackend(sshd.target(), options=prepared, keep_server=True)
    await backend.health()
    pid, pid_file = backend.server.pid, backend.server.layout.pid_file
    assert pid_file == f"{prepared.remote_dir}/clusters/default/run/server.pid"
    assert "listening on 127.0.0.1" in await backend.logs()
    await backend.close()
    assert alive(pid)
    assert await backend.stop_server()
    assert not alive(pid)
    with SSHRunner(sshd.target(), Settings()) as session:
        assert session.run(f"test -e {pid_file}", timeout=10, check=False).exit_code == 1


@pytest.mark.slow
async def test_checkpoints_survive_a_lost_host(sshd, prepared, tmp_path, art_sky_home, monkeypatch):
    """Train on one "host" whose store is configured only in the working directory's .env, lose the host's whole
    directory, resume on a fresh one from the object store at the same step."""
    import shutil

    from loop import rollout_and_train

    store = f"file://{tmp_path / 'store'}"
    target = f"{sshd.target().user}@127.0.0.1:{sshd.port}"
    project = tmp_path / "project"
    project.mkdir()
    (project / ".env").write_text(f"ART_SKY_CHECKPOINT_URI={store}\n")
    monkeypatch.delenv("ART_SKY_CHECKPOINT_URI", raising=False)
    monkeypatch.chdir(project)
    first = art_sky.SSHBackend(target, key_path=sshd.client_key, options=prepared)
    try:
        model = await rollout_and_train(first, project="lost-host")
    finally:
        await first.close()  # waits until step 1 is in the store, then stops the server
    assert [m.step for m in await CheckpointStore(store).manifests("lost-host", "agent")] == [0, 1]
    shutil.rmtree(prepared.remote_dir)
    fresh = prepared.model_copy(update={"remote_dir": str(tmp_path / "new-host")})
    second = art_sky.SSHBackend(target, key_path=sshd.client_key, options=fresh, checkpoint_uri=store)
    try:
        await model.register(second)
        assert await model.get_step() == 1
        assert (await second.model_info(model)).restored_from.startswith(store)
    finally:
        await second.close()
