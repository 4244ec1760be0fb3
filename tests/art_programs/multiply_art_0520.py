"""An openpipe-art 0.5.20+ program (ART's own idiom, as its train-rl skill writes one) on an art-sky backend: the
only line that differs from ART's own is the one marked BACKEND. Python >= 3.12, with the real openpipe-art.

It samples through ART's own client and litellm_completion_params() (which send ART's extra_body: return_token_ids,
return_tokens_as_token_ids, chat_template_kwargs, nvext), trains with backend.train and ART's newer keywords, logs
with model.log, records a group the capture way (art.trajectory), samples an older step under exact_adapter_lease,
prunes checkpoints, runs train_sft, trains a step without a checkpoint, trains a second run_name of the name beside
the first (from step 0, served apart), and runs
ART's PipelineTrainer with its eval. It prints what it saw as JSON (the last line) for tests/test_openpipe_art.py.
"""

import asyncio
import json
import os
import sys

import art
import litellm
from art.pipeline_trainer import PipelineTrainer

import art_sky

PROJECT = "art-latest"


def reward_of(text: str, rank: int) -> float:
    """The share of digits in the reply, plus a tie-breaker so that no group's rewards are all equal."""
    text = text.strip()
    return sum(c.isdigit() for c in text) / max(len(text), 1) + 0.01 * rank


async def rollout(model: art.TrainableModel, a: int, rank: int) -> art.Trajectory:
    messages = [{"role": "user", "content": f"What is {a} * {a + 1}? Answer with just the number."}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=4
    )
    choice = completion.choices[0]
    return art.Trajectory(
        messages_and_choices=[*messages, choice], reward=reward_of(choice.message.content or "", rank)
    )


async def captured(model: art.TrainableModel, a: int, rank: int) -> None:
    """A two-turn rollout recorded ART's capture way: only requests, the trajectory built from what was sent."""
    client = model.openai_client()
    messages = [{"role": "user", "content": f"Say {a}."}]
    first = await client.chat.completions.create(model=model.get_inference_name(), messages=messages, max_tokens=3)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Again."}]
    second = await client.chat.completions.create(model=model.get_inference_name(), messages=messages, max_tokens=3)
    art.current_trajectory(require=True).reward = reward_of(second.choices[0].message.content or "", rank)


async def groups_of(model: art.TrainableModel) -> list[art.TrajectoryGroup]:
    return await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(model, a, rank) for rank in range(4)) for a in range(2)],
        pbar_desc="gather",
        max_exceptions=0,
    )


async def pipeline_rollout(model: art.TrainableModel, scenario: dict, config: None) -> art.TrajectoryGroup:
    """One request with n=4 choices, as ART's PipelineTrainer examples write it."""
    messages = [{"role": "user", "content": scenario["prompt"]}]
    response = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=3, n=4
    )
    return art.TrajectoryGroup(
        [
            art.Trajectory(
                messages_and_choices=[*messages, choice], reward=reward_of(choice.message.content or "", rank)
            )
            for rank, choice in enumerate(response.choices)
        ]
    )


async def pipeline_eval(model: art.TrainableModel, step: int, config: None) -> list[art.Trajectory]:
    messages = [{"role": "user", "content": "What is 2 * 3?"}]
    response = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(step), messages=messages, max_tokens=3
    )
    pipeline_eval.models.append(response.model)
    choice = response.choices[0]
    return [art.Trajectory(messages_and_choices=[*messages, choice], reward=reward_of(choice.message.content or "", 0))]


pipeline_eval.models = []


async def main() -> None:
    backend = art_sky.LocalBackend()  # BACKEND: an ART program has `from art.local import LocalBackend` here
    model = art.TrainableModel(
        name="multiply",
        run_name="run-a",
        project=PROJECT,
        base_model="art-sky/tiny",
        lora_config=art.dev.LoRAConfig(rank=4, alpha=8),
    )
    await model.register(backend)
    seen: dict = {"steps": [], "trained_tokens": []}

    reply = await litellm.acompletion(
        messages=[{"role": "user", "content": "hi"}], max_tokens=2, **model.litellm_completion_params()
    )  # ART's extra_body through litellm
    seen["litellm"] = [reply.model, len(reply.choices[0].provider_specific_fields["token_ids"])]

    groups = await groups_of(model)
    result = await backend.train(model, groups, learning_rate=1e-4)  # ART's defaults: cispo, token-level ratios
    seen["result_is_art"] = isinstance(result, art.TrainResult) and result.checkpoint_path is not None
    if result.checkpoint_ready is not None:  # ART's signal that a checkpoint written in the background is on disk
        await result.checkpoint_ready
    seen["checkpoint_on_disk"] = result.checkpoint_ready is None or os.path.isdir(result.checkpoint_path)
    await model.log(groups, metrics=result.metrics, step=result.step, split="train")
    seen["steps"].append(result.step)
    seen["trained_tokens"].append(result.metrics["trained_tokens_exact"])

    groups = await groups_of(model)
    result = await backend.train(
        model,
        groups,
        learning_rate=1e-4,
        loss_fn="ppo",
        importance_sampling_level="sequence",
        kl_penalty_coef=0.1,
        kl_penalty_source="sample",
        optimizer_save_interval=5,
        final_training_step=10,
        grad_accumulation_sequences=4,
    )
    await model.log(groups, metrics=result.metrics, step=result.step, split="train")
    seen["steps"].append(result.step)
    seen["gradient_steps"] = [result.metrics["sequences"], result.metrics.get("num_gradient_steps", 1.0)]

    captured_groups = [
        await art.trajectory_group([art.trajectory(captured(model, a, rank)) for rank in range(4)]) for a in range(2)
    ]
    seen["captured_exchanges"] = len(captured_groups[0].trajectories[0].exchanges.chat_completions)
    result = await backend.train(model, captured_groups, learning_rate=1e-4)
    seen["steps"].append(result.step)
    seen["captured_exact_tokens"] = result.metrics["trained_tokens_exact"]
    seen["captured_sequences"] = result.metrics["sequences"]

    async with backend.exact_adapter_lease(model, 1):
        name = model.get_inference_name()
        completion = await model.openai_client().chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        seen["leased"] = [name, completion.model]
        await model.log(await groups_of(model), split="val")  # step 3's val/reward: the best and the newest
        await model.delete_checkpoints()
        seen["kept_while_leased"] = sorted(c.step for c in await backend.list_checkpoints(model))
    await model.delete_checkpoints()
    seen["kept_after_lease"] = sorted(c.step for c in await backend.list_checkpoints(model))

    conversations = [
        art.Trajectory(
            messages_and_choices=[
                {"role": "system", "content": "Answer with digits."},
                {"role": "user", "content": f"What is {a} + {a}?"},
                {"role": "assistant", "content": str(2 * a)},
                {"role": "user", "content": f"And {a} * {a}?"},
                {"role": "assistant", "content": str(a * a)},
            ],
            reward=0.0,
        )
        for a in range(4)
    ]
    await model.train_sft(conversations, art.TrainSFTConfig(learning_rate=1e-3, batch_size=2, assistant_turns="last"))
    seen["step_after_sft"] = await model.get_step()

    groups = await groups_of(model)
    result = await backend.train(model, groups, learning_rate=1e-4, save_checkpoint=False)
    seen["unsaved"] = [result.step, result.checkpoint_path]
    seen["get_step"] = await model.get_step()

    second = art.TrainableModel(name="multiply", run_name="run-b", project=PROJECT, base_model="art-sky/tiny")
    await second.register(backend)  # a second run of the name, beside run-a on the same backend
    seen["second_run"] = [second.get_inference_name(), await second.get_step()]
    result = await backend.train(second, await groups_of(second), learning_rate=1e-4)
    completion = await second.openai_client().chat.completions.create(
        model=second.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    seen["runs_apart"] = [result.step, await model.get_step(), model.get_inference_name(), completion.model]
    await backend.close()

    backend = art_sky.LocalBackend()  # BACKEND
    second = art.TrainableModel(name="multiply", run_name="run-b", project=PROJECT, base_model="art-sky/tiny")
    await second.register(backend)
    seen["second_run_step"] = await second.get_step()

    piped = art.TrainableModel(name="piped", run_name="piped-1", project=PROJECT, base_model="art-sky/tiny")
    await piped.register(backend)
    trainer = PipelineTrainer(
        model=piped,
        backend=backend,
        rollout_fn=pipeline_rollout,
        scenarios=[{"prompt": f"Count to {n}."} for n in range(100)],
        config=None,
        learning_rate=1e-4,
        eval_fn=pipeline_eval,
        max_steps=3,
        eval_every_n_steps=2,
        eval_at_start=False,
        log_interval_seconds=3600,
    )
    await trainer.train(handle_signals=False)
    seen["pipeline_step"] = await piped.get_step()
    seen["pipeline_eval_models"] = pipeline_eval.models
    await backend.close()
    print(json.dumps(seen))


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
