"""Pipelined against sequential GRPO on the local cluster server, where rollouts wait on an environment.

The same run twice on one server (`art.LocalBackend`, the tiny model; the demo's digits task): `--steps` steps of
`--groups` groups of `--group-size` rollouts, each rollout `--turns` turns that wait `--wait-min`..`--wait-max`
seconds on a simulated environment after each completion (the same seeded waits and prompts both times).
Sequential: gather, then train. Pipelined (`art_sky.pipeline`): batch i+1 is gathered while step i trains.
Prints each step's wall time and mean rollout reward for both (the speedup must not be bought with learning), then
`pipelined/sequential speedup X.XX` (target >= 1.6 where rollout waiting dominates) and, as its last line,
`overlap efficiency X.XX`: (sequential wall - pipelined wall) / min(total rollout time, total training time), both
totals from the sequential run, where the phases do not overlap. 1.0: the shorter phase was hidden entirely behind
the longer one; it says whether the overlap works, where the speedup also moves with the phases' ratio and with
what else the machine runs.

    python bench/bench_pipeline.py
    python bench/bench_pipeline.py --turns 1   # one completion per rollout: its sampling and the step share the device
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

import art_sky as art
from art_sky.demo import PROMPTS, digit_share


def batch_maker(model: art.TrainableModel, args: argparse.Namespace, seed: int):
    """Step i's groups: seeded per step, so both runs see the same prompts, sampling seeds and waits."""

    async def rollout(prompt: str, rng: random.Random) -> art.Trajectory:
        messages = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": prompt}]
        items, rewards = list(messages), []
        for turn in range(args.turns):
            completion = await model.openai_client().chat.completions.create(
                model=model.inference_model_name,
                messages=messages,
                max_tokens=8,
                temperature=1.0,
                seed=rng.randrange(2**31),
            )
            choice = completion.choices[0]
            rewards.append(digit_share(choice.message.content))
            await asyncio.sleep(rng.uniform(args.wait_min, args.wait_max))  # the environment answers
            if turn + 1 < args.turns:
                follow = {"role": "user", "content": "And another?"}
                messages = [*messages, {"role": "assistant", "content": choice.message.content or ""}, follow]
                items += [choice, follow]
            else:
                items.append(choice)
        return art.Trajectory(messages_and_choices=items, reward=sum(rewards) / len(rewards))

    async def batch(step: int) -> list[art.TrajectoryGroup]:
        rng = random.Random(seed * 10_000 + step)
        groups = [
            [rng.choice(PROMPTS), [random.Random(rng.randrange(2**31)) for _ in range(args.group_size)]]
            for _ in range(args.groups)
        ]
        return await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(prompt, r) for r in rngs) for prompt, rngs in groups), pbar_desc=None
        )

    return batch


PHASES: dict[str, float] = {"rollouts": 0.0, "training": 0.0}  # the sequential run's time in each phase


async def sequential(model: art.TrainableModel, args, config) -> tuple[list[float], list[float]]:
    batch, times, rewards = batch_maker(model, args, args.seed), [], []
    for i in range(args.steps):
        start = time.perf_counter()
        groups = await batch(i)
        gathered = time.perf_counter()
        await model.train(groups, config)
        times.append(time.perf_counter() - start)
        PHASES["rollouts"] += gathered - start
        PHASES["training"] += time.perf_counter() - gathered
        rewards.append(sum(t.reward for g in groups for t in g) / sum(len(g) for g in groups))
        print(f"  sequential step {i + 1:2d}  {times[-1]:6.2f} s  reward {rewards[-1]:.3f}", flush=True)
    return times, rewards


async def pipelined(model: art.TrainableModel, args, config) -> tuple[list[float], list[float]]:
    times, rewards, last = [], [], [time.perf_counter()]

    def on_step(i: int, metrics: dict[str, float]) -> None:
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now
        rewards.append(metrics["reward"])
        print(
            f"  pipelined  step {i + 1:2d}  {times[-1]:6.2f} s  reward {rewards[-1]:.3f}  steps off policy "
            f"{metrics['steps_off_policy']:.2f}  dropped {int(metrics['discarded_stale_groups'])}",
            flush=True,
        )

    await art.pipeline(model, batch_maker(model, args, args.seed), args.steps, config=config, on_step=on_step)
    return times, rewards


async def main(args: argparse.Namespace) -> None:
    config = art.TrainConfig(learning_rate=args.learning_rate, loss_fn=args.loss_fn)
    with tempfile.TemporaryDirectory() as tmp:
        backend = art.LocalBackend(path=Path(tmp) / ".art")
        try:
            warm = art.TrainableModel(name="bench-warm-up", project="bench", base_model="art-sky/tiny")
            await warm.register(backend)  # the first completions and step pay one-off costs: neither run does
            await warm.train(await batch_maker(warm, args, args.seed + 1)(0), config)
            runs = {}
            for name, run in (("sequential", sequential), ("pipelined", pipelined)):
                model = art.TrainableModel(name=f"bench-{name}", project="bench", base_model="art-sky/tiny")
                await model.register(backend)
                print(
                    f"{name}: {args.steps} steps, {args.groups}x{args.group_size} rollouts of {args.turns} turn(s), "
                    f"environment waits {args.wait_min}-{args.wait_max} s per turn",
                    flush=True,
                )
                start = time.perf_counter()
                times, rewards = await run(model, args, config)
                runs[name] = (time.perf_counter() - start, rewards)
        finally:
            await backend.close()
    for name, (total, rewards) in runs.items():
        print(
            f"{name:10s}  wall {total:6.1f} s  reward first {rewards[0]:.3f}  last-3 mean "
            f"{sum(rewards[-3:]) / len(rewards[-3:]):.3f}"
        )
    print(f"sequential phases: rollouts {PHASES['rollouts']:.1f} s, training {PHASES['training']:.1f} s")
    print(f"pipelined/sequential speedup {runs['sequential'][0] / runs['pipelined'][0]:.2f}")
    hidden = runs["sequential"][0] - runs["pipelined"][0]
    print(f"overlap efficiency {hidden / min(PHASES.values()):.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--turns", type=int, default=2)  # agents: a tool call, its answer, the reply
    parser.add_argument("--wait-min", type=float, default=0.5)
    parser.add_argument("--wait-max", type=float, default=2.0)
    parser.add_argument("--learning-rate", type=float, default=5e-3)
    parser.add_argument("--loss-fn", choices=["ppo", "cispo"], default="cispo")
    parser.add_argument("--seed", type=int, default=0)
    asyncio.run(main(parser.parse_args()))
