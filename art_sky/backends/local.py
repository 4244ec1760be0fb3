"""`LocalBackend`: the cluster server as a subprocess of this machine (CPU or a local GPU)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


from art_sky.errors import BackendUnavailableError
from art_sky.settings import settings
from art_sky.store import server_env

from .base import Backend


class LocalBackend(Backend):
    """Starts `python -m art_sky.cluster` on a free port with a fresh API key; stops it on `close()`.

    `path` is the checkpoint root (ART's `.art`). The server's log goes to `<path>/logs/server.log`.
    `checkpoint_uri` (default ART_SKY_CHECKPOINT_URI) mirrors every checkpoint to object storage, from where a
    new server restores them.
    """

    def __init__(self, *, path: str | os.PathLike = ".art", python: str = sys.executable,
                 env: dict[str, str] | None = None, checkpoint_uri: str | None = None):
        super().__init__()
        self.path = Path(path).resolve()
        self.python = python
        self.env = env or {}
        if checkpoint_uri is not None:
            self.env |= server_env(checkpoint_uri)
        self.log_path = self.path / "logs" / "server.log"
        self._process: subprocess.Popen | None = None

    async def _start(self) -> None:
        self.api_key = secrets.token_urlsafe(32)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        port_file = Path(tempfile.mkdtemp(prefix="art-sky-")) / "port.json"
        env = os.environ | self.env | {"ART_SKY_API_KEY": self.api_key}
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                [self.python, "-m", "art_sky.cluster", "--port", "0", "--art-path", str(self.path),
                 "--port-file", str(port_file)],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + settings().server_start_timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise BackendUnavailableError(
                    f"the local cluster server exited with code {self._process.returncode} before it was healthy. "
                    f"Last lines of {self.log_path}:\n{tail(self.log_path)}")
            if port_file.exists():
                self.base_url = f"http://127.0.0.1:{json.loads(port_file.read_text())['port']}"
                if await self._answers_health():
                    return
            await asyncio.sleep(0.2)
        await self.close()
        raise BackendUnavailableError(f"the local cluster server was not healthy within "
                                      f"{settings().server_start_timeout:.0f}s (ART_SKY_SERVER_START_TIMEOUT). "
                                      f"Last lines of {self.log_path}:\n{tail(self.log_path)}")

    async def close(self, force: bool = False) -> None:
        """Stop the server, after its checkpoints are in the store; `force` stops it even if some are not."""
        if self._process is not None and self._process.poll() is None:
            await self._flush_before_stop(force, str(self.path))
        await super().close()
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(process.wait, 15)
            except subprocess.TimeoutExpired:
                process.kill()
                await asyncio.to_thread(process.wait)


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
