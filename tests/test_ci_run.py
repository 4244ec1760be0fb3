"""`art-sky ci run` as CI runs it (a subprocess), against a real sshd (`--host`) and real SkyPilot clusters on the
local Slurm (tests/slurm_harness.py). Every test checks that nothing is left: no process, no work dir, no cluster.

The five teardown paths (success, failure, timeout, SIGINT, SIGTERM) run on the SSH host (seconds each); SkyPilot
gets success and failure as two jobs in parallel, and SIGTERM (each launch costs about a minute here).
"""

from __future__ import annotations

import asyncio
import os
import queue
import re
import secrets
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml
from processes import python_command
from sshd import art_sky_home, sshd  # noqa: F401 (fixtures)

from art_sky.ci.job import EXIT_MARKER, START_MARKER
from art_sky.ci.workdir import files_to_sync
from art_sky.cli.ci import ci_spec, parse_duration
from art_sky.errors import ConfigError
from art_sky.provisioners import sky as provisioner

LIMIT = 420  # seconds any one `art-sky ci run` may take before the test fails instead of hanging
TEMPLATES = Path(__file__).resolve().parent.parent / "templates"


class Job:
    """One `art-sky ci run` subprocess; its output lines with the time each arrived, read in a thread."""

    def __init__(self, args: list[str], workdir: Path, env: dict[str, str] | None = None):
        self.process = subprocess.Popen(
            python_command("-m", "art_sky.cli", "ci", "run", *args),
            cwd=workdir,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=os.environ | (env or {}) | {"PYTHONUNBUFFERED": "1"},
        )
        self.lines: list[tuple[float, str]] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, text: str, timeout: float = LIMIT) -> float:
        """Block until a line containing `text` arrives; the time it arrived."""
        deadline = time.monotonic() + timeout
        while True:
            for at, line in self.lines:
                if text in line:
                    return at
            try:
                if self._queue.get(timeout=max(0.1, deadline - time.monotonic())) is None and not any(
                    text in line for _, line in self.lines
                ):
                    pytest.fail(f"the job ended without printing {text!r}:\n{self.text}")
            except queue.Empty:
                pytest.fail(f"no {text!r} within {timeout}s:\n{self.text}")

    def finish(self, timeout: float = LIMIT) -> int:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            pytest.fail(f"art-sky ci run did not end within {timeout}s:\n{self.text}")
        deadline = time.monotonic() + 10
        while not self.lines or "cost" not in self.lines[-1][1]:  # the reader thread drains the pipe
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return code

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    @property
    def name(self) -> str:
        match = re.search(r"art-sky ci: job (\S+) on", self.text)
        assert match, self.text
        return match.group(1)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture
def project(tmp_path) -> Path:
    """A git work dir with an ignored file and a secret in a .env that is not synced."""
    root = tmp_path / "project"
    root.mkdir()
    (root / "test_me.py").write_text("print('tested')\n")
    (root / ".gitignore").write_text("ignored.bin\n.env\n")
    (root / "ignored.bin").write_text("not shipped\n")
    (root / ".env").write_text("CI_SECRET=s3cr3t-value\n")
    subprocess.run(["git", "init", "-q"], cwd=root, check=True, timeout=30)
    return root


# ---- the work dir, the duration, the templates: no machine needed ----------------------------------------------


def test_the_work_dir_honours_gitignore_then_skyignore(project):
    assert files_to_sync(project) == [".gitignore", "test_me.py"]
    (project / "build").mkdir()
    (project / "build" / "out.o").write_text("x")
    (project / ".skyignore").write_text("# SkyPilot uses this instead of .gitignore\n/build\n*.py\n")
    synced = files_to_sync(project)
    assert [f for f in synced if not f.startswith(".git/")] == [".env", ".gitignore", ".skyignore", "ignored.bin"]
    assert ".git/HEAD" in synced  # SkyPilot's own sync with a .skyignore ships .git too


def test_durations():
    assert [parse_duration(t) for t in ("45m", "1h30m", "90s", "600", "2h")] == [2700, 5400, 90, 600, 7200]
    for bad in ("", "soon", "5 minutes"):
        with pytest.raises(ConfigError, match="write it like 45m"):
            parse_duration(bad)
    with pytest.raises(ConfigError, match="must be positive"):
        parse_duration("0m")


def test_the_ci_template_marks_start_and_exit_as_the_runner_reads_them(tmp_path):
    from art_sky.provisioners.sky_task import CIJobSpec, render_ci_task, validate_task

    text = (TEMPLATES / "ci-job.yaml").read_text()
    assert START_MARKER in text and EXIT_MARKER.strip() in text
    spec = CIJobSpec(
        command="pytest -x",
        setup="pip install -e .",
        workdir=TEMPLATES,
        timeout_s=600,
        gpu=["H100", "A100-80GB"],
        spot=True,
        autodown_minutes=5,
        secrets={"HF_TOKEN": "hf-secret"},
    )
    config = validate_task(render_ci_task(spec, tmp_path / "secrets.env"))
    task = provisioner.validate(config)  # what SkyPilot made of it
    assert [list(r["accelerators"]) for r in task["resources"]] == [["H100"], ["A100-80GB"]]
    assert all(
        r["use_spot"] and r["autostop"] == {"enabled": True, "idle_minutes": 5, "down": True} for r in task["resources"]
    )
    assert task["envs"]["ART_SKY_CI_COMMAND"] == "pytest -x" and task["envs"]["ART_SKY_CI_TIMEOUT"] == "600"
    assert config["workdir"] == str(TEMPLATES) and "hf-secret" not in str(config) + task["stored"]
    # --env-file's variables: a 0600 file outside the synced workdir, sourced by setup and run, not task secrets
    assert task["secrets"] == [] and task["file_mounts"] == {"~/.art-sky-ci/secrets.env": str(tmp_path / "secrets.env")}
    assert (tmp_path / "secrets.env").read_text() == "HF_TOKEN=hf-secret\n"
    assert (tmp_path / "secrets.env").stat().st_mode & 0o777 == 0o600
    sourced = "set -a; . ~/.art-sky-ci/secrets.env; set +a"
    assert sourced in config["setup"] and sourced in config["run"]


def test_gpu_none_runs_on_cpus(project, tmp_path):
    """`--gpu none` is no accelerator (as for `art-sky up`), not an accelerator named "none"."""
    from art_sky.provisioners.sky_task import render_ci_task

    options = dict(
        spot=False, timeout_s=60, workdir=project, env={}, setup="", infra=None, cpus="2", memory=None, autodown=True
    )
    for gpu in ("none", "None", None):
        spec = ci_spec("true", gpu=gpu, **options)
        assert spec.gpu is None
        resources = render_ci_task(spec, tmp_path / "secrets.env")["resources"]
        assert "accelerators" not in resources and "ordered" not in resources and resources["cpus"] == "2"
    assert ci_spec("true", gpu="H100,A100-80GB", **options).gpu == ["H100", "A100-80GB"]
    with pytest.raises(ConfigError, match="`none` alone"):
        ci_spec("true", gpu="H100,none", **options)


def test_the_github_workflow_is_valid_yaml_and_runs_art_sky_ci():
    workflow = yaml.safe_load((TEMPLATES / "github-actions-gpu.yml").read_text())
    on = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` key as True
    assert "pull_request" in on and "labeled" in on["pull_request"]["types"]
    (job,) = workflow["jobs"].values()
    assert "label" in job["if"] and job["timeout-minutes"] > 0
    steps = "\n".join(s.get("run", "") for s in job["steps"])
    assert "pip install" in steps and "art-sky ci run" in steps
    assert any("secrets." in str(s.get("env", "")) for s in job["steps"])


# ---- an SSH host: the five teardown paths ----------------------------------------------------------------------


def host_args(sshd) -> list[str]:
    return ["--host", f"{sshd.target().user}@127.0.0.1:{sshd.port}", "--key", str(sshd.client_key)]


def assert_host_clean(job: Job, token: str) -> None:
    """No process of the job on the host, and its work dir is gone."""
    assert not subprocess.run(["pgrep", "-f", token], capture_output=True).stdout, f"{token} still runs"
    assert not (Path.home() / ".art-sky" / "ci" / job.name).exists()
    assert f"{job.name} torn down" in job.text


@pytest.mark.parametrize("code", [0, 7])
def test_host_exit_code_propagates_and_output_streams_while_it_runs(sshd, art_sky_home, project, code):
    token = f"tok-{secrets.token_hex(4)}"
    command = (
        f'echo first; sleep 4 # {token}\necho second; ls -A; test -n "$CI_SECRET" && echo secret-seen; exit {code}'
    )
    job = Job(
        [*host_args(sshd), "--env-file", ".env", "--setup", "echo installing", "--", command],
        project,
        {"ART_SKY_HOME": str(art_sky_home)},
    )
    try:
        job.wait_for("] first", timeout=60)
        assert job.process.poll() is None and "second" not in job.text  # streamed, not printed at the end
        assert job.finish() == code
    finally:
        job.kill()
    first, second = job.wait_for("] first"), job.wait_for("] second")
    assert second - first > 2  # each line arrived when it was printed
    assert re.search(r"^\[\d\d:\d\d:\d\d\] installing$", job.text, re.M)
    assert "test_me.py" in job.text and "ignored.bin" not in job.text and "secret-seen" in job.text
    assert "s3cr3t-value" not in job.text
    assert re.search(rf"exit code    {code}\n  wall time    (\d+m)?\d+s \(setup \d+s, run [3-9]s\)", job.text)
    assert_host_clean(job, token)


def test_host_timeout_kills_the_command_and_exits_124(sshd, art_sky_home, project):
    token = f"tok-{secrets.token_hex(4)}"
    job = Job(
        [*host_args(sshd), "--timeout", "8s", "--", f"echo go; sleep 300 # {token}"],
        project,
        {"ART_SKY_HOME": str(art_sky_home)},
    )
    try:
        assert job.finish(timeout=60) == 124
    finally:
        job.kill()
    assert "timeout reached" in job.text
    assert_host_clean(job, token)


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_host_ci_cancel_tears_down(sshd, art_sky_home, project, sig, code):
    token = f"tok-{secrets.token_hex(4)}"
    job = Job([*host_args(sshd), "--", f"echo go; sleep 300 # {token}"], project, {"ART_SKY_HOME": str(art_sky_home)})
    try:
        job.wait_for("] go", timeout=60)
        assert subprocess.run(["pgrep", "-f", token], capture_output=True).stdout  # it runs now
        job.process.send_signal(sig)
        assert job.finish(timeout=60) == code
    finally:
        job.kill()
    assert f"{sig.name} received" in job.text
    assert_host_clean(job, token)


def test_host_keep_leaves_the_dir_and_says_how_to_clean_up(sshd, art_sky_home, project):
    job = Job(
        [*host_args(sshd), "--keep", "--", "echo kept > marker.txt"], project, {"ART_SKY_HOME": str(art_sky_home)}
    )
    try:
        assert job.finish(timeout=60) == 0
        remote = Path.home() / ".art-sky" / "ci" / job.name
        assert (remote / "work" / "marker.txt").read_text() == "kept\n"
        assert f"rm -rf {remote}" in job.text and f"-p {sshd.port}" in job.text
    finally:
        job.kill()
        subprocess.run(["rm", "-rf", str(Path.home() / ".art-sky" / "ci" / job.name)], timeout=30)


def test_an_unreachable_host_is_an_art_sky_error_exit_2(art_sky_home, project):
    job = Job(
        ["--host", "root@127.0.0.1:9", "--key", __file__, "--", "true"],
        project,
        {"ART_SKY_HOME": str(art_sky_home), "ART_SKY_SSH_CONNECT_TIMEOUT": "5"},
    )
    assert job.finish(timeout=60) == 2
    assert "cannot reach root@127.0.0.1:9" in job.text or "refused" in job.text, job.text


def test_skypilot_options_with_host_are_refused(project):
    job = Job(["--host", "root@127.0.0.1", "--gpu", "H100", "--", "true"], project)
    assert job.finish(timeout=60) == 2
    assert "--gpu choose a SkyPilot cluster" in job.text


# ---- SkyPilot clusters on the local Slurm ----------------------------------------------------------------------


@pytest.fixture
def clusters_prefix(sky_slurm):
    """A name prefix for this test's clusters; whatever happens, every cluster with it is torn down."""
    import slurm_harness

    prefix = f"art-sky-ci-test-{secrets.token_hex(3)}"
    yield prefix
    slurm_harness.down_clusters(prefix)


def sky_args(name: str) -> list[str]:
    import slurm_harness

    return ["--infra", slurm_harness.INFRA, "--cpus", "1", "--memory", "1", "--name", name]


def assert_cluster_gone(name: str) -> None:
    import slurm_harness

    assert not slurm_harness.slurm_jobs(name), f"the Slurm job of {name} still runs"
    assert asyncio.run(provisioner.cluster_status(name)) is None, f"SkyPilot still lists {name}"


def wait_for_idle_cpus(count: int, timeout: float = 300) -> None:
    """The single Slurm node is shared with other tests: wait until `count` CPUs are free to launch on."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = subprocess.run(["sinfo", "-h", "-o", "%C"], capture_output=True, text=True, timeout=30).stdout
        if int(counts.strip().split("/")[1] or 0) >= count:  # allocated/idle/other/total
            return
        time.sleep(5)
    pytest.fail(f"the local Slurm node had no {count} idle CPUs for {timeout:.0f}s: other clusters hold it")


@pytest.mark.slow
def test_sky_parallel_jobs_get_their_own_clusters_and_exit_codes(clusters_prefix, project):
    wait_for_idle_cpus(2)
    jobs = {
        code: Job(
            [
                *sky_args(f"{clusters_prefix}-{code}"),
                "--timeout",
                "6m",
                "--",
                f"echo first-{code}; sleep 50; echo second-{code}; exit {code}",
            ],
            project,
        )
        for code in (0, 5)
    }
    try:
        for code, job in jobs.items():
            assert job.finish() == code, job.text
    finally:
        for job in jobs.values():
            job.kill()
    for code, job in jobs.items():
        first, second = job.wait_for(f"first-{code}"), job.wait_for(f"second-{code}")
        # streamed as it ran, not at the end (SkyPilot's log tailing polls, and starts once SkyPilot's own
        # interpreter has: lines arrive up to 20 s late on two loaded cores, so the job runs long enough to tell the two
        # apart)
        assert second - first > 4 and job.wait_for("torn down") - first > 4
        assert f"exit code    {code}" in job.text and "accelerator  none (1 CPUs)" in job.text
        assert re.search(r"setup (\d+m)?\d+s, run (\d+m)?\d+s\)", job.text) and "$0.00 (estimated)" in job.text
        assert "ignored.bin" not in job.text
        assert_cluster_gone(job.name)
    assert {job.name for job in jobs.values()} == {f"{clusters_prefix}-0", f"{clusters_prefix}-5"}


@pytest.mark.slow
def test_sky_sigterm_tears_the_cluster_down(clusters_prefix, project, tmp_path):
    name = f"{clusters_prefix}-term"
    token = f"tok-{secrets.token_hex(8)}"
    (tmp_path / "ci.env").write_text(f"CI_TOKEN={token}\n")
    wait_for_idle_cpus(1)
    command = 'echo "go ${#CI_TOKEN}"; sleep 600'  # the command sees the token (its length: the log shows no value)
    job = Job([*sky_args(name), "--env-file", str(tmp_path / "ci.env"), "--timeout", "6m", "--", command], project)
    try:
        job.wait_for(f"go {len(token)}")
        import slurm_harness

        assert slurm_harness.slurm_jobs(name)  # the cluster is up now
        # on the node (this machine): the token only in the 0600 secrets file, in no command line, history or job file
        (home,) = Path.home().glob(f".sky_clusters/{name}*")
        secrets_file = home / ".art-sky-ci" / "secrets.env"
        assert secrets_file.stat().st_mode & 0o777 == 0o600 and token in secrets_file.read_text()
        for path in [*Path("/proc").glob("[0-9]*/cmdline"), home / ".bash_history", *home.glob(".sky/sky_app/*")]:
            try:
                assert token.encode() not in path.read_bytes(), path
            except OSError:  # a process that ended meanwhile, or no history
                pass
        job.process.send_signal(signal.SIGTERM)
        assert job.finish() == 143, job.text
    finally:
        job.kill()
    assert "SIGTERM received" in job.text
    assert_cluster_gone(name)
