"""The portable engine and the PEFT trainer on CUDA, through the real server app: a random-weight Qwen2 (0.5B
shape unless ART_SKY_GPU_SHAPE says otherwise) is registered, sampled from, trained for two GRPO steps, and the
adapter served after training is the trained one; the engine's logprobs agree with the trainer's (no token of the
on-policy batch leaves the PPO clip range).

Needs CUDA (tests/gpu/run_gpu.sh runs it on a lent GPU); ART_SKY_GPU_RUN_ON_CPU=1 runs it on a CPU to rehearse.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from random_models import build

SHAPE = os.environ.get("ART_SKY_GPU_SHAPE", "qwen2-0.5b")
ON_CPU = os.environ.get("ART_SKY_GPU_RUN_ON_CPU") == "1"
KEY = "gpu-test-key"
RESULTS = os.environ.get("ART_SKY_GPU_RESULTS")  # a JSON file for each step's metrics (tests/gpu/run_gpu.sh)
PROMPT = [{"role": "user", "content": "Name a colour."}]

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or ON_CPU), reason="needs CUDA (ART_SKY_GPU_RUN_ON_CPU=1 rehearses it on a CPU)"
)


@pytest.fixture(scope="module")
async def server(tmp_path_factory):
    from art_sky.cluster.server import create_app
    from art_sky.settings import Settings

    cache = tmp_path_factory.mktemp("cache")
    model_dir = build(SHAPE, Path(os.environ.get("ART_SKY_CACHE_DIR", cache)))
    app = create_app(
        tmp_path_factory.mktemp("art"), KEY, Settings(engine="portable", trainer="peft", max_new_tokens_limit=64)
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://server",
        timeout=600,
        headers={"authorization": f"Bearer {KEY}"},
    ) as client:
        response = await client.post(
            "/art/models",
            json={
                "name": "gpu",
                "project": "tests",
                "base_model": str(model_dir),
                "config": {"lora_rank": 16, "lora_alpha": 32, "max_seq_length": 1024},
            },
        )
        assert response.status_code == 200, response.text
        yield client


async def sample(client: httpx.AsyncClient, n: int, seed: int) -> list[dict]:
    response = await client.post(
        "/v1/chat/completions",
        json={
            "model": "gpu",
            "messages": PROMPT,
            "n": n,
            "max_tokens": 24,
            "seed": seed,
            "logprobs": True,
            "return_tokens_as_token_ids": True,
        },
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"]


def trajectory(choice: dict, reward: float) -> dict:
    """The wire form of [prompt, choice] (what the client sends): the choice's exact sampled ids and logprobs."""
    tokens = choice["logprobs"]["content"]
    sampled = {
        "kind": "choice",
        "content": choice["message"]["content"],
        "token_ids": [int(t["token"].removeprefix("token_id:")) for t in tokens],
        "logprobs": [t["logprob"] for t in tokens],
    }
    return {"items": [*PROMPT, sampled], "reward": reward}


async def test_health_reports_cuda_and_the_stack(server):
    health = (await server.get("/health")).json()
    assert health["device"].startswith("cuda") or ON_CPU
    assert (health["engine"], health["trainer"], health["stack"]) == ("portable", "peft", "unchecked")
    assert {"torch", "transformers", "peft"} <= set(health["versions"])
    assert "cuda" in health["versions"] or ON_CPU
    print(f"\n{SHAPE}: {health['device']}, {health['versions']}")


async def test_two_grpo_steps_and_the_trained_adapter_is_served(server):
    before = await sample(server, 1, seed=7)
    recorded = []
    for step in (1, 2):
        groups = []
        for seed in range(2):
            choices = await sample(server, 4, seed=10 * step + seed)
            assert all(len(c["logprobs"]["content"]) > 0 for c in choices)
            groups.append({"trajectories": [trajectory(c, float(i % 2)) for i, c in enumerate(choices)]})
        response = await server.post(
            "/art/models/gpu/train", json={"groups": groups, "config": {"learning_rate": 1e-3}}
        )
        assert response.status_code == 200, response.text
        result = [json.loads(line) for line in response.text.splitlines() if '"result"' in line]
        assert result, response.text
        metrics = result[0]["metrics"]
        assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
        # On-policy: the trainer's logprobs of the sampled ids match the engine's, so no ratio leaves the clip range.
        assert metrics["clip_fraction"] == 0, metrics
        info = (await server.get("/art/models/gpu")).json()
        assert info["step"] == step
        recorded.append(metrics)
        print(
            f"\nstep {step}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in sorted(metrics.items()) if k.startswith(("time/", "memory/")))
        )
    if RESULTS:
        Path(RESULTS).write_text(json.dumps({"shape": SHAPE, "steps": recorded}, indent=1))
    after = await sample(server, 1, seed=7)
    old = [t["logprob"] for t in before[0]["logprobs"]["content"]]
    new = [t["logprob"] for t in after[0]["logprobs"]["content"]]
    assert old != new, "the engine still samples with the step-0 adapter"
    assert all(math.isfinite(x) for x in new)
