"""`CommandRunner`: run a script on a machine with a deadline and stdin, upload a file there, and say how to open a
shell there (SkyPilot's `command_runner` shape). Everything that acts on a machine (the server's lifecycle, the
install, a CI job) is written once against it; `LocalRunner` is this machine, `SSHRunner` (art_sky.remote.ssh) a
host over SSH.

Secrets go in on stdin, never in a script (which the machine's process list shows): `env_stdin` encodes an
environment and `READ_ENV` is the sh that exports it there (not traced, so no value reaches stderr).

A script runs traced (`set -x`, each command on stderr after `TRACE`): when it fails, the message names the command
that failed, not the script's first line, and the reason that command wrote (art_sky.remote.reasons); callers see
stderr without the trace.
"""

from __future__ import annotations

import codecs
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Protocol

from pydantic import BaseModel

from art_sky.errors import BackendUnavailableError, ConfigError

from .reasons import reason

Output = Callable[[str], None]  # called with the command's stdout and stderr text as it arrives (partial lines too)
TRACE = "+art-sky: "  # sh's PS4: what starts a trace line on stderr
READ_ENV = (
    'case $- in *x*) set +x; kv_traced=1;; esac\nwhile IFS= read -r kv; do [ -n "$kv" ] || break; export "$kv"; done\n'
    '[ -z "${kv_traced-}" ] || set -x\n'
)


class CommandResult(BaseModel):
    exit_code: int
    stdout: str
    stderr: str


class CommandRunner(Protocol):
    where: str  # for messages: "this machine", "user@host:22"

    def run(
        self, script: str, *, timeout: float, stdin: bytes = b"", check: bool = True, output: Output | None = None
    ) -> CommandResult:
        """Run a POSIX sh script; raise (naming the script's first line) when it fails and `check`, or overruns.
        `output` also gets its stdout and stderr as they arrive (a long install shown while it runs)."""

    def upload(self, local: Path, remote: str) -> None:
        """Copy a file there (relative paths: under the login directory)."""

    def shell_argv(self, command: list[str]) -> list[str]:
        """argv (for exec) that runs `command` there in this terminal, or a login shell when it is empty."""

    def close(self) -> None: ...

    def __enter__(self) -> CommandRunner: ...

    def __exit__(self, *exc_info) -> None: ...


def env_stdin(env: dict[str, str]) -> bytes:
    """An environment as `READ_ENV` reads it: one KEY=value line each, a blank line to end."""
    for key, value in env.items():
        if not key.isidentifier() or "\n" in value:
            raise ConfigError(f"environment variable {key!r}: names must be identifiers and values one line")
    return "".join(f"{k}={v}\n" for k, v in env.items()).encode() + b"\n"


def first_line(script: str) -> str:
    lines = [line.strip() for line in script.strip().splitlines() if line.strip()]
    return lines[0] + (" ..." if len(lines) > 1 else "") if lines else ""


def traced(script: str) -> str:
    """`script` as the runners run it: each command it runs written to stderr after `TRACE` first."""
    return f"PS4='{TRACE}'\nset -x\n{script}"


def result_of(
    script: str, exit_code: int, stdout: str, stderr: str, *, check: bool, where: str, error: type[Exception]
) -> CommandResult:
    """A traced run's result, its stderr without the trace; when it failed and `check`, `error` with one line
    that says which command failed `where` ("here", "on user@host:22") and the reason it wrote, then the tail of
    its stderr (or stdout) as detail."""
    trace = [line for line in stderr.splitlines() if line.startswith(TRACE)]
    own = "".join(line for line in stderr.splitlines(keepends=True) if not line.startswith(TRACE))
    result = CommandResult(exit_code=exit_code, stdout=stdout, stderr=own)
    if check and exit_code != 0:
        command = trace[-1].removeprefix(TRACE).strip() if trace else first_line(script)
        command = command if len(command) <= 300 else command[:297] + "..."
        output = own.strip() or stdout.strip()
        why = reason(output) or "it wrote no error"
        raise error(f"`{command}` failed {where} with exit code {exit_code}: {why}\n{output[-2000:]}".rstrip())
    return result


class LocalRunner:
    """This machine: scripts run under `sh`, with this process's environment and working directory."""

    where = "this machine"

    def run(
        self, script: str, *, timeout: float, stdin: bytes = b"", check: bool = True, output: Output | None = None
    ) -> CommandResult:
        try:
            if output is None:
                done = subprocess.run(["sh", "-c", traced(script)], input=stdin, capture_output=True, timeout=timeout)
                code, out, err = done.returncode, done.stdout, done.stderr
            else:
                code, out, err = _run_streaming(traced(script), stdin, timeout, output)
        except subprocess.TimeoutExpired as exc:
            raise BackendUnavailableError(f"`{first_line(script)}` did not finish within {timeout:.0f}s here") from exc
        return result_of(
            script,
            code,
            out.decode(errors="replace"),
            err.decode(errors="replace"),
            check=check,
            where="here",
            error=BackendUnavailableError,
        )

    def upload(self, local: Path, remote: str) -> None:
        shutil.copyfile(local, Path.home() / remote if not os.path.isabs(remote) else remote)

    def shell_argv(self, command: list[str]) -> list[str]:
        return command or [os.environ.get("SHELL", "sh")]

    def close(self) -> None:
        pass

    def __enter__(self) -> LocalRunner:
        return self

    def __exit__(self, *exc_info) -> None:
        pass


def _run_streaming(script: str, stdin: bytes, timeout: float, output: Output) -> tuple[int, bytes, bytes]:
    """`sh -c script` with its stdout and stderr passed to `output` as they come, and kept."""
    process = subprocess.Popen(
        ["sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    stdout, stderr, into = process.stdout, process.stderr, process.stdin
    assert stdout is not None and stderr is not None and into is not None  # all three are pipes
    kept = {stdout: bytearray(), stderr: bytearray()}
    lock = threading.Lock()  # one call of `output` at a time

    def pump(stream: IO[bytes]) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        shown = untraced(output) if stream is stderr else output
        while chunk := os.read(stream.fileno(), 65536):
            kept[stream] += chunk
            with lock:
                shown(decoder.decode(chunk))
        with lock:
            shown("")

    readers = [threading.Thread(target=pump, args=(stream,), daemon=True) for stream in kept]
    for reader in readers:
        reader.start()
    try:
        into.write(stdin)
        into.close()
    except BrokenPipeError:
        pass  # the script did not read its stdin
    try:
        code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    for reader in readers:
        reader.join()
    return code, bytes(kept[stdout]), bytes(kept[stderr])


def untraced(output: Output) -> Output:
    """`output` fed a traced stderr without its trace lines: whole lines are passed on (an empty call: the end, the
    last partial line too)."""
    pending = ""

    def feed(text: str) -> None:
        nonlocal pending
        pending += text
        *lines, pending = pending.split("\n") if text else (*pending.split("\n"), "")
        shown = "".join(line + "\n" for line in lines if not line.startswith(TRACE))
        if not text and lines and not lines[-1].startswith(TRACE):
            shown = shown[:-1]  # the last partial line had no newline
        if shown:
            output(shown)

    return feed
