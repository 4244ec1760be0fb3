"""One rollout-and-train round through any backend: what every "then a rollout and a training step" test does, and
the wire form of a sampled choice for tests that speak HTTP to a server."""

from __future__ import annotations

import asyncio

import art_sky

PROMPT = [{"role": "user", "content": "say hi"}]


async def rollout_and_train(backend: art_sky.Backend, *, project: str, limit: float = 600) -> art_sky.TrainableModel:
    """Register model "agent", sample two completions through the backend's OpenAI endpoint (rewarded 0 and 1)
    and train one step on them; returns the model, now at step 1 or more."""
    model = art_sky.TrainableModel(name="agent", project=project, base_model="art-sky/tiny")
    await model.register(backend)
    step = await model.get_step()
    trajectories = []
    for reward in (0.0, 1.0):
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=PROMPT, max_tokens=8, temperature=1.0
        )
        assert completion.choices[0].logprobs is not None
        trajectories.append(art_sky.Trajectory(messages_and_choices=[*PROMPT, completion.choices[0]], reward=reward))
    metrics = await asyncio.wait_for(model.train([art_sky.TrajectoryGroup(trajectories)]), limit)
    assert metrics["step"] == step + 1
    return model


def trajectory(choice: dict, reward: float) -> dict:
    """A trainable trajectory (wire form) from a sampled choice with token-id logprobs, after the prompt "hi": the
    engine's prompt and sampled ids, so it trains exactly."""
    ids = [int(t["token"].removeprefix("token_id:")) for t in choice["logprobs"]["content"]]
    return {
        "items": [
            {"role": "user", "content": "hi"},
            {
                "kind": "choice",
                "content": choice["message"]["content"],
                "token_ids": ids,
                "logprobs": [t["logprob"] for t in choice["logprobs"]["content"]],
                "prompt_token_ids": choice["prompt_token_ids"],
            },
        ],
        "reward": reward,
    }
