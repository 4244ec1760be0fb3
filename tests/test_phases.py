"""A bootstrap you can watch, and the stack that fits the machine: the phase reporter's lines, the runners' output
callback (streamed as it arrives), pip's output read for its downloads, and the stack chosen from the box's
`nvidia-smi`. The box is the test sshd on 127.0.0.1; its `nvidia-smi` is a script on the PATH sshd gives the
session (`SetEnv`), the one stand-in here: there is no GPU on this machine."""

from __future__ import annotations

import io
import re
import sys
import time
from pathlib import Path

import pytest
from sshd import Sshd, art_sky_home, sshd  # noqa: F401 (fixtures)
from typer.testing import CliRunner

from art_sky import gpu_stack
from art_sky.cli import app
from art_sky.errors import ConfigError
from art_sky.remote.progress import PipOutput, Progress
from art_sky.remote.runner import LocalRunner
from art_sky.remote.ssh import SSHRunner
from art_sky.remote.stack import CPU_TORCH_INDEX, choose, probe
from art_sky.settings import Settings

TORCH = gpu_stack.tested_versions()["torch"]
H100 = "NVIDIA H100 80GB HBM3, 580.159.04"
A10_OLD = "NVIDIA A10, 535.104.05"
CLOCK = r"\[\d\d:\d\d:\d\d\]"


def test_plain_lines_say_each_phase_with_its_time_and_the_total():
    out = io.StringIO()
    progress = Progress(stream=out, live=False)
    progress.begin()
    with progress.phase("connecting to box"):
        time.sleep(0.05)
    progress.note("Python 3.11.7 at python3")
    with pytest.raises(RuntimeError), progress.phase("installing art-sky[cluster]"):
        raise RuntimeError("pip failed")
    progress.ready("cluster server ready on box,")
    lines = out.getvalue().splitlines()
    assert re.fullmatch(rf"{CLOCK} connecting to box \.\.\. 0\.\ds", lines[0]), lines
    assert re.fullmatch(rf"{CLOCK} Python 3\.11\.7 at python3", lines[1]), lines
    assert re.fullmatch(rf"{CLOCK} installing art-sky\[cluster\] \.\.\. failed after 0\.\ds", lines[2]), lines
    assert re.fullmatch(rf"{CLOCK} cluster server ready on box, in 0\.\ds", lines[3]), lines


def test_verbose_shows_the_commands_own_output_between_the_phase_lines():
    out = io.StringIO()
    progress = Progress(stream=out, live=False, verbose=True)
    with progress.phase("installing") as phase:
        LocalRunner().run("echo one; echo two >&2", timeout=30, output=phase.output())
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("installing ...") and sorted(lines[1:3]) == ["  one", "  two"], lines
    assert re.fullmatch(rf"{CLOCK} installing \.\.\. \d+\.\ds", lines[3]), lines


def test_the_live_line_on_a_terminal_leaves_one_line_per_phase():
    out = io.StringIO()
    progress = Progress(stream=out, live=True)
    with progress.phase("creating the venv") as phase:
        phase.detail("collecting torch")
    assert "✓ creating the venv" in out.getvalue() and re.search(r"\d\.\ds", out.getvalue())


def streamed_as_it_runs(runner) -> list[tuple[float, str]]:
    """(seconds since the start, text) of each piece `output` got from a command that pauses between lines."""
    start, seen = time.monotonic(), []
    result = runner.run(
        "echo first; sleep 1.5; echo second >&2",
        timeout=30,
        output=lambda text: seen.append((time.monotonic() - start, text)),
    )
    assert result.stdout == "first\n" and result.stderr == "second\n"  # kept as without a callback
    return seen


def test_the_local_runner_streams_output_as_it_arrives():
    seen = streamed_as_it_runs(LocalRunner())
    assert seen[0][1] == "first\n" and seen[0][0] < 1.0, seen  # before the command ended
    assert "".join(text for _, text in seen) == "first\nsecond\n"


def test_the_ssh_runner_streams_output_as_it_arrives(sshd, art_sky_home):
    with SSHRunner(sshd.target(), Settings()) as runner:
        seen = streamed_as_it_runs(runner)
    assert seen[0][1] == "first\n" and seen[0][0] < 1.0, seen
    assert "".join(text for _, text in seen) == "first\nsecond\n"


def test_pips_output_gives_the_package_at_work_and_the_largest_downloads(tmp_path):
    """Real pip output, not quiet, into a fresh venv: what it fetched and installed is read from it."""
    LocalRunner().run(f"{sys.executable} -m venv {tmp_path}/venv", timeout=120)
    pip, details = PipOutput(), []
    with Progress(enabled=False).phase("installing six") as phase:
        LocalRunner().run(
            f"{tmp_path}/venv/bin/python -m pip install --progress-bar off --no-cache-dir six",
            timeout=300,
            output=phase.output(lambda line: details.append(pip.line(line))),
        )
    assert "processing six-1.17.0-py2.py3-none-any.whl" in details or "collecting six" in details, details
    assert pip.installed == 1 and pip.summary().startswith("1 package installed"), pip.summary()
    lines = [
        "Collecting torch==2.13.0",
        "  Downloading torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl (906.4 MB)",
        "  Downloading https://files.example/nvidia_cublas-13.1.1.3-py3-none-manylinux_2_27_x86_64.whl (540.2 MB)",
        "Using cached triton-3.5.0-cp312-cp312-manylinux_2_27_x86_64.whl (150.0 MB)",
        "Downloading six-1.17.0-py2.py3-none-any.whl (11 kB)",
        "Successfully installed nvidia-cublas-13.1.1.3 six-1.17.0 torch-2.13.0 triton-3.5.0",
    ]
    pip = PipOutput()
    assert [pip.line(line) for line in lines][:3] == [
        "collecting torch==2.13.0",
        "downloading torch (906.4 MB)",
        "downloading nvidia-cublas (540.2 MB)",
    ]
    assert pip.summary() == (
        "4 packages installed; 1.4 GB downloaded, the largest torch 906.4 MB, nvidia-cublas 540.2 MB, six 11.0 kB; "
        "150.0 MB from pip's cache"
    )


# -- the stack that fits the box -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_box(tmp_path_factory):
    """A second test sshd whose sessions find `fakebin/` first on PATH: `nvidia_smi(...)` writes the box's
    nvidia-smi there (none: no GPU)."""
    root = tmp_path_factory.mktemp("gpu-box")
    box = Sshd(root)
    (root / "fakebin").mkdir()
    with open(box.config, "a") as config:
        config.write(f"SetEnv PATH={root / 'fakebin'}:/usr/local/bin:/usr/bin:/bin\n")
    box.start()
    yield box
    box.stop()


def nvidia_smi(box: Sshd, gpus: str | None, cuda: str = "13.0", fails: bool = False) -> None:
    """The box's nvidia-smi: the query prints `gpus`, the plain call a header with `cuda`; None: there is none."""
    path = box.root / "fakebin" / "nvidia-smi"
    path.unlink(missing_ok=True)
    if gpus is None:
        return
    if fails:
        body = 'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."; exit 9'
    else:
        header = f"| NVIDIA-SMI 580.159.04   Driver Version: {gpus.split(', ')[-1]}   CUDA Version: {cuda}     |"
        body = f'case "$1" in --query-gpu=*) echo "{gpus}";; *) echo "{header}";; esac'
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def stack_of(box: Sshd, asked: str = "auto", constraints: list[str] | None = None):
    with SSHRunner(box.target(), Settings()) as runner:
        return choose(
            probe(runner),
            asked,
            where=runner.where,
            python="3.11",
            cpu_index=CPU_TORCH_INDEX,
            constraints=constraints or [],
        )


def test_no_gpu_gets_the_cpu_stack(gpu_box, art_sky_home):
    nvidia_smi(gpu_box, None)
    stack = stack_of(gpu_box)
    assert (stack.extras, stack.constraints, stack.index_urls) == ("cluster", [f"torch=={TORCH}"], [CPU_TORCH_INDEX])
    assert stack.label == "art-sky[cluster] with the CPU build of torch"
    assert stack.reason == "no GPU (no nvidia-smi on its PATH): the CPU stack, the portable engine"
    assert stack_of(gpu_box, constraints=["torch==2.12.0"]).constraints == []  # the user's own torch pin wins


def test_a_failing_nvidia_smi_is_no_gpu(gpu_box, art_sky_home):
    nvidia_smi(gpu_box, H100, fails=True)
    stack = stack_of(gpu_box)
    assert stack.extras == "cluster" and stack.reason == (
        "no GPU (nvidia-smi failed: NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.): "
        "the CPU stack, the portable engine"
    )


def test_a_gpu_with_a_new_driver_gets_the_gpu_stack(gpu_box, art_sky_home):
    nvidia_smi(gpu_box, f"{H100}\n{H100}")
    stack = stack_of(gpu_box)
    assert (stack.extras, stack.constraints, stack.index_urls) == ("gpu", [], [])
    assert stack.reason == "2 x NVIDIA H100 80GB HBM3, driver 580.159.04, CUDA 13.0: the tested GPU stack"
    assert stack_of(gpu_box, "cluster").extras == "cluster"  # a named extra is kept


def test_a_driver_too_old_for_the_stacks_cuda_is_refused_with_both_versions(gpu_box, art_sky_home):
    nvidia_smi(gpu_box, A10_OLD, cuda="12.2")
    message = (
        f"the NVIDIA driver on {gpu_box.target()} is 535.104.05 (CUDA 12.2 at most); art-sky's GPU stack (torch "
        f"{TORCH}) is built for CUDA 13.0, which needs driver 580.65 or newer: update the driver (your distribution's "
        "NVIDIA packages, or an image that has it), or install the CPU stack with --extras cluster"
    )
    for asked in ("auto", "gpu"):
        with pytest.raises(ConfigError) as refused:
            stack_of(gpu_box, asked)
        assert str(refused.value) == message
    assert stack_of(gpu_box, "cluster").extras == "cluster"  # what the message offers works


@pytest.mark.slow
def test_up_refuses_an_old_driver_before_making_the_venv(gpu_box, art_sky_home, tmp_path, monkeypatch):
    monkeypatch.setattr("art_sky.cli.errors.errors.width", 400)
    nvidia_smi(gpu_box, A10_OLD, cuda="12.2")
    remote = tmp_path / "remote"
    host = f"{gpu_box.target().user}@127.0.0.1:{gpu_box.port}"
    up = ["up", "old", "--host", host, "--key", str(gpu_box.client_key), "--venv-python", sys.executable]
    result = CliRunner().invoke(app, [*up, "--remote-dir", str(remote)])
    assert result.exit_code == 1, result.output
    assert (
        f"error: the NVIDIA driver on {host} is 535.104.05 (CUDA 12.2 at most); art-sky's GPU stack (torch {TORCH}) is "
        "built for CUDA 13.0, which needs driver 580.65 or newer" in result.stderr
    ), result.stderr
    phases = [re.sub(rf"^{CLOCK} ", "", line) for line in result.stderr.splitlines() if re.match(CLOCK, line)]
    assert [p.split(" ...")[0] for p in phases][:4] == [
        f"connecting to {host}",
        f"Python {sys.version.split()[0]} at {sys.executable}",
        "building this client's wheel",
        phases[3].split(" ...")[0],  # uploading the wheel (its name and size)
    ]
    assert phases[3].startswith("uploading art_sky-") and not (remote / "venv").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--local", "--gpu", "H100:1"],
            "error: --gpu does not apply to --local: it is for a SkyPilot cluster (this machine's own GPUs are used as "
            "they are); drop it",
        ),
        (
            ["--host", "me@box", "--gpu", "H100:1", "--spot"],
            "error: --gpu, --spot do not apply to --host: they are for a SkyPilot cluster (the host's own GPUs are "
            "used as they are); drop them",
        ),
        (["--local", "--extras", "gpu"], "error: --extras does not apply to --local: it is for --host; drop it"),
        (["--python", "python3"], "error: --python does not apply to a SkyPilot cluster: it is for --host; drop it"),
    ],
)
def test_flags_that_do_not_apply_to_the_target_are_an_error(flags, message, art_sky_home, monkeypatch):
    monkeypatch.setattr("art_sky.cli.errors.errors.width", 400)
    result = CliRunner().invoke(app, ["up", *flags])
    assert result.exit_code == 1 and result.stderr.strip() == message, result.stderr
    assert not Path(art_sky_home / "clusters").exists()  # nothing started, nothing recorded


def test_making_skypilots_environment_shows_its_phases(tmp_path, monkeypatch):
    """The first SkyPilot use makes its environment: the same phase lines (the package swapped for a small one)."""
    from art_sky.provisioners import sky_env

    monkeypatch.setattr(sky_env, "SKYPILOT", "six")
    out = io.StringIO()
    settings = Settings(cache_dir=tmp_path / "cache", skypilot_python=None)
    python = sky_env.sky_python(settings, Progress(stream=out, live=False))
    assert python == tmp_path / "cache" / "skypilot" / "bin" / "python" and python.exists()
    lines = [re.sub(rf"^{CLOCK} ", "", line) for line in out.getvalue().splitlines()]
    venv = tmp_path / "cache" / "skypilot"
    assert lines[0] == f"SkyPilot's own environment {venv} is made once (a few minutes): six"
    assert re.fullmatch(rf"creating the venv {re.escape(str(venv))} \.\.\. \d+\.\ds", lines[1]), lines
    assert re.fullmatch(r"installing six \.\.\. \d+\.\ds", lines[2]), lines
    assert lines[3].startswith("1 package installed"), lines
    out.truncate(0)
    assert sky_env.sky_python(settings, Progress(stream=out, live=False)) == python and out.getvalue() == ""  # made
