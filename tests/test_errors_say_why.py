"""Every error says why (issue 37, item 4): each mistake a new user made ends in the reason the server or the remote
step wrote (not "its log says why"), then where the full log is while it exists; art-sky's own errors go to stderr
with exit code 1. Real processes throughout: the real server via `art-sky up --local` and the local runner, the
test sshd for a remote host, the CLI as a child process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from processes import python_command
from sshd import art_sky_home, sshd  # noqa: F401 (fixtures)

import art_sky
from art_sky.errors import BackendUnavailableError, SSHError
from art_sky.layout import ServerLayout
from art_sky.remote import lifecycle
from art_sky.remote.install import BootstrapOptions
from art_sky.remote.runner import READ_ENV, LocalRunner, env_stdin
from art_sky.remote.ssh import SSHRunner
from art_sky.settings import Settings

BASE_PYTHON = sys.executable  # a prepared interpreter: the tests' own
SYSTEM_PYTHON = "/usr/bin/python3"  # a Python without art-sky (Debian's, with pip and venv)


def cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`art-sky ARGS` as a user runs it: its own process, stdout and stderr apart."""
    return subprocess.run(
        python_command("-m", "art_sky.cli", *args),
        cwd=cwd,
        env=os.environ | (env or {}),
        capture_output=True,
        text=True,
        timeout=300,
    )


def error_lines(done: subprocess.CompletedProcess) -> list[str]:
    """stderr's lines from its `error:` line on (the phases shown until then come first), once the run is seen to
    fail with exit code 1 and no error on stdout."""
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "error:" not in done.stdout, done.stdout
    lines = done.stderr.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("error:")]
    assert starts, done.stderr
    return lines[starts[0] :]


@pytest.mark.slow
def test_a_port_already_taken_says_so(tmp_path, art_sky_home):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = cli("up", "busy", "--local", "--port", str(port), cwd=tmp_path)
    log = tmp_path / ".art" / "run" / "busy" / "server.log"
    first, *rest = error_lines(done)
    assert first == (
        "error: the cluster server on this machine exited before it was listening: cannot bind "
        f"127.0.0.1:{port}: [Errno 98] Address already in use. Pick another --port or stop what uses it. "
        f"Its log: {log}"
    )
    assert log.is_file() and rest[-1].endswith("more lines of detail: `art-sky --verbose ...` shows them)")


def test_an_out_of_range_port_is_refused_by_the_server_with_its_reason(tmp_path):
    """The CLI and the backends refuse it first (tests/test_cli_conventions.py); the server's own refusal, before
    it detaches, is still said as the server wrote it."""
    layout = ServerLayout(run_dir=str(tmp_path / "run"), art_path=str(tmp_path / "art"))
    with pytest.raises(BackendUnavailableError) as error:
        lifecycle.start(LocalRunner(), layout, python=BASE_PYTHON, env={"ART_SKY_API_KEY": "k"}, port=70000)
    assert str(error.value).splitlines()[0] == (
        "the cluster server on this machine did not start: --port 70000 is not a TCP port: give 1 to 65535, or 0 "
        "for a free one"
    )


def test_an_unknown_engine_here_names_the_variable(tmp_path, art_sky_home):
    done = cli("up", "eng", "--local", cwd=tmp_path, env={"ART_SKY_ENGINE": "vlm"})
    assert error_lines(done) == [
        "error: ART_SKY_ENGINE=vlm (in the environment) is not a valid setting: use one of auto, vllm, portable "
        "(did you mean vllm?)"
    ]


@pytest.mark.slow
async def test_an_unknown_engine_on_a_host_is_said_as_the_server_said_it(sshd, tmp_path, art_sky_home):
    """Set only in the server's environment (BootstrapOptions.env), the server refuses it: that reason, verbatim."""
    options = BootstrapOptions(remote_dir=str(tmp_path / "remote"), python=BASE_PYTHON, env={"ART_SKY_ENGINE": "vlm"})
    backend = art_sky.SSHBackend(sshd.target(), options=options)
    with pytest.raises(BackendUnavailableError) as error:
        await backend.health()
    assert str(error.value).splitlines()[0] == (
        f"the cluster server on {sshd.target()} did not start: ART_SKY_ENGINE=vlm (in the environment) is not a "
        "valid setting: use one of auto, vllm, portable (did you mean vllm?)"
    )


@pytest.fixture(params=["local", "ssh"])
def runner(request, tmp_path):
    if request.param == "local":
        yield LocalRunner(), "here", BackendUnavailableError
    else:
        host = request.getfixturevalue("sshd")
        with SSHRunner(host.target(), Settings()) as ssh:
            yield ssh, f"on {host.target()}", SSHError


def test_a_failing_step_names_its_command_and_reason(runner, tmp_path):
    """Not `set -e ...`: the command that failed, what it wrote, and no secret from stdin on the way."""
    run, where, error = runner
    script = f"set -e\ncd {tmp_path}\n{READ_ENV}mkdir -p made\nls no-such-file\necho never"
    with pytest.raises(error) as failed:
        run.run(script, timeout=60, stdin=env_stdin({"TOKEN": "s3cret-value"}))
    message = str(failed.value)
    assert message.splitlines()[0] == (
        f"`ls no-such-file` failed {where} with exit code 2: ls: cannot access 'no-such-file': No such file or "
        "directory"
    )
    assert "s3cret-value" not in message and "never" not in message
    # A command that succeeds: its stderr is its own, without the trace the failure is found from
    done = run.run(f"{READ_ENV}echo out; echo err >&2", timeout=60, stdin=env_stdin({"TOKEN": "s3cret-value"}))
    assert (done.exit_code, done.stdout, done.stderr) == (0, "out\n", "err\n")


@pytest.mark.slow
def test_a_python_without_art_sky_on_a_host_is_no_bug(sshd, tmp_path, art_sky_home):
    target = sshd.target()
    done = cli(
        "up", "bare", "--host", f"{target.user}@127.0.0.1:{sshd.port}", "--key", str(sshd.client_key),
        "--python", SYSTEM_PYTHON, "--remote-dir", str(tmp_path / "remote"),
        cwd=tmp_path,
    )  # fmt: skip
    first = error_lines(done)[0]
    assert first.startswith(f"error: the cluster server on {target} did not start: ModuleNotFoundError: No module ")
    assert first.endswith(
        ": the server's Python lacks art-sky or its dependencies: name one with art-sky[cluster] installed "
        "(python=, `--python`), or leave it unset for art-sky's own environment"
    )
    assert "bug" not in done.stderr


@pytest.mark.parametrize(
    ("python", "why"),
    [
        ("/no/such/python", "cannot run (No such file or directory)"),
        (SYSTEM_PYTHON, "cannot import SkyPilot (ModuleNotFoundError: No module named 'sky')"),
    ],
)
def test_a_mistyped_skypilot_python_is_no_bug(python, why, tmp_path, art_sky_home):
    done = cli("up", "sky1", "--gpu", "H100:1", "--yes", cwd=tmp_path, env={"ART_SKY_SKYPILOT_PYTHON": python})
    assert error_lines(done) == [
        f"error: ART_SKY_SKYPILOT_PYTHON={python} {why}: point ART_SKY_SKYPILOT_PYTHON at a Python that has "
        "skypilot[slurm]==0.14.1, or unset it for art-sky's own"
    ]
    assert done.stdout == ""


async def test_a_failed_start_keeps_the_log_its_error_names(tmp_path, art_sky_home):
    """An unnamed LocalBackend removes its run directory on close(), but not the one whose log a failure named."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        backend = art_sky.LocalBackend(path=tmp_path / ".art", port=busy.getsockname()[1])
        with pytest.raises(BackendUnavailableError) as error:
            await backend.health()
        await backend.close()
    log = Path(str(error.value).splitlines()[0].rpartition("Its log: ")[2])
    assert log == backend.log_path and "cannot bind" in log.read_text()


def test_a_server_gone_with_its_files_names_no_log(tmp_path):
    """A run directory removed under a server (its cluster folder deleted): no log is named that is not there."""
    layout = ServerLayout(run_dir=str(tmp_path / "gone"), art_path=str(tmp_path / "art"))
    with pytest.raises(BackendUnavailableError) as error:
        lifecycle.wait_ready(LocalRunner(), layout, timeout=5, reach=lambda port: "", stop_on_timeout=False)
    assert str(error.value).splitlines()[0] == (
        "the cluster server on this machine exited before it was listening: it left no log"
    )
