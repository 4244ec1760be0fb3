"""The cluster server: OpenAI-compatible completions, training, and a clear 4xx for every bad input."""

import json
import math

import pytest

from conftest import API_KEY, train_lines

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}


async def completion(server, **overrides):
    response = await server.post("/v1/chat/completions", json=CHAT | overrides)
    assert response.status_code == 200, response.text
    return response.json()


def trajectory(choice: dict, reward: float) -> dict:
    ids = [int(t["token"].removeprefix("token_id:")) for t in choice["logprobs"]["content"]]
    return {"items": [{"role": "user", "content": "hi"},
                      {"kind": "choice", "content": choice["message"]["content"], "token_ids": ids,
                       "logprobs": [t["logprob"] for t in choice["logprobs"]["content"]]}],
            "reward": reward}


async def sampled_group(server, n=4):
    body = await completion(server, n=n, logprobs=True, return_tokens_as_token_ids=True, seed=1)
    return {"trajectories": [trajectory(c, float(i % 2)) for i, c in enumerate(body["choices"])]}


async def test_health_needs_no_key_and_reports_engine(server):
    response = await server.get("/health", headers={"authorization": ""})
    assert response.status_code == 200
    assert response.json()["engine"] == "portable" and response.json()["models"] == ["tiny"]


async def test_completion_parameters(server):
    body = await completion(server, n=3, max_tokens=5, logprobs=True, top_logprobs=2,
                            return_tokens_as_token_ids=True, seed=7)
    assert len(body["choices"]) == 3
    for choice in body["choices"]:
        tokens = choice["logprobs"]["content"]
        assert 1 <= len(tokens) <= 5
        assert all(t["token"].startswith("token_id:") and t["logprob"] <= 0 for t in tokens)
        assert all(len(t["top_logprobs"]) == 2 for t in tokens)
        assert choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] == sum(len(c["logprobs"]["content"]) for c in body["choices"])
    again = await completion(server, n=3, max_tokens=5, logprobs=True, top_logprobs=2,
                             return_tokens_as_token_ids=True, seed=7)
    assert [c["message"] for c in again["choices"]] == [c["message"] for c in body["choices"]]


async def test_greedy_stop_and_max_completion_tokens(server):
    greedy = await completion(server, temperature=0, max_completion_tokens=12)
    text = greedy["choices"][0]["message"]["content"]
    assert (await completion(server, temperature=0, max_completion_tokens=12))["choices"][0]["message"]["content"] \
        == text
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
    status, lines = await train_lines(server, "tiny", {"groups": [await sampled_group(server)],
                                                       "config": {"learning_rate": 0.05}})
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
    return sorted((p.relative_to(root).as_posix(), p.stat().st_mtime_ns) for p in root.rglob("*")
                  if p.is_file() and p.name != "history.jsonl")


async def expect_refused(server, method, path, status, match, **kwargs):
    before = checkpoint_state(server)
    step = (await server.get("/art/models/tiny")).json()["step"]
    response = await server.request(method, path, **kwargs)
    assert response.status_code == status, response.text
    assert match in response.json()["detail"]
    # the server keeps serving and nothing was trained or written
    assert (await server.get("/art/models/tiny")).json()["step"] == step
    assert checkpoint_state(server) == before
    await completion(server, max_tokens=1)


async def test_bad_inputs_get_clear_4xx(server):
    good = await sampled_group(server)
    one = {"trajectories": good["trajectories"][:1]}
    no_logprobs = {"trajectories": [{**t, "items": [t["items"][0], {"kind": "choice", "content": "x"}]}
                                    for t in good["trajectories"]]}
    train = "/art/models/tiny/train"
    await expect_refused(server, "POST", train, 422, "groups", json={"groups": []})
    await expect_refused(server, "POST", train, 422, "at least 2 trajectories", json={"groups": [one]})
    await expect_refused(server, "POST", train, 422, "at least 2 trajectories",
                         json={"groups": [{"trajectories": []}]})
    await expect_refused(server, "POST", train, 422, "logprobs=True", json={"groups": [no_logprobs]})
    await expect_refused(server, "POST", train, 422, "invalid request", json={"groups": [{"trajectories": [
        {"items": [{"role": "wizard", "content": "x"}], "reward": 1}] * 2}]})
    await expect_refused(server, "POST", train, 422, "invalid request", content=b"{not json",
                         headers={"content-type": "application/json"})
    for bad in (math.nan, math.inf):
        group = {"trajectories": [dict(t, reward=bad) for t in good["trajectories"]]}
        await expect_refused(server, "POST", train, 422, "finite", content=json.dumps({"groups": [group]}),
                             headers={"content-type": "application/json"})
    await expect_refused(server, "POST", "/art/models/nope/train", 404, "not registered", json={"groups": [good]})
    await expect_refused(server, "POST", "/v1/chat/completions", 404, "not registered", json=CHAT | {"model": "x"})
    await expect_refused(server, "POST", "/v1/chat/completions", 400, "exceeds this server's limit",
                         json=CHAT | {"max_tokens": 10_000})
    await expect_refused(server, "POST", "/v1/chat/completions", 413, "larger than the server's limit",
                         content=b"{" + b" " * 2_100_000 + b"}", headers={"content-type": "application/json"})
    await expect_refused(server, "POST", train, 401, "API key", json={"groups": [good]},
                         headers={"authorization": "Bearer wrong"})
    await expect_refused(server, "GET", "/v1/models", 401, "API key", headers={"authorization": ""})
    await expect_refused(server, "POST", "/art/models", 422, "cannot load base model",
                         json={"name": "other", "project": "p", "base_model": "/no/such/model"})


async def test_api_key_is_accepted_when_right(server):
    response = await server.get("/v1/models", headers={"authorization": f"Bearer {API_KEY}"})
    assert [m["id"] for m in response.json()["data"]] == ["tiny"]
