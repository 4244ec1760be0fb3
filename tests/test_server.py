"""The cluster server: OpenAI-compatible completions, training, and a clear 4xx for every bad input."""

import json
import math
import socket
import time

import pytest
from conftest import API_KEY, train_lines
from loop import trajectory

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}


async def completion(server, **overrides):
    response = await server.post("/v1/chat/completions", json=CHAT | overrides)
    assert response.status_code == 200, response.text
    return response.json()


async def sampled_group(server, n=4):
    body = await completion(server, n=n, logprobs=True, return_tokens_as_token_ids=True, seed=1)
    return {"trajectories": [trajectory(c, float(i % 2)) for i, c in enumerate(body["choices"])]}


async def test_health_needs_no_key_and_says_more_with_it(server):
    import art_sky

    anonymous = await server.get("/health", headers={"authorization": ""})
    assert anonymous.status_code == 200
    assert {k: v for k, v in anonymous.json().items() if v not in (None, [], {})} == {
        "status": "ok",
        "version": art_sky.__version__,
    }  # alive and which version: no model names, no engine
    health = (await server.get("/health")).json()
    assert health["engine"] == "portable" and health["models"] == ["tiny"]


async def test_the_api_description_needs_the_key_and_lists_every_body(server):
    for path in ("/docs", "/redoc"):
        assert (await server.get(path)).status_code == 404
    assert (await server.get("/openapi.json", headers={"authorization": ""})).status_code == 401
    document = (await server.get("/openapi.json")).json()
    body = document["paths"]["/art/models/{name}/train"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"] == "#/components/schemas/TrainRequest"
    assert {"TrainRequest", "SFTRequest", "WireTrajectory", "ChatCompletionRequest"} <= set(
        document["components"]["schemas"]
    )
    assert "/v1/chat/completions" in document["paths"]


async def test_completion_parameters(server):
    body = await completion(
        server, n=3, max_tokens=5, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True, seed=7
    )
    assert len(body["choices"]) == 3
    for choice in body["choices"]:
        tokens = choice["logprobs"]["content"]
        assert 1 <= len(tokens) <= 5
        assert all(t["token"].startswith("token_id:") and t["logprob"] <= 0 for t in tokens)
        assert all(len(t["top_logprobs"]) == 2 for t in tokens)
        assert choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] == sum(len(c["logprobs"]["content"]) for c in body["choices"])
    again = await completion(
        server, n=3, max_tokens=5, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True, seed=7
    )
    assert [c["message"] for c in again["choices"]] == [c["message"] for c in body["choices"]]


async def test_greedy_stop_and_max_completion_tokens(server):
    greedy = await completion(server, temperature=0, max_completion_tokens=12)
    text = greedy["choices"][0]["message"]["content"]
    assert (await completion(server, temperature=0, max_completion_tokens=12))["choices"][0]["message"][
        "content"
    ] == text
    assert greedy["usage"]["completion_tokens"] <= 12
    if len(text) >= 3:
        stopped = await completion(server, temperature=0, max_completion_tokens=12, stop=[text[2]])
        assert stopped["choices"][0]["message"]["content"] == text[: text.index(text[2])]
        assert stopped["choices"][0]["finish_reason"] == "stop"


async def test_tools_reach_the_chat_template(server):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    plain = await completion(server, max_tokens=1)
    with_tools = await completion(server, max_tokens=1, tools=tools)
    assert with_tools["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + len(json.dumps(tools)) - 10


async def test_train_step_advances_and_changes_the_served_adapter(server):
    probe = CHAT | {"max_tokens": 4, "temperature": 0, "logprobs": True, "return_tokens_as_token_ids": True}
    before = (await server.post("/v1/chat/completions", json=probe)).json()["choices"][0]["logprobs"]["content"]
    step = (await server.get("/art/models/tiny")).json()["step"]
    status, lines = await train_lines(
        server, "tiny", {"groups": [await sampled_group(server)], "config": {"learning_rate": 0.05}}
    )
    assert status == 200 and lines[-1]["type"] == "result", lines
    assert lines[-1]["step"] == step + 1
    assert any(line["type"] == "progress" for line in lines)
    assert lines[-1]["metrics"]["trained_tokens"] > 0
    after = (await server.post("/v1/chat/completions", json=probe)).json()["choices"][0]["logprobs"]["content"]
    assert after[0]["logprob"] != pytest.approx(before[0]["logprob"], abs=1e-6)
    steps = [c["step"] for c in (await server.get("/art/models/tiny/checkpoints")).json()]
    assert steps[-1] == step + 1


async def test_all_equal_rewards_are_skipped_and_reported(server):
    group = await sampled_group(server)
    for t in group["trajectories"]:
        t["reward"] = 1.0
    status, lines = await train_lines(server, "tiny", {"groups": [group]})
    assert status == 200
    assert lines[-1]["metrics"]["num_groups_skipped"] == 1.0
    assert lines[-1]["metrics"]["trained_tokens"] == 0.0


def checkpoint_state(server):
    root = server.art_path
    return sorted(
        (p.relative_to(root).as_posix(), p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file() and p.name != "history.jsonl"
    )


async def expect_refused(server, method, path, status, match, code=None, **kwargs):
    await server.post("/art/checkpoints/flush")  # an earlier step's checkpoint, written in the background, is done
    before = checkpoint_state(server)
    step = (await server.get("/art/models/tiny")).json()["step"]
    response = await server.request(method, path, **kwargs)
    assert response.status_code == status, response.text
    assert match in response.json()["detail"]
    if code is not None:  # what clients branch on, never the wording
        assert response.json()["code"] == code
    # the server keeps serving and nothing was trained or written
    assert (await server.get("/art/models/tiny")).json()["step"] == step
    assert checkpoint_state(server) == before
    await completion(server, max_tokens=1)


async def test_bad_inputs_get_clear_4xx(server):
    good = await sampled_group(server)
    one = {"trajectories": good["trajectories"][:1]}
    train = "/art/models/tiny/train"
    await expect_refused(server, "POST", train, 422, "groups", code="invalid", json={"groups": []})
    await expect_refused(server, "POST", train, 422, "at least 2 trajectories", json={"groups": [one]})
    await expect_refused(server, "POST", train, 422, "at least 2 trajectories", json={"groups": [{"trajectories": []}]})
    await expect_refused(
        server,
        "POST",
        train,
        422,
        "invalid request",
        json={"groups": [{"trajectories": [{"items": [{"role": "wizard", "content": "x"}], "reward": 1}] * 2}]},
    )
    await expect_refused(
        server,
        "POST",
        train,
        422,
        "invalid request",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    for bad in (math.nan, math.inf):
        group = {"trajectories": [dict(t, reward=bad) for t in good["trajectories"]]}
        await expect_refused(
            server,
            "POST",
            train,
            422,
            "finite",
            content=json.dumps({"groups": [group]}),
            headers={"content-type": "application/json"},
        )
    await expect_refused(
        server, "POST", "/art/models/nope/train", 404, "not registered", code="not_registered", json={"groups": [good]}
    )
    await expect_refused(server, "POST", "/v1/chat/completions", 404, "not registered", json=CHAT | {"model": "x"})
    await expect_refused(
        server, "POST", "/v1/chat/completions", 400, "exceeds this server's limit", json=CHAT | {"max_tokens": 10_000}
    )
    await expect_refused(
        server,
        "POST",
        "/v1/chat/completions",
        413,
        "larger than the server's limit",
        content=b"{" + b" " * 2_100_000 + b"}",
        headers={"content-type": "application/json"},
    )
    await expect_refused(
        server, "POST", train, 401, "API key", json={"groups": [good]}, headers={"authorization": "Bearer wrong"}
    )
    await expect_refused(server, "GET", "/v1/models", 401, "API key", headers={"authorization": ""})
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/embeddings"), ("GET", "/v1/chat/completions")):
        await expect_refused(
            server,
            method,
            path,
            404,
            f"{method} {path} is not served here: art-sky serves POST /v1/chat/completions",
            json={"model": "tiny", "prompt": "x"},
        )
    await expect_refused(
        server,
        "POST",
        "/art/models",
        422,
        "base model '/no/such/model' does not exist",
        json={"name": "other", "project": "p", "base_model": "/no/such/model"},
    )


async def test_a_base_model_that_cannot_load_is_refused_at_once_saying_the_fix(server, monkeypatch, tmp_path):
    """Before any weight loads, in seconds: art-sky's own names with a did-you-mean, a directory that is not there
    or holds no model, a hub id where the Hub cannot be reached (said at once, not after the Hub client's minute of
    retries; the Hub here is a closed port, so the test behaves the same on a machine with internet)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    usage = (
        "use 'art-sky/tiny', a local Hugging Face model directory on the cluster, or a hub id (owner/name) on a "
        "node with internet access"
    )
    machine = f"the server's machine ({socket.gethostname()}), which reads it"
    cases = {
        "art-sky/tiney": "base model 'art-sky/tiney' is not one of art-sky's own models (art-sky/tiny): did you mean "
        "'art-sky/tiny'?",
        "art-sky/qwen": f"base model 'art-sky/qwen' is not one of art-sky's own models (art-sky/tiny): {usage}",
        "/no/such/model": f"base model '/no/such/model' does not exist on {machine}: {usage}",
        str(tmp_path): f"base model {str(tmp_path)!r} is no Hugging Face model directory on {machine}: it has no "
        "config.json (save the model with `save_pretrained`, or give the directory that holds config.json)",
        "not a hub id!": f"base model 'not a hub id!' is neither a directory on this server's machine nor a hub id "
        f"(owner/name): {usage}",
    }
    for base_model, message in cases.items():
        started = time.monotonic()
        response = await server.post("/art/models", json={"name": "other", "project": "p", "base_model": base_model})
        assert time.monotonic() - started < 10, base_model
        assert (response.status_code, response.json()) == (422, {"detail": message, "code": "invalid"})
    started = time.monotonic()
    response = await server.post("/art/models", json={"name": "other", "project": "p", "base_model": "Qwen/Qwen3-0.6B"})
    assert time.monotonic() - started < 10
    reason, _, fix = response.json()["detail"].partition("): ")
    assert response.status_code == 422 and reason.startswith(
        "base model 'Qwen/Qwen3-0.6B' is a hub id, and this node cannot reach the Hugging Face Hub "
        "(http://127.0.0.1:9: "
    ), reason
    assert fix == (
        "give a local model directory on the cluster, download it into the node's Hugging Face cache first (`hf "
        "download Qwen/Qwen3-0.6B`), or run the server where there is internet access"
    )
    assert (await server.get("/health", headers={"authorization": f"Bearer {API_KEY}"})).json()["models"] == ["tiny"]


async def test_trajectories_that_cannot_be_built_are_skipped_and_reported(server):
    """One bad trajectory never fails the batch: it is left out, counted and named with the reason."""
    good = await sampled_group(server)
    bad = [
        {**good["trajectories"][0], "items": [{"role": "user", "content": "hi"}]},  # nothing sampled
        {**good["trajectories"][1], "items": []},
        {
            **good["trajectories"][2],
            "items": [{"role": "user", "content": "hi"}, {"kind": "choice", "token_ids": [10**6]}],
        },
    ]
    status, lines = await train_lines(server, "tiny", {"groups": [good, {"trajectories": bad}]})
    assert status == 200 and lines[-1]["type"] == "result", lines
    result = lines[-1]
    assert result["metrics"]["num_trajectories_skipped"] == 3 and result["metrics"]["num_groups_skipped"] == 1
    assert result["metrics"]["trained_tokens"] == result["metrics"]["trained_tokens_exact"] > 0
    assert [line.split(":")[0] for line in result["skipped"]] == [f"group 1, trajectory {t}" for t in range(3)]
    assert "no sampled turn" in result["skipped"][0] and "outside the model's vocabulary" in result["skipped"][2]


async def test_api_key_is_accepted_when_right(server):
    response = await server.get("/v1/models", headers={"authorization": f"Bearer {API_KEY}"})
    ids = [m["id"] for m in response.json()["data"]]
    assert ids[0] == "tiny" and all(i.startswith("tiny@") for i in ids[1:])


async def test_a_chunked_oversize_body_gets_413_before_any_work(server):
    async def chunks(total: int):
        yield b'{"groups": [{"trajectories": ['
        for _ in range(total // 65536):
            yield b" " * 65536
        yield b"]}]}"

    for path, size in (("/art/models/tiny/train", 2_100_000), ("/v1/chat/completions", 1_100_000)):
        response = await server.post(path, content=chunks(size), headers={"content-type": "application/json"})
        assert response.status_code == 413, response.text
        assert "larger than the server's limit" in response.json()["detail"]


@pytest.mark.parametrize(
    "item, field",
    [
        ({"kind": "choice", "content": "a", "token_ids": [-1]}, "token_ids.0"),
        ({"kind": "choice", "content": "a", "token_ids": [1], "logprobs": [0.5]}, "logprobs.0"),
        ({"content": "no role"}, "role"),
        ({"role": "wizard", "content": "x"}, "role"),
        ({"role": "user", "content": 7}, "content"),
        ({"role": "user", "content": [{"text": "a part with no type"}]}, "content"),
    ],
)
async def test_a_bad_wire_field_is_a_422_naming_its_trajectory_and_field(server, item, field):
    good = {"items": [{"role": "user", "content": "hi"}, {"kind": "choice", "content": "a"}], "reward": 1.0}
    bad = {"items": [{"role": "user", "content": "hi"}, item], "reward": 0.0}
    response = await server.post("/art/models/tiny/train", json={"groups": [{"trajectories": [good, bad]}]})
    assert response.status_code == 422, response.text
    assert "groups.0.trajectories.1.items.1" in response.json()["detail"]
    assert field in response.json()["detail"]


@pytest.mark.parametrize(
    "messages",
    [
        [{"content": "no role"}],
        [{"role": "wizard", "content": "x"}],
        [{"role": "user", "content": 7}],
        "not a list",
        [],
    ],
)
async def test_a_chat_message_no_client_would_send_is_a_400(server, messages):
    response = await server.post("/v1/chat/completions", json=CHAT | {"messages": messages})
    assert response.status_code == 400, response.text
    assert "messages" in response.json()["error"]["message"]


async def test_a_maximum_size_request_does_not_stall_the_others(server):
    """While the largest train request the server takes is read, parsed and built (its trajectories are too long to
    train: all the work is the server's CPU), /health and a completion still answer within a second."""
    import asyncio
    import time

    long = "x" * 5000  # over the model's max_seq_length once rendered: built, then skipped
    trajectory = {"items": [{"role": "user", "content": long}, {"kind": "choice", "content": long}], "reward": 0.0}
    groups = [{"trajectories": [trajectory, dict(trajectory, reward=1.0)]}] * 90
    body = json.dumps({"groups": groups}).encode()
    assert 1_500_000 < len(body) < 2_000_000  # the fixture's limit

    began = time.monotonic()
    big = asyncio.create_task(
        server.post("/art/models/tiny/train", content=body, headers={"content-type": "application/json"})
    )
    waits = []
    while not big.done():
        start = time.monotonic()
        assert (await server.get("/health")).status_code == 200
        middle = time.monotonic()
        await completion(server, max_tokens=1)
        waits.append((middle - start, time.monotonic() - middle))
        await asyncio.sleep(0.05)
    took = time.monotonic() - began
    assert (await big).status_code == 200
    assert len(waits) >= 2, f"the large request took {took:.2f}s: too short to measure anything"
    # /health never waits; a completion may wait for the step's short commit (the device gate), never for the
    # whole request (generous bounds: a loaded 2-core machine)
    assert max(health for health, _ in waits) < 1.0, (waits, took)
    assert max(chat for _, chat in waits) < max(1.0, took / 2), (waits, took)
