"""schemathesis against the running server's own OpenAPI document (fetched with the key): generated requests to
every route (the fleet's too), path names and bodies mostly aimed at what exists (the registered model, its step 0,
its adapter files), and no answer is a 5xx but the one a route owes: a replica the head cannot reach is a 502."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zlib
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

pytestmark = pytest.mark.slow

KEY = "fuzz-key-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
MODEL = "tiny"
# path parameters aimed at what the server has: the model (by name, and its step 0 as `name@0`), its step's files
EXISTING = {
    "name": MODEL,
    "model_id": (MODEL, f"{MODEL}@0"),
    "step": 0,
    "file": ("adapter_config.json", "adapter_model.safetensors"),
}
answered: Counter[tuple[str, int]] = Counter()  # (route, status class) -> count, over the whole module


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    """A real server process (the portable engine, the tiny model registered)."""
    root = tmp_path_factory.mktemp("fuzz")
    # offline: a generated base model name is refused at once, not looked up on the Hugging Face hub
    env = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "ART_SKY_API_KEY": KEY,
        "ART_SKY_MAX_NEW_TOKENS_LIMIT": "16",
        "ART_SKY_MAX_REQUEST_BYTES": "1000000",
        "ART_SKY_MAX_COMPLETION_REQUEST_BYTES": "200000",
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "art_sky.cluster", "--run-dir", str(root / "run"), "--art-path", str(root / "art")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        port_file = root / "run" / "port.json"
        for _ in range(1200):
            if port_file.exists():
                break
            assert server.poll() is None, (root / "run" / "server.log").read_text()
            time.sleep(0.1)
        url = f"http://127.0.0.1:{json.loads(port_file.read_text())['port']}"
        for _ in range(300):
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        response = httpx.post(
            f"{url}/art/models",
            headers=AUTH,
            timeout=120,
            json={"name": MODEL, "project": "fuzz", "base_model": "art-sky/tiny"},
        )
        assert response.status_code == 200, response.text
        yield url
    finally:
        server.terminate()
        server.wait(30)


def operations(base_url: str) -> list:
    document = httpx.get(f"{base_url}/openapi.json", headers=AUTH).json()
    return [result.ok() for result in schemathesis.openapi.from_dict(document).get_all_operations()]


def test_no_generated_request_gets_a_5xx(base_url):
    """Each operation in turn, a bounded number of generated requests each (a fixed seed: the same run each time)."""
    found = operations(base_url)
    assert {op.path for op in found} >= {"/art/models/{name}/train", "/v1/chat/completions", "/art/models"}
    for operation in found:

        @given(operation.as_strategy())
        @settings(
            max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
        )
        def call(case):
            aimed = zlib.crc32(repr((case.body, case.path_parameters)).encode()) % 4  # mostly at what exists
            if aimed:
                for name, value in EXISTING.items():
                    if name in (case.path_parameters or {}):
                        case.path_parameters[name] = value[aimed % len(value)] if isinstance(value, tuple) else value
            if case.path == "/v1/chat/completions" and isinstance(case.body, dict) and aimed:
                case.body["model"] = MODEL
            response = case.call(base_url=base_url, headers=AUTH, timeout=120)
            answered[(case.path, response.status_code // 100)] += 1
            owed = (
                case.path == "/fleet/join"
                and response.status_code == 502
                and response.json()["detail"].startswith("the head cannot reach the replica at ")
            )
            assert response.status_code < 500 or owed, (
                f"{case.method} {case.formatted_path}: {response.status_code} {response.text[:500]}"
            )

        call()


def test_generated_requests_reached_the_model_routes():
    """The run above exercised the model itself, not only the validation in front of it: its routes by name, the
    fleet's adapter files of its step, and joins refused (4xx)."""
    ok = {path for (path, status), count in answered.items() if status == 2 and count}
    assert {
        "/v1/chat/completions",
        "/v1/models/{model_id}",
        "/fleet/models/{name}/steps/{step}/{file}",
        "/art/models/{name}",
        "/art/models/{name}/history",
    } <= ok, answered
    assert answered[("/fleet/join", 4)], answered
