"""Watching a run: every step's numbers (the step's result, history.jsonl, W&B), `art-sky status` while a step runs,
`art-sky plot`, and a stalled step that says what the server is doing. Against a real `art-sky up --local` server,
W&B in its offline mode read back from its own run file."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import train_lines
from typer.testing import CliRunner
from wandb_runs import wandb_history

import art_sky
from art_sky.cli import app
from art_sky.cli.errors import console
from art_sky.errors import TrainingStalledError
from art_sky.settings import Settings

PRICE = 3.6  # $ per hour: a cent per ten seconds
STEP_PHASES = ("preparing", "waiting", "training", "saving", "swapping")


def digit_share(text: str) -> float:
    return sum(c.isdigit() for c in text) / max(len(text), 1)


async def rollout(model: art_sky.TrainableModel, rank: int = 0) -> art_sky.Trajectory:
    """Digits score, and each rollout of a group a quarter more than the last: no group is ever all ties (which
    would train nothing), whatever a random model samples."""
    messages = [{"role": "user", "content": "Give me a number."}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=12, temperature=1.0
    )
    choice = completion.choices[0]
    reward = (rank + digit_share(choice.message.content)) / 4
    return art_sky.Trajectory(messages_and_choices=[*messages, choice], reward=reward)


async def gather(model: art_sky.TrainableModel) -> list[art_sky.TrajectoryGroup]:
    return await art_sky.gather_trajectory_groups(
        (art_sky.TrajectoryGroup(rollout(model, rank) for rank in range(4)) for _ in range(3)), pbar_desc=None
    )


async def long_completion(model: art_sky.TrainableModel, backend: art_sky.Backend) -> asyncio.Task:
    """A completion that takes a while, once it is in flight: a step started now waits for it before its swap."""
    long = asyncio.create_task(
        model.openai_client().chat.completions.create(
            model=model.get_inference_name(),
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=768,
            n=8,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
    )
    while not (await backend.models())[0].serving.in_flight:
        assert not long.done(), long.result()
        await asyncio.sleep(0.01)
    return long


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """`art-sky up --local`, then three steps of a model that reports to W&B (offline), with `art-sky status` run
    again and again during the second step, which waits for a long completion in flight."""
    tmp = tmp_path_factory.mktemp("obs")
    with pytest.MonkeyPatch.context() as env:
        env.chdir(tmp)
        env.setattr(console, "width", 250)
        env.setenv("ART_SKY_HOME", str(tmp / "home"))
        env.setenv("ART_SKY_HOURLY_COST", str(PRICE))
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_DIR", str(tmp))
        env.setenv("WANDB_API_KEY", "x" * 40)
        runner = CliRunner()
        result = runner.invoke(app, ["up", "--local", "--name", "obs"])
        assert result.exit_code == 0, result.output
        try:
            yield asyncio.run(_three_steps(runner)) | {"tmp": tmp, "runner": runner}
        finally:
            runner.invoke(app, ["down", "--name", "obs"])


async def _three_steps(runner: CliRunner) -> dict:
    backend = art_sky.attach("obs")
    model = art_sky.TrainableModel(name="watched", project="obs", base_model="art-sky/tiny", report_metrics=["wandb"])
    try:
        await model.register(backend)
        results, returned, statuses, seen = [], [], [], []
        for step in range(3):
            groups = await gather(model)
            if step == 1:  # a long completion in flight: the step waits for it, and status shows so
                long = await long_completion(model, backend)
                training = asyncio.create_task(model.train(groups))
                # when it returned, not when a status call running then has answered too
                training.add_done_callback(lambda _: returned.append(time.monotonic()))
                while not training.done():
                    info = (await backend.models())[0]
                    seen.append(info.activity.phase)
                    if info.activity.phase in STEP_PHASES and len(statuses) < 3:
                        statuses.append(await asyncio.to_thread(runner.invoke, app, ["status"]))
                    await asyncio.sleep(0.02)
                results.append(await training)
                await long
            else:
                results.append(await model.train(groups))
                returned.append(time.monotonic())
        after = await asyncio.to_thread(runner.invoke, app, ["status"])
        model._wandb.finish()
        return {
            "results": results,
            "returned": returned,
            "statuses": statuses,
            "seen": seen,
            "after": after,
            "history": await backend.history(model.name),
        }
    finally:
        await backend.close()


@pytest.mark.slow
def test_every_step_reports_its_numbers(run):
    results = run["results"]
    assert [r["step"] for r in results] == [1.0, 2.0, 3.0]
    for metrics in results:
        assert 0 <= metrics["reward"] <= 1 and metrics["reward_std_dev"] >= 0
        assert metrics["num_groups_skipped"] >= 0
        assert metrics["trained_tokens"] > 0
        assert metrics["trained_tokens_exact"] + metrics["trained_tokens_rerendered"] > 0
        for key in ("loss", "grad_norm", "clip_fraction", "entropy"):
            assert math.isfinite(metrics[key]), key
        assert metrics["entropy"] > 0  # a random tiny model is far from certain
        assert 0 <= metrics["clip_fraction"] <= 1 and metrics["grad_norm"] >= 0
        assert metrics["learning_rate"] == art_sky.TrainConfig().learning_rate
        assert "kl" not in metrics  # measured only when the step uses a reference (beta > 0)
        assert "peak_gpu_memory_gb" not in metrics  # CUDA only: absent on CPU
        assert metrics["throughput/train_tok_per_s"] > 0 and metrics["throughput/inference_tok_per_s"] > 0
        parts = sum(
            value
            for key, value in metrics.items()  # the phases; inference's pause overlaps them
            if key.startswith("time/") and key not in ("time/step_wall_s", "time/step_inference_paused_s")
        )
        assert parts == pytest.approx(metrics["time/step_wall_s"], rel=0.05, abs=0.05)
        assert metrics["costs/gpu"] == pytest.approx(PRICE * metrics["time/step_wall_s"] / 3600)
    assert results[1]["time/step_wait_s"] > 0.1  # its swap waited for the long completion
    for metrics in results:  # the portable engine serves while a step trains: inference waited for the swap only
        assert metrics["time/step_inference_paused_s"] < metrics["time/step_trainer_s"] + metrics["time/step_wait_s"]
    # Wall time, as the client sees it: from one train() returning to the next returning (after the first step,
    # whose return also opened the W&B run: a second or so the server's clock counts as the next step's gather).
    previous, now = run["returned"][1:]
    assert results[2]["time/step_wall_s"] == pytest.approx(now - previous, rel=0.1, abs=0.3)
    cumulative = [r["costs/cum/gpu"] for r in results]
    assert cumulative[-1] == pytest.approx(sum(r["costs/gpu"] for r in results))
    assert cumulative == sorted(cumulative)


@pytest.mark.slow
def test_history_and_wandb_have_every_step(run):
    steps = [e for e in run["history"] if "train/reward" in e]
    assert [e["step"] for e in steps] == [1, 2, 3]
    assert [e["train/reward"] for e in steps] == pytest.approx([r["reward"] for r in run["results"]])
    assert all("train/entropy" in e and "time/step_wall_s" in e and "costs/cum/gpu" in e for e in steps)
    run_dir = next((run["tmp"] / "wandb").glob("offline-run-*"))
    rows = [row for row in wandb_history(run_dir) if "train/reward" in row]
    assert [row["training_step"] for row in rows] == [1, 2, 3]
    assert [row["train/reward"] for row in rows] == pytest.approx([r["reward"] for r in run["results"]])
    assert all(row["costs/gpu"] > 0 and row["train/loss"] == row["train/loss"] for row in rows)


@pytest.mark.slow
def test_status_shows_the_step_and_what_the_server_does(run):
    assert set(run["seen"]) & set(STEP_PHASES), run["seen"]
    assert run["statuses"], f"no step phase seen by polling: {run['seen']}"
    outputs = [result.output for result in run["statuses"]]
    assert all(result.exit_code == 0 for result in run["statuses"]), outputs
    # A status is asked for once a poll saw a step phase; the step may commit before it answers (a loaded machine):
    # every status that shows the step in flight shows step 1 serving.
    during = [output for output in outputs if any(phase in output for phase in STEP_PHASES)]
    assert during, outputs
    assert all("obs/watched" in output and "watched@1" in output for output in during), outputs
    after = run["after"].output
    assert run["after"].exit_code == 0 and "watched@3" in after and "idle" in after, after
    assert re.search(r"\$\d+\.\d\d", after), after  # the cost so far, at $3.60 an hour


@pytest.mark.slow
def test_plot_draws_reward_loss_and_kl(run):
    out = run["tmp"] / "curve.png"
    result = run["runner"].invoke(app, ["plot", "watched", "--name", "obs", "--out", str(out)])
    assert result.exit_code == 0 and "3 steps" in result.output, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    result = run["runner"].invoke(app, ["plot", "nobody", "--name", "obs"])
    assert result.exit_code == 1 and "nobody" in result.output, result.output


@pytest.mark.slow
def test_a_stalled_step_says_what_the_server_does(run, monkeypatch):
    """With a stall timeout shorter than a step waits for a long completion in flight (4096 tokens, seconds on any
    CPU; the step's first lines come within the timeout), train() raises naming the phase; once the client gives the
    completion up, the server stops sampling it and the step commits."""
    monkeypatch.setenv("ART_SKY_TRAIN_STALL_TIMEOUT", "2")

    async def stalled() -> tuple[str, int]:
        backend = art_sky.attach("obs", settings=Settings())
        model = art_sky.TrainableModel(name="watched", project="obs", base_model="art-sky/tiny", report_metrics=[])
        try:
            await model.register(backend)
            before = await model.get_step()
            groups = await gather(model)
            long = await model.openai_client().chat.completions.create(  # streamed: closing it cancels it
                model=model.get_inference_name(),
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4096,
                n=4,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            deadline = time.monotonic() + 60
            while not (await backend.models())[0].serving.in_flight:
                assert time.monotonic() < deadline, "the streamed completion never showed as in flight"
                await asyncio.sleep(0.01)
            with pytest.raises(TrainingStalledError) as caught:
                await model.train(groups)
            await long.close()  # the client goes away: the server drops the completion, and the step swaps in
            for _ in range(200):  # 20 s: sampling the whole completion would take longer than that
                if await model.get_step() > before:
                    break
                await asyncio.sleep(0.1)
            return str(caught.value), await model.get_step() - before
        finally:
            await backend.close()

    message, advanced = asyncio.run(stalled())
    assert "made no progress" in message and any(f"server is {phase}" in message for phase in STEP_PHASES), message
    assert advanced == 1


WEAVE_ROUND = """
import asyncio, sys
import weave
import art_sky
sys.path.insert(0, {tests!r})
from test_observability import gather_with

weave.init("obs")  # WEAVE_DISABLED: initialised, traces nothing, needs no W&B account

async def main():
    backend = art_sky.attach("obs")
    try:
        model = art_sky.TrainableModel(name="watched", project="obs", base_model="art-sky/tiny", report_metrics=[])
        await model.register(backend)
        before = await model.get_step()
        result = await model.train(await gather_with(weave.op(rollout_of(model))))
        assert result["step"] == before + 1, result
    finally:
        await backend.close()

def rollout_of(model):
    from test_observability import rollout
    async def traced():
        return await rollout(model)
    return traced

asyncio.run(main())
print("trained with weave")
"""


async def gather_with(rollout_fn) -> list[art_sky.TrajectoryGroup]:
    return await art_sky.gather_trajectory_groups(
        (art_sky.TrajectoryGroup(rollout_fn() for _ in range(4)) for _ in range(2)), pbar_desc=None
    )


@pytest.mark.slow
def test_weave_traced_rollouts_train_unchanged(run):
    """Rollouts decorated with `@weave.op` train as they are: with Weave not initialised (here), and initialised in
    its local mode (WEAVE_DISABLED=true; Weave has no offline mode), in a process of its own."""
    import weave

    @weave.op
    async def traced(model: art_sky.TrainableModel) -> art_sky.Trajectory:
        return await rollout(model)

    async def round_() -> int:
        backend = art_sky.attach("obs")
        try:
            model = art_sky.TrainableModel(name="watched", project="obs", base_model="art-sky/tiny", report_metrics=[])
            await model.register(backend)
            before = await model.get_step()
            result = await model.train(await gather_with(lambda: traced(model)))
            return int(result["step"]) - before
        finally:
            await backend.close()

    assert asyncio.run(round_()) == 1
    script = WEAVE_ROUND.format(tests=str(Path(__file__).parent))
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ | {"WEAVE_DISABLED": "true"},
        cwd=run["tmp"],
    )
    assert result.returncode == 0 and "trained with weave" in result.stdout, result.stdout + result.stderr


async def test_sampled_tokens_count_from_responses_and_streams(server):
    """The server counts each completion's sampled tokens from the bytes its client gets (a response's usage, a
    stream's token_ids or its usage): the next step's `data/step_actor_tokens` is their sum."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "seed": 3}
    body = (
        await server.post(
            "/v1/chat/completions", json=chat | {"n": 2, "logprobs": True, "return_tokens_as_token_ids": True}
        )
    ).json()
    sampled = body["usage"]["completion_tokens"]
    for options in ({}, {"stream_options": {"include_usage": True}}):
        async with server.stream("POST", "/v1/chat/completions", json=chat | {"stream": True} | options) as response:
            events = [
                json.loads(line[len("data: ") :])
                for line in (await response.aread()).decode().splitlines()
                if line.startswith("data: {")
            ]
        streamed = sum(len(choice.get("token_ids") or []) for event in events for choice in event["choices"])
        assert streamed > 0
        usage = [event["usage"]["completion_tokens"] for event in events if event.get("usage")]
        assert usage == ([streamed] if options else [])
        sampled += streamed
    group = {
        "trajectories": [
            {
                "items": [
                    {"role": "user", "content": "hi"},
                    {
                        "kind": "choice",
                        "content": choice["message"]["content"],
                        "token_ids": [int(t["token"].removeprefix("token_id:")) for t in choice["logprobs"]["content"]],
                        "logprobs": [t["logprob"] for t in choice["logprobs"]["content"]],
                    },
                ],
                "reward": float(i),
            }
            for i, choice in enumerate(body["choices"])
        ]
    }
    status, lines = await train_lines(server, "tiny", {"groups": [group]})
    assert status == 200 and lines[-1]["type"] == "result", lines
    assert lines[-1]["metrics"]["data/step_actor_tokens"] == sampled
    assert any(line.get("activity", {}).get("phase") in STEP_PHASES for line in lines[:-1]), lines
