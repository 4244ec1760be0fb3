"""An openpipe-art 0.5 program in OpenEnv's echo pattern, on an art-sky backend (the BACKEND line is the only one
that differs from ART's own): a system prompt, one completion, the environment's reward; each rollout also keeps
a second conversation in `additional_histories`. It trains with ART's PPO loss and KL penalty, checks that a
keyword art-sky cannot honour is refused, and prints what it saw as JSON (the last line).
"""

import asyncio
import json

import art

import art_sky


class EchoEnvironment:
    """OpenEnv's echo env in miniature: it echoes the message and rewards its length (0.1 per character)."""

    def reset(self) -> str:
        return "Say something and I will echo it."

    def step(self, message: str) -> float:
        return len(message) * 0.1


async def rollout(model: art.TrainableModel, env: EchoEnvironment, seed: int) -> art.Trajectory:
    client = model.openai_client()
    messages = [
        {"role": "system", "content": "You are an agent in an echo environment."},
        {"role": "user", "content": env.reset()},
    ]
    completion = await client.chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_completion_tokens=8, logprobs=True, seed=seed
    )
    choice = completion.choices[0]
    aside = [{"role": "user", "content": "Summarise your plan."}]
    summary = await client.chat.completions.create(
        model=model.get_inference_name(), messages=aside, max_completion_tokens=4, logprobs=True
    )
    return art.Trajectory(
        messages_and_choices=[*messages, choice],
        reward=env.step(choice.message.content or ""),
        additional_histories=[art.trajectories.History(messages_and_choices=[*aside, summary.choices[0]])],
    ).finish()


async def main() -> None:
    backend = art_sky.LocalBackend()  # BACKEND: an ART program has `from art.local import LocalBackend` here
    model = art.TrainableModel(name="echo", project="art-compat", base_model="art-sky/tiny")
    await model.register(backend)
    env = EchoEnvironment()
    seen: dict = {"metrics": []}
    for step in range(2):  # each rollout its own seed: the untrained model writes the same every run
        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(model, env, 8 * step + 4 * g + i) for i in range(4)) for g in range(2)],
            pbar_desc="gather",
        )
        result = await backend.train(model, groups, learning_rate=1e-4, loss_fn="ppo", kl_penalty_coef=0.1)
        seen["metrics"].append(result.metrics)
    try:
        await backend.train(model, groups, adam_params={"beta1": 0.8})
    except Exception as exc:
        seen["refused"] = f"{type(exc).__name__}: {exc}"
    seen["get_step"] = await model.get_step()
    await backend.close()
    print(json.dumps(seen))


if __name__ == "__main__":
    asyncio.run(main())
