"""Shared fixtures: an in-process cluster server app (the real FastAPI app, tiny model) and its HTTP client."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import httpx
import pytest

from art_sky.provisioners.sky_env import sky_cli
from art_sky.settings import Settings

API_KEY = "test-key-0123456789"


@contextlib.asynccontextmanager
async def app_client(art_path: Path, settings: Settings | None = None, *register: dict):
    """The real server app in this process on `art_path` (another start of the same server when the path is
    reused), reached through httpx's ASGI transport, with these models registered. On the way out the checkpoints
    are flushed, as a backend's close does (the last step's background write ends first)."""
    from art_sky.cluster.server import create_app

    app = create_app(art_path, API_KEY, settings or Settings())
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://server",
        headers={"authorization": f"Bearer {API_KEY}"},
        timeout=120,
    ) as client:
        for body in register:
            response = await client.post("/art/models", json=body)
            assert response.status_code == 200, response.text
        yield client
        await client.post("/art/checkpoints/flush")


@pytest.fixture(scope="module")
async def server(tmp_path_factory):
    """The real server app in this process, reached through httpx's ASGI transport; one tiny model registered."""
    art_path = tmp_path_factory.mktemp("art")
    settings = Settings(max_request_bytes=2_000_000, max_completion_request_bytes=1_000_000, max_new_tokens_limit=64)
    async with app_client(
        art_path, settings, {"name": "tiny", "project": "tests", "base_model": "art-sky/tiny"}
    ) as client:
        client.art_path = art_path
        yield client


async def train_lines(client: httpx.AsyncClient, name: str, body: dict) -> tuple[int, list[dict]]:
    """POST a train request and parse its newline-delimited JSON stream."""
    import json

    response = await client.post(f"/art/models/{name}/train", json=body)
    if response.status_code != 200:
        return response.status_code, [response.json()]
    return 200, [json.loads(line) for line in response.text.splitlines() if line.strip()]


@pytest.fixture(scope="session")
def sky_slurm():
    """A real local Slurm with SkyPilot's API server running and `slurm/<alias>` enabled (tests/slurm_harness.py);
    yields the infra string. Skips, saying what to run, where the packages are not installed. The API server stops
    with the session: one started from this checkout's venv must not serve the next run from another."""
    import slurm_harness

    reason = slurm_harness.missing()
    if reason:
        pytest.skip(reason)
    slurm_harness.start()
    slurm_harness.enable_sky()
    yield slurm_harness.INFRA
    subprocess.run([sky_cli(), "api", "stop"], capture_output=True, timeout=120)


@pytest.fixture(scope="session")
def sky_slurm_pair(sky_slurm):
    """The local Slurm's two namespaced nodes as SkyPilot's infra (`slurm/<alias>/pair`); skips, saying why, where
    this machine cannot make network namespaces."""
    import slurm_harness

    if slurm_harness.no_pair:
        pytest.skip(slurm_harness.no_pair)
    return slurm_harness.PAIR_INFRA
