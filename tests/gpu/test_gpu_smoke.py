"""The production pair on a CUDA host: vLLM serves, Unsloth trains, a few GRPO steps, the adapter is reloaded;
once with vLLM's own server asleep while training (vllm-sleep), once inside Unsloth sharing its weights
(unsloth-standby).

Needs CUDA, vllm and unsloth in this Python, and ART_SKY_GPU_MODEL: a small local Hugging Face chat model
directory (e.g. Qwen2.5-0.5B-Instruct). tests/gpu/run_gpu_smoke.sh sets all of that up; elsewhere it skips.
Prints wall times and rollout tokens/s.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

import httpx
import pytest
import torch

import art_sky as art

MODEL_DIR = os.environ.get("ART_SKY_GPU_MODEL")
STEPS = 3
PROMPT = [{"role": "user", "content": "Name a colour. Answer in lower case."}]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        not all(importlib.util.find_spec(m) for m in ("vllm", "unsloth")),
        reason="needs vllm and unsloth (pip install art-sky[gpu])",
    ),
    pytest.mark.skipif(not MODEL_DIR, reason="set ART_SKY_GPU_MODEL to a local model directory"),
]


async def prompt_logprobs(backend: art.LocalBackend, model: art.TrainableModel, name: str) -> list[float]:
    """vLLM's logprobs of a fixed text under adapter `name`, asked on vLLM's own port."""
    vllm = f"http://127.0.0.1:{(await backend.health()).engine_port}/v1"
    async with httpx.AsyncClient(
        base_url=vllm, timeout=300, headers={"authorization": f"Bearer {backend.api_key}"}
    ) as http:
        response = await http.post(
            "/completions",
            json={"model": name, "prompt": "The colour of the sky is blue.", "max_tokens": 1, "prompt_logprobs": 0},
        )
    assert response.status_code == 200, response.text
    return [next(iter(entry.values()))["logprob"] for entry in response.json()["choices"][0]["prompt_logprobs"][1:]]


async def test_vllm_and_unsloth_train_and_serve(tmp_path):
    backend = art.LocalBackend(
        path=tmp_path,
        python=sys.executable,
        env={"ART_SKY_ENGINE": "vllm", "ART_SKY_TRAINER": "unsloth", "ART_SKY_GPU_SHARING": "sleep"},
    )
    model = art.TrainableModel(
        name="smoke", project="gpu", base_model=MODEL_DIR, config=art.ModelConfig(lora_rank=16, max_seq_length=2048)
    )
    started = time.perf_counter()
    try:
        await model.register(backend)
        health = await backend.health()
        assert (health.engine, health.trainer, health.gpu_sharing) == ("vllm", "unsloth", "vllm-sleep")
        print(
            f"\nregistered (vLLM up, Unsloth model loaded) in {time.perf_counter() - started:.1f}s on "
            f"{torch.cuda.get_device_name()}"
        )
        before = await prompt_logprobs(backend, model, model.name)
        client = model.openai_client()
        for step in range(1, STEPS + 1):
            rollout_started = time.perf_counter()
            groups, tokens = [], 0
            for seed in range(4):
                completion = await client.chat.completions.create(
                    model=model.name, messages=PROMPT, n=8, max_tokens=64, seed=seed
                )
                tokens += completion.usage.completion_tokens
                groups.append(
                    art.TrajectoryGroup(
                        art.Trajectory(
                            messages_and_choices=[*PROMPT, choice], reward=float(len(choice.message.content or "") < 20)
                        )
                        for choice in completion.choices
                    )
                )
            rollout = time.perf_counter() - rollout_started
            train_started = time.perf_counter()
            metrics = await model.train(groups, art.TrainConfig(learning_rate=1e-4))
            print(
                f"step {step}: rollouts {tokens} tokens in {rollout:.2f}s ({tokens / rollout:.0f} tokens/s), "
                f"train {time.perf_counter() - train_started:.2f}s, loss {metrics.get('loss', 0):.4f}, "
                f"reward {metrics['reward']:.3f}"
            )
        assert await model.get_step() == STEPS
        after = await prompt_logprobs(backend, model, model.name)
        assert after != before, "vLLM still serves the step-0 adapter"
        assert await prompt_logprobs(backend, model, f"{model.name}@0") == pytest.approx(before, abs=0.05)
        print(f"total wall time {time.perf_counter() - started:.1f}s")
    finally:
        await backend.close()


async def test_unsloth_standby_shares_the_weights_with_vllm(tmp_path):
    """vLLM inside the Unsloth trainer's process (a Qwen or Llama model): served through art-sky's /v1, trained,
    and the newest step served."""
    backend = art.LocalBackend(
        path=tmp_path, python=sys.executable, env={"ART_SKY_ENGINE": "vllm", "ART_SKY_TRAINER": "unsloth"}
    )
    model = art.TrainableModel(
        name="standby", project="gpu", base_model=MODEL_DIR, config=art.ModelConfig(lora_rank=16, max_seq_length=2048)
    )
    try:
        await model.register(backend)
        health = await backend.health()
        if health.gpu_sharing != "unsloth-standby":
            pytest.skip(f"Unsloth does not share this model's weights ({health.gpu_sharing})")
        client = model.openai_client()

        async def greedy() -> list[float]:
            completion = await client.chat.completions.create(
                model=model.name, messages=PROMPT, max_tokens=16, temperature=0
            )
            return [t.logprob for t in completion.choices[0].logprobs.content]

        before = await greedy()
        for step in range(1, STEPS + 1):
            completion = await client.chat.completions.create(
                model=model.name, messages=PROMPT, n=8, max_tokens=64, seed=step
            )
            group = art.TrajectoryGroup(
                art.Trajectory(
                    messages_and_choices=[*PROMPT, choice], reward=float(len(choice.message.content or "") < 20)
                )
                for choice in completion.choices
            )
            metrics = await model.train([group], art.TrainConfig(learning_rate=1e-4))
            print(
                f"standby step {step}: loss {metrics.get('loss', 0):.4f}, reward {metrics['reward']:.3f}, "
                f"GPU memory in use {torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]:,} bytes"
            )
        assert await model.get_step() == STEPS
        assert await greedy() != before, "the engine still samples with the step-0 adapter"
    finally:
        await backend.close()
