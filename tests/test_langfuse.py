"""Langfuse: rollouts made through Langfuse's OpenAI wrapper train unchanged, and with Langfuse's keys set each
trained (or logged) group's rollouts reach Langfuse as traces with their rewards as scores, tagged with the model and
the step. What the SDK sends is read off the wire by a real HTTP server standing in for Langfuse's host: its spans
over OTLP/HTTP (decoded with OpenTelemetry's own protobuf types) and its scores to Langfuse's score API."""

from __future__ import annotations

import base64
import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import art_sky as art

pytest.importorskip("langfuse", reason='the langfuse extra: pip install "art-sky[langfuse]"')
pytestmark = pytest.mark.slow

QUESTION = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 2?"}]
REWARDS = (0.0, 1.0, 3.0)
KEYS = ("pk-lf-art-sky-test", "sk-lf-art-sky-test")


class LangfuseHost:
    """An HTTP server where Langfuse's host would be: records each request's path, headers and decoded body."""

    def __init__(self):
        self.requests: list[tuple[str, dict[str, str], object]] = []
        host = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path.endswith("/otel/v1/traces"):
                    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

                    decoded: object = ExportTraceServiceRequest.FromString(body)
                    status, reply, kind = 200, b"", "application/x-protobuf"
                else:
                    decoded = json.loads(body or b"null")
                    status, reply, kind = 202, b'{"message": "Accepted"}', "application/json"
                host.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}, decoded))
                self.send_response(status)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list:
        return [
            span
            for path, _, request in self.requests
            if path.endswith("/otel/v1/traces")
            for resource in request.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]

    def scores(self) -> list[dict]:
        found = []
        for path, _, body in self.requests:
            if path.endswith("/api/public/scores"):
                found += body if isinstance(body, list) else body.get("scores", [body])
        return found


def attributes(span) -> dict:
    """A span's attributes as Python values (arrays as lists)."""

    def value(v):
        kind = v.WhichOneof("value")
        return [value(item) for item in v.array_value.values] if kind == "array_value" else getattr(v, kind)

    return {a.key: value(a.value) for a in span.attributes}


@pytest.fixture
def langfuse_host(monkeypatch):
    host = LangfuseHost()
    monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", KEYS[0])
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", KEYS[1])
    monkeypatch.setenv("LANGFUSE_HOST", host.url)
    yield host
    host.server.shutdown()


async def test_langfuse_openai_rollouts_train_and_reach_langfuse_as_traces_with_scores(langfuse_host, tmp_path):
    from langfuse import LangfuseOtelSpanAttributes as A
    from langfuse import get_client
    from langfuse.openai import AsyncOpenAI

    backend = art.LocalBackend(path=tmp_path / "art")
    model = art.TrainableModel(name="traced", project="langfuse", base_model="art-sky/tiny")
    try:
        await model.register(backend)
        client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)

        async def rollout(reward: float) -> art.Trajectory:
            completion = await client.chat.completions.create(
                model=model.name, messages=QUESTION, max_tokens=4, logprobs=True
            )
            return art.Trajectory(
                messages_and_choices=[*QUESTION, completion.choices[0]], reward=reward, metrics={"answered": 1.0}
            )

        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(reward) for reward in REWARDS) for _ in range(2)), pbar_desc=None
        )
        metrics = await model.train(groups, config=art.TrainConfig(learning_rate=1e-3))
        # the wrapper's choices are the SDK's own, with the engine's ids: every token trains exactly
        assert metrics["step"] == 1 and metrics["num_trajectories_skipped"] == 0
        assert metrics["trained_tokens"] > 0 and metrics["trained_tokens_rerendered"] == 0
        await model.log(groups[:1], split="val")
        get_client().flush()
    finally:
        await backend.close()

    auth = "Basic " + base64.b64encode(":".join(KEYS).encode()).decode()
    assert langfuse_host.requests and all(
        headers.get("authorization") == auth for _, headers, _ in langfuse_host.requests
    )
    spans = {span.span_id.hex(): (span, attributes(span)) for span in langfuse_host.spans()}
    # the wrapper's own generations: one per completion, naming the model and the step that sampled it
    generations = [a for _, a in spans.values() if a.get(A.OBSERVATION_TYPE) == "generation"]
    assert len(generations) == 6 and {a.get(A.OBSERVATION_MODEL) for a in generations} == {"traced@0"}
    # art-sky's: a trace per rollout, tagged with the model, the step and the split
    rollouts = [(span, a) for span, a in spans.values() if span.name == "rollout"]
    by_split = {
        split: [(s, a) for s, a in rollouts if f"split:{split}" in a[A.TRACE_TAGS]] for split in ("train", "val")
    }
    assert len(by_split["train"]) == 6 and len(by_split["val"]) == 3 and len(rollouts) == 9
    for _, a in rollouts:
        assert {"model:traced", "step:1"} <= set(a[A.TRACE_TAGS]) and a[A.TRACE_NAME].startswith("traced ")
        assert a[A.TRACE_SESSION_ID] == "langfuse/traced/step-1"
        assert json.loads(a[A.OBSERVATION_INPUT])["messages"] == QUESTION
        assert json.loads(a[A.OBSERVATION_OUTPUT])["role"] == "assistant"
    # each rollout's reward (and its metrics) as scores of its trace
    scores = langfuse_host.scores()
    rewards = {score["traceId"]: score["value"] for score in scores if score["name"] == "reward"}
    assert rewards.keys() == {span.trace_id.hex() for span, _ in rollouts}
    assert sorted(rewards[span.trace_id.hex()] for span, _ in by_split["train"]) == sorted(REWARDS * 2)
    assert sum(score["name"] == "answered" and score["value"] == 1.0 for score in scores) == 9
