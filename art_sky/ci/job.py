"""`art-sky ci run`: run one command on a fresh machine, stream its output, and always tear the machine down.

`run_job` owns the guarantees: every blocking step runs in a daemon thread while the main thread watches the
deadline and SIGINT/SIGTERM (a CI cancel), so a timeout or a signal goes straight to the `finally` that tears down,
whatever the step was doing. Two runners obtain the machine: a SkyPilot cluster (templates/ci-job.yaml, with
autodown as the net for a killed runner) and an SSH host (the work dir under ~/.art-sky/ci/<name>, the command in
its own session, killed with `timeout` on the host as the net).
"""

from __future__ import annotations

import asyncio
import re
import shlex
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel

from art_sky.errors import ArtSkyError, SSHError
from art_sky.provisioners import sky as provisioner
from art_sky.provisioners.sky_env import sky_cli
from art_sky.provisioners.sky_task import CIJobSpec, render_ci_task, validate_task
from art_sky.remote.runner import READ_ENV, env_stdin
from art_sky.remote.ssh import SSHRunner, SSHTarget
from art_sky.settings import Settings

from . import workdir as work_files

START_MARKER = "::art-sky-ci::start"  # printed by the job right before the command (templates/ci-job.yaml too)
EXIT_MARKER = "::art-sky-ci::exit "  # followed by the exit code of the command (or of a failed setup)
_MARKER = re.compile(re.escape(START_MARKER[: -len("start")]) + r"(start|exit (\d+))\s*$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
EXIT_TIMEOUT, EXIT_SIGINT, EXIT_SIGTERM, EXIT_ERROR = 124, 130, 143, 2
TEARDOWN_LIMIT = 300.0  # seconds; past this the autodown / host timeout net is what is left


class Stopped(BaseException):
    """The job was cut short (timeout or a signal); a BaseException so no library's `except Exception` eats it."""

    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code = code


class Summary(BaseModel):
    name: str
    where: str
    accelerator: str
    exit_code: int
    wall_s: float
    setup_s: float | None  # launch, sync and setup, until the command started
    run_s: float | None
    cost: float | None  # estimated, for the wall time; None where unknown (your own host)


class Output:
    """Job output arrives in chunks from a worker thread: print it line by line with the time it arrived, and
    pick out the markers (when the command started, how it exited)."""

    def __init__(self, write: Callable[[str], None]):
        self._write = write
        self._buffer = ""
        self._lock = threading.RLock()  # a signal handler may note() while held
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self.exit_code: int | None = None

    def write(self, chunk: str) -> int:
        with self._lock:
            self._buffer += chunk
            *lines, self._buffer = self._buffer.split("\n")
            for line in lines:
                self._line(line.rstrip("\r"))
        return len(chunk)

    def flush(self) -> None:
        with self._lock:
            if self._buffer:
                self._line(self._buffer)
                self._buffer = ""

    def note(self, text: str) -> None:
        """art-sky's own lines, in the same timestamped stream."""
        with self._lock:
            self._emit(f"art-sky ci: {text}")

    def _line(self, line: str) -> None:
        # SkyPilot prefixes job lines ("(task, pid=N) ", colours): a marker is what a line ends with.
        marker = _MARKER.search(_ANSI.sub("", line))
        if marker is None:
            self._emit(line)
        elif marker.group(1) == "start":
            self.started_at = time.monotonic()
            self._emit("art-sky ci: command started")
        else:
            self.ended_at = time.monotonic()
            self.exit_code = int(marker.group(2))
            self._emit(f"art-sky ci: command exited with {self.exit_code}")

    def _emit(self, line: str) -> None:
        self._write(f"[{time.strftime('%H:%M:%S')}] {line}")


class Runner(Protocol):
    """Where the job runs. `launch` gets the machine and starts the command; `follow` streams until it ends and
    returns an exit code for when no exit marker came; `teardown` must work whatever state `launch` reached."""

    name: str
    where: str
    accelerator: str

    def launch(self, out: Output) -> None: ...
    def follow(self, out: Output) -> int: ...
    def teardown(self, out: Output) -> None: ...
    def keep_hint(self) -> str: ...
    def cost(self, seconds: float) -> float | None: ...


def run_job(runner: Runner, timeout_s: float, keep: bool, write: Callable[[str], None]) -> Summary:
    """Launch, stream and wait, then tear down on every path (unless `keep`); the summary's exit code is the
    command's, or 124 / 130 / 143 for a timeout / SIGINT / SIGTERM, or 2 for an error of art-sky itself."""
    out = Output(write)
    started = time.monotonic()
    deadline = started + timeout_s
    previous = {s: signal.signal(s, _raise_stopped) for s in (signal.SIGINT, signal.SIGTERM)}
    code = EXIT_ERROR
    try:
        out.note(f"job {runner.name} on {runner.where}")
        _in_thread(runner.launch, out, deadline=deadline)
        # The exit marker is the command's last line: stop waiting there, not when SkyPilot's log epilogue ends.
        fallback = _in_thread(runner.follow, out, deadline=deadline, done=lambda: out.exit_code is not None)
        out.flush()
        code = out.exit_code if out.exit_code is not None else fallback
    except Stopped as stop:
        code = stop.code
        out.note(f"{stop}: tearing down")
    except ArtSkyError as exc:
        out.note(f"error: {exc}")
    except Exception:  # a bug in art-sky or a library: still tear down, and say what happened
        out.note(f"internal error, please report it:\n{traceback.format_exc()}")
    finally:
        for sig in previous:  # a second Ctrl-C or the runner's SIGTERM after SIGINT must not cut the teardown
            signal.signal(sig, lambda signum, _: out.note(f"{signal.Signals(signum).name} ignored during teardown"))
        ended = out.ended_at or time.monotonic()
        try:
            if keep:
                out.note(f"--keep: {runner.keep_hint()}")
            else:
                _in_thread(runner.teardown, out, deadline=time.monotonic() + TEARDOWN_LIMIT)
                out.note(f"{runner.name} torn down")
        except (Stopped, Exception) as exc:
            out.note(f"TEARDOWN FAILED ({exc}): {runner.keep_hint()}")
            code = code or EXIT_ERROR
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    wall = time.monotonic() - started
    return Summary(
        name=runner.name,
        where=runner.where,
        accelerator=runner.accelerator,
        exit_code=code,
        wall_s=wall,
        setup_s=out.started_at - started if out.started_at else None,
        run_s=ended - out.started_at if out.started_at else None,
        cost=runner.cost(wall),
    )


def format_summary(summary: Summary) -> str:
    cost = "unknown (no price for this machine)" if summary.cost is None else f"${summary.cost:.2f} (estimated)"
    setup = _duration(summary.setup_s) if summary.setup_s is not None else "-"
    ran = _duration(summary.run_s) if summary.run_s is not None else "- (did not start)"
    return (
        f"art-sky ci summary\n  job          {summary.name} on {summary.where}\n"
        f"  accelerator  {summary.accelerator}\n  exit code    {summary.exit_code}\n"
        f"  wall time    {_duration(summary.wall_s)} (setup {setup}, run {ran})\n  cost         {cost}"
    )


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _raise_stopped(signum: int, _frame) -> None:
    name = signal.Signals(signum).name
    raise Stopped(EXIT_SIGINT if signum == signal.SIGINT else EXIT_SIGTERM, f"{name} received")


def _in_thread(fn: Callable[..., Any], *args, deadline: float, done: Callable[[], bool] = lambda: False) -> Any:
    """Run `fn` in a daemon thread; the main thread stays free to take signals and to give up at `deadline`, or
    to move on once `done()` (the thread is abandoned: teardown ends what it was doing)."""
    result: dict[str, Any] = {}

    def target():
        try:
            result["value"] = fn(*args)
        except BaseException as exc:  # re-raised in the main thread
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name=f"art-sky-ci-{fn.__name__}")
    thread.start()
    while thread.is_alive() and not done():
        if time.monotonic() > deadline:
            raise Stopped(EXIT_TIMEOUT, "timeout reached")
        thread.join(0.2)
    if "error" in result:
        raise result["error"]
    return result.get("value")


class SkyPilotRunner:
    """The job as the first job of a fresh SkyPilot cluster (templates/ci-job.yaml)."""

    def __init__(self, name: str, spec: CIJobSpec):
        self.name = name
        self.spec = spec
        self.where = f"SkyPilot cluster {name}" + (f" ({spec.infra})" if spec.infra else "")
        self.accelerator = "-"
        with tempfile.TemporaryDirectory(prefix="art-sky-ci-") as tmp:  # refuse a bad spec before launching
            validate_task(render_ci_task(spec, Path(tmp) / "secrets.env"))
        self._request_id: str | None = None
        self._launched = threading.Event()
        self._launched_job: provisioner.Launched | None = None

    def launch(self, out: Output) -> None:
        def requested(request_id: str) -> None:
            self._request_id = request_id

        with tempfile.TemporaryDirectory(prefix="art-sky-ci-") as tmp:  # private: the secrets file, until shipped
            task = render_ci_task(self.spec, Path(tmp) / "secrets.env")
            launched = self._launched_job = asyncio.run(provisioner.launch_job(self.name, task, out, requested))
        self._launched.set()
        self.accelerator = launched.accelerator
        out.note(f"launched; accelerator {self.accelerator}, job {launched.job_id}")

    def follow(self, out: Output) -> int:
        assert self._launched_job is not None
        asyncio.run(provisioner.follow_job(self.name, self._launched_job.job_id, out))
        out.flush()
        if out.exit_code is not None:
            return out.exit_code
        state = asyncio.run(provisioner.job_state(self.name, self._launched_job.job_id))
        return 0 if state == "SUCCEEDED" else 1

    def teardown(self, out: Output) -> None:
        if self._request_id is not None and not self._launched.is_set():
            out.note("cancelling the launch")
            asyncio.run(provisioner.cancel_request(self._request_id))
        out.note(f"tearing down {self.name} (sky down)")
        asyncio.run(provisioner.down(self.name))

    def keep_hint(self) -> str:
        sky = sky_cli()
        net = (
            f" It tears itself down after {self.spec.autodown_minutes} idle minutes (`{sky} autostop "
            f"{self.name} --cancel` keeps it)."
            if self.spec.autodown_minutes is not None
            else ""
        )
        return (
            f"cluster {self.name} is left up. Attach: `ssh {self.name}` (work dir ~/sky_workdir); logs: "
            f"`{sky} logs {self.name}`; down: `{sky} down {self.name}`.{net}"
        )

    def cost(self, seconds: float) -> float | None:
        hourly = self._launched_job.hourly_cost if self._launched_job is not None else None
        return None if hourly is None else hourly * seconds / 3600


class SSHHostRunner:
    """The job on your own machine: the work dir unpacked under ~/.art-sky/ci/<name>, the command detached in its
    own session (it survives a dropped connection; `timeout` there ends it), its log followed over SSH."""

    GRACE_S = 10

    def __init__(
        self,
        name: str,
        target: SSHTarget,
        *,
        command: str,
        setup: str,
        workdir: Path,
        timeout_s: int,
        env: dict[str, str],
        settings: Settings,
    ):
        self._env_stdin = env_stdin(env)  # refuses what cannot travel before anything starts
        self.settings = settings
        self.name = name
        self.target = target
        self.where = f"SSH host {target}"
        self.accelerator = "-"
        self.remote_dir = f".art-sky/ci/{name}"  # under the login directory
        self._command, self._setup, self._workdir, self._timeout_s = command, setup, workdir, timeout_s
        self._session: SSHRunner | None = None

    def launch(self, out: Output) -> None:
        files = work_files.files_to_sync(self._workdir)
        out.note(f"syncing {len(files)} files from {self._workdir} to {self.target}:~/{self.remote_dir}")
        self._session = session = SSHRunner(self.target, self.settings)
        q = shlex.quote
        self.remote_dir = session.run(
            f"mkdir -p {q(self.remote_dir)}/work && cd {q(self.remote_dir)} && pwd", timeout=60
        ).stdout.strip()
        with tempfile.TemporaryDirectory(prefix="art-sky-ci-") as tmp:
            archive = work_files.pack(self._workdir, Path(tmp) / "work.tar.gz")
            session.upload(archive, f"{self.remote_dir}/work.tar.gz")
            job_script = Path(tmp) / "job.sh"
            job_script.write_text(self._job_script())
            session.upload(job_script, f"{self.remote_dir}/job.sh")
        gpus = session.run(
            "nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c", timeout=60, check=False
        ).stdout.split("\n")
        self.accelerator = ", ".join(" x ".join(g.split(None, 1)) for g in gpus if g.strip()) or "none found"
        start = (
            f"set -e\ncd {q(self.remote_dir)}\ntar -xzf work.tar.gz -C work && rm work.tar.gz\numask 077\n"
            f"{READ_ENV}setsid nohup sh job.sh >job.log 2>&1 </dev/null &\necho $! >job.pid\n"
        )
        session.run(start, timeout=120, stdin=self._env_stdin)

    def _job_script(self) -> str:
        q, limit = shlex.quote, f"timeout -k 30 {self._timeout_s}"
        setup = (
            f"{limit} bash -c {q(self._setup)} || {{ code=$?; echo '{EXIT_MARKER}'$code; exit $code; }}\n"
            if self._setup
            else ""
        )
        return (
            f"cd work\n{setup}echo '{START_MARKER}'\n{limit} bash -c {q(self._command)}\ncode=$?\n"
            f"echo '{EXIT_MARKER}'$code\nexit $code\n"
        )

    def follow(self, out: Output) -> int:
        """Tail the job's log until the job's process exits (`tail --pid`), chunk by chunk as it arrives."""
        assert self._session is not None
        transport = self._session.client.get_transport()
        if transport is None or not transport.is_active():
            raise SSHError(f"the SSH connection to {self.target} closed: check the host and retry")
        channel = transport.open_session(timeout=60)
        q = shlex.quote
        channel.exec_command(f'cd {q(self.remote_dir)} && tail -n +1 -s 0.2 -f --pid="$(cat job.pid)" job.log')
        while not (channel.exit_status_ready() and not channel.recv_ready()):
            if channel.recv_ready():
                out.write(channel.recv(65536).decode(errors="replace"))
            else:
                time.sleep(0.05)
        return 1  # no exit marker: the job was killed on the host

    def teardown(self, out: Output) -> None:
        """Kill every process of the job's session (`timeout` makes its own process group), remove the dir."""
        if self._session is not None:
            self._session.close()  # stops an upload or a tail still running in a worker thread
        q = shlex.quote
        script = f"""cd {q(self.remote_dir)} 2>/dev/null || exit 0
sid=$(cat job.pid 2>/dev/null)
if [ -n "$sid" ] && pkill -TERM -s "$sid"; then
  i=0
  while pgrep -s "$sid" >/dev/null && [ $i -lt {self.GRACE_S * 10} ]; do sleep 0.1; i=$((i + 1)); done
  pkill -KILL -s "$sid" || true
fi
cd / && rm -rf {q(self.remote_dir)}
"""
        out.note(f"stopping the job and removing {self.target}:{self.remote_dir}")
        with SSHRunner(self.target, self.settings) as session:
            session.run(script, timeout=self.GRACE_S + 60)

    def keep_hint(self) -> str:
        port = f" -p {self.target.port}" if self.target.port != 22 else ""
        return (
            f"the work dir {self.remote_dir} stays on {self.target}. Attach: `ssh{port} "
            f"{self.target.user}@{self.target.host}` then `cd {self.remote_dir}` (job.log, job.pid); clean up: "
            f"`pkill -s $(cat {self.remote_dir}/job.pid); rm -rf {self.remote_dir}`"
        )

    def cost(self, seconds: float) -> float | None:
        return None
