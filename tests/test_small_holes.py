"""Holes found by fuzzing by hand, each closed at a real server over HTTP (one server process for the module): a
`name@step` whose step is not ASCII digits or is 5000 digits long, too many adapter leases, metrics logged for a
step far past the model's. Each is a 4xx naming what to fix, never a 500, and the keep-alive connection stays up."""

from __future__ import annotations

import http.client
import json
import sys
import urllib.parse

import pytest

import art_sky as art

pytestmark = pytest.mark.slow

LEASES = 3  # the server's ART_SKY_MAX_LEASES_PER_MODEL here


@pytest.fixture(scope="module")
async def server(tmp_path_factory):
    backend = art.LocalBackend(
        path=tmp_path_factory.mktemp("art"),
        python=sys.executable,
        env={"ART_SKY_ENGINE": "portable", "ART_SKY_MAX_LEASES_PER_MODEL": str(LEASES)},
    )
    model = art.TrainableModel(name="holes", project="holes", base_model="art-sky/tiny")
    await model.register(backend)
    try:
        yield backend
    finally:
        await backend.close()


class Connection:
    """One HTTP/1.1 connection to the server: every request on the same socket, so a server that drops the
    connection after an answer is seen (`http.client` forgets its socket when the server closes it)."""

    def __init__(self, backend: art.Backend):
        url = urllib.parse.urlsplit(backend.base_url)
        self.http = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        self.headers = {"authorization": f"Bearer {backend.api_key}", "content-type": "application/json"}
        self.socket = None

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        self.http.request(method, path, json.dumps(body) if body is not None else None, self.headers)
        response = self.http.getresponse()
        answer = json.loads(response.read())
        if self.socket is None:
            self.socket = self.http.sock
        assert self.http.sock is not None and self.http.sock is self.socket, "the server closed the connection"
        return response.status, answer


def chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def detail(answer: dict) -> str:
    return answer["error"]["message"] if "error" in answer else answer["detail"]


async def test_a_step_that_is_not_ascii_digits_or_too_long_is_a_4xx_on_a_kept_connection(server):
    connection = Connection(server)
    assert connection.request("POST", "/v1/chat/completions", chat("holes@0"))[0] == 200
    for step in ("²", "٣", "1e3", "-1", "", " 0"):  # Unicode digits str.isdigit takes; not numbers
        status, answer = connection.request("POST", "/v1/chat/completions", chat(f"holes@{step}"))
        assert status == 400, (step, answer)
        assert "the step after '@' must be a step number (digits 0-9), as in 'holes@3'" in detail(answer)
        status, answer = connection.request("GET", f"/v1/models/{urllib.parse.quote(f'holes@{step}')}")
        assert status in (400, 404), (step, answer)  # "" and " 0": a path /v1/models/holes@ the router may treat so
    for step in ("5" * 5000, "9" * 19, "18446744073709551616", "7"):
        status, answer = connection.request("POST", "/v1/chat/completions", chat(f"holes@{step}"))
        assert status == 404, (len(step), answer)
        shown = step if len(step) <= 40 else f"{step[:40]}... ({len(step)} characters)"
        assert detail(answer).startswith(f"no step {shown} of model 'holes': it has checkpoints for steps 0")
        status, answer = connection.request("GET", f"/v1/models/holes@{step}")
        assert status == 404 and "no step" in detail(answer), answer
    assert connection.request("POST", "/v1/chat/completions", chat("holes@0"))[0] == 200


async def test_leases_past_the_cap_are_429_saying_what_holds_them(server):
    connection = Connection(server)
    taken = [connection.request("POST", "/art/models/holes/leases", {"step": 0}) for _ in range(LEASES)]
    assert all(status == 200 for status, _ in taken), taken
    status, answer = connection.request("POST", "/art/models/holes/leases", {"step": 0})
    assert (status, answer["code"]) == (429, "limit"), answer
    assert answer["detail"].startswith(
        f"holes holds {LEASES} adapter leases, the most ART_SKY_MAX_LEASES_PER_MODEL allows ({LEASES} on step 0): "
        "release leases"
    )
    released = connection.request("DELETE", f"/art/models/holes/leases/{taken[0][1]['id']}")
    assert released == (200, {"released": True})
    status, again = connection.request("POST", "/art/models/holes/leases", {"step": 0})
    assert status == 200 and again["step"] == 0  # one released: one more may be taken
    for _, lease in [*taken[1:], (200, again)]:
        assert connection.request("DELETE", f"/art/models/holes/leases/{lease['id']}")[0] == 200


async def test_metrics_for_a_step_past_the_models_are_a_400_naming_the_bound(server):
    connection = Connection(server)
    for step in (10**30, 2):
        status, answer = connection.request("POST", "/art/models/holes/log", {"metrics": {"a": 1.0}, "step": step})
        assert status == 400, answer
        assert answer["detail"].startswith(
            f"step {step} of holes is past its bound: holes is at step 0, so metrics belong to a step up to 1"
        )
    for step in (0, 1, None):
        status, entry = connection.request("POST", "/art/models/holes/log", {"metrics": {"a": 1.0}, "step": step})
        assert status == 200 and entry["step"] == (step or 0), entry
