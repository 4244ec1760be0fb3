"""An openpipe-art 0.5 program, as ART's docs write one, on an art-sky backend: the only line that differs from
ART's own is the one marked BACKEND. It trains two GRPO steps, logs, prunes checkpoints and runs SFT twice, and
prints what it saw as JSON (the last line) for tests/test_openpipe_art.py.
"""

import asyncio
import json

import art
from pydantic import BaseModel

import art_sky


class RolloutConfig(BaseModel):
    """The user's own rollout settings: ART keeps them in `model.config`; they are not LoRA settings."""

    max_tokens: int = 4
    operand_limit: int = 3


async def rollout(model: art.TrainableModel, a: int, b: int) -> art.Trajectory:
    messages = [{"role": "user", "content": f"What is {a} * {b}? Answer with just the number."}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=model.config.max_tokens, logprobs=True
    )
    choice = completion.choices[0]
    text = (choice.message.content or "").strip()
    digits = sum(c.isdigit() for c in text) / max(len(text), 1)
    confidence = sum(token.logprob for token in choice.logprobs.content) / len(choice.logprobs.content)
    reward = 1.0 if text == str(a * b) else digits - 1 + 0.01 * confidence  # partial credit: digits, confidence
    trajectory = art.Trajectory(messages_and_choices=[*messages, choice], reward=reward)
    trajectory.metrics["digits"] = digits
    return trajectory


async def main() -> None:
    backend = art_sky.LocalBackend()  # BACKEND: an ART program has `from art.local import LocalBackend` here
    model = art.TrainableModel(
        name="multiply",
        project="art-compat",
        base_model="art-sky/tiny",
        config=RolloutConfig(),
        _internal_config=art.dev.InternalModelConfig(
            peft_args={"r": 4, "lora_alpha": 8}, init_args={"max_seq_length": 1024}
        ),
    )
    await model.register(backend)
    seen: dict = {"inference_name": model.inference_model_name, "steps": [], "trained_tokens": []}
    for _ in range(2):
        groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(rollout(model, a, a + 1) for _ in range(4))
                for a in range(model.config.operand_limit)
            ),
            pbar_desc="gather",
            max_exceptions=0,
        )
        await model.log(groups, split="train")
        result = await backend.train(model, groups, learning_rate=1e-4)
        await model.log(metrics=result.metrics, step=result.step, split="train")
        seen["steps"].append(result.step)
        seen["trained_tokens"].append(result.metrics["trained_tokens"])
    seen["get_step"] = await model.get_step()
    await model.log(
        await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(model, 2, 3) for _ in range(2))], pbar_desc="val"
        ),
        split="val",
    )
    await model.delete_checkpoints()

    sft_data = [
        art.Trajectory(
            messages_and_choices=[
                {"role": "user", "content": f"What is {a} * {a + 1}? Answer with just the number."},
                {"role": "assistant", "content": str(a * (a + 1))},
            ],
            reward=0.0,
        )
        for a in range(4)
    ]
    for _ in range(2):
        await model.train_sft(sft_data, art.TrainSFTConfig(learning_rate=1e-2, batch_size=2))
    seen["step_after_sft"] = await model.get_step()
    await backend.close()
    print(json.dumps(seen))


if __name__ == "__main__":
    asyncio.run(main())
