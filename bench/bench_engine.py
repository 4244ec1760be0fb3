"""Rollout throughput straight to the engine vs through art-sky's endpoints, and adapter swap latency.

    python bench/bench_engine.py                      # vLLM (from .venv-vllm) on the tiny model, this machine
    python bench/bench_engine.py --engine portable    # the portable engine in this Python
    python bench/bench_engine.py --tunnel             # the same through the SSH tunnel to a throwaway local sshd
    python bench/bench_engine.py --base-model /models/Qwen2.5-0.5B-Instruct --python /opt/venv/bin/python

One run starts a LocalBackend (or, with --tunnel, an SSHBackend to this machine's own sshd), registers a model
and, at each concurrency, sends the same chat completions (logprobs and token ids on, as rollouts ask) to:
  engine     the engine's own port, plain HTTP (for the portable engine that is the server's /v1)
  endpoint   model.openai_client(): what users sample from (the server's /v1, tunnelled with --tunnel)
  control    the server's /v1 route with a plain HTTP client (in front of vLLM; tunnelled with --tunnel)
and prints completions/s, tokens/s and each target's ratio to the engine. Then one GRPO step, and the time from
train() returning to the first completion served by the new adapter.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

import art_sky as art

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [{"role": "user", "content": "Write a short line about the sea."}]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["vllm", "portable"], default="vllm")
    parser.add_argument("--python", help="the server's interpreter (default: .venv-vllm for vllm, this one else)")
    parser.add_argument("--base-model", default="art-sky/tiny")
    parser.add_argument("--concurrency", default="1,8,64", help="comma-separated levels")
    parser.add_argument("--requests", type=int, default=64, help="completions per level and target")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--gpu-memory", default="0.3", help="ART_SKY_ENGINE_GPU_MEMORY for vLLM")
    parser.add_argument("--tunnel", action="store_true", help="go through the SSH tunnel to a throwaway local sshd "
                                                              "(OpenSSH: tests/setup/10-openssh.sh)")
    args = parser.parse_args()
    python = args.python or (str(ROOT / ".venv-vllm" / "bin" / "python") if args.engine == "vllm" else sys.executable)
    env = {"ART_SKY_ENGINE": args.engine, "ART_SKY_ENGINE_GPU_MEMORY": args.gpu_memory}
    with contextlib.ExitStack() as stack:
        if args.tunnel:
            backend = ssh_backend(stack, python, env)
        else:
            backend = art.LocalBackend(path=tempfile.mkdtemp(prefix="art-sky-bench-"), python=python, env=env)
        await bench(backend, args)


def ssh_backend(stack: contextlib.ExitStack, python: str, env: dict[str, str]) -> art.Backend:
    """An SSHBackend to a throwaway sshd on 127.0.0.1 (the tests' own), running the server with `python`."""
    sys.path.insert(0, str(ROOT / "tests"))
    from sshd import Sshd

    from art_sky.remote.install import BootstrapOptions

    root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="art-sky-bench-sshd-")))
    os.environ["ART_SKY_HOME"] = str(root / "home")  # its throwaway host key stays out of ~/.art-sky/known_hosts
    sshd = Sshd(root)
    sshd.start()
    stack.callback(sshd.stop)
    options = BootstrapOptions(remote_dir=str(root / "remote"), python=python, env=env)
    return art.SSHBackend(sshd.target(), options=options)


async def bench(backend: art.Backend, args: argparse.Namespace) -> None:
    model = art.TrainableModel(name="bench", project="bench", base_model=args.base_model,
                               config=art.ModelConfig(max_seq_length=1024))
    try:
        started = time.perf_counter()
        await model.register(backend)
        health = await backend.health()
        print(f"engine {health.engine}, trainer {health.trainer}, device {health.device}: registered in "
              f"{time.perf_counter() - started:.1f}s")
        engine_url = (f"http://127.0.0.1:{health.inference_port}/v1" if health.inference_port
                      else f"{backend.base_url}/v1")
        targets = {"engine": raw_sender(engine_url, backend.api_key)}
        targets["endpoint"] = openai_sender(model)
        if health.inference_port:  # (the portable engine is the control server's /v1 already)
            targets["control"] = raw_sender(f"{backend.base_url}/v1", backend.api_key)
        # ignore_eos (vLLM's; the portable engine ignores it): every completion is max_tokens long
        body = {"model": model.name, "messages": PROMPT, "max_tokens": args.max_tokens, "temperature": 1.0,
                "logprobs": True, "return_tokens_as_token_ids": True, "ignore_eos": True}
        await throughput_table(targets, body, [int(c) for c in args.concurrency.split(",")], args.requests)
        await swap_latency(model)
    finally:
        await backend.close()


def raw_sender(base_url: str, api_key: str):
    client = httpx.AsyncClient(base_url=base_url, headers={"authorization": f"Bearer {api_key}"}, timeout=600)

    async def send(body: dict) -> int:
        response = await client.post("/chat/completions", json=body)
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"]

    return send


def openai_sender(model: art.TrainableModel):
    client = model.openai_client()

    async def send(body: dict) -> int:
        completion = await client.chat.completions.create(
            model=body["model"], messages=body["messages"], max_tokens=body["max_tokens"],
            temperature=body["temperature"], extra_body={"ignore_eos": body["ignore_eos"]})
        return completion.usage.completion_tokens

    return send


async def throughput_table(targets: dict, body: dict, levels: list[int], requests: int) -> None:
    for send in targets.values():  # warm every path (connections, vLLM's first batches) before timing
        await run_level(send, body, 8, 16)
    print(f"\n{'concurrency':>11} {'target':>9} {'compl/s':>9} {'tokens/s':>10} {'vs engine':>10}")
    for level in levels:
        base = None
        for name, send in targets.items():
            seconds, tokens = await run_level(send, body, level, requests)
            rate = requests / seconds
            base = base or rate
            print(f"{level:>11} {name:>9} {rate:>9.2f} {tokens / seconds:>10.1f} {rate / base:>9.2f}x")


async def run_level(send, body: dict, concurrency: int, requests: int) -> tuple[float, int]:
    gate = asyncio.Semaphore(concurrency)

    async def one() -> int:
        async with gate:
            return await send(body)

    started = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one() for _ in range(requests))))
    return time.perf_counter() - started, tokens


async def swap_latency(model: art.TrainableModel) -> None:
    """One GRPO step, then how long until a completion shows the new adapter (its greedy logprobs moved)."""
    client = model.openai_client()

    async def greedy_logprobs() -> list[float]:
        completion = await client.chat.completions.create(model=model.name, messages=PROMPT, max_tokens=4,
                                                          temperature=0, seed=0)
        return [t.logprob for t in completion.choices[0].logprobs.content]

    before = await greedy_logprobs()
    groups = []
    for seed in (1, 2):
        completion = await client.chat.completions.create(model=model.name, messages=PROMPT, n=4, max_tokens=12,
                                                          seed=seed)
        groups.append(art.TrajectoryGroup(
            art.Trajectory(messages_and_choices=[*PROMPT, choice],
                           reward=sum(c.islower() for c in choice.message.content or "") / 12)
            for choice in completion.choices))
    started = time.perf_counter()
    await model.train(groups, art.TrainConfig(learning_rate=5e-2))
    trained = time.perf_counter()
    while time.perf_counter() - trained < 120:
        if await greedy_logprobs() != before:
            now = time.perf_counter()
            print(f"\ntrain() took {trained - started:.2f}s; first completion from the new adapter "
                  f"{(now - trained) * 1000:.0f} ms after train() returned")
            return
    print("\nno completion showed a new adapter within 120 s after train() returned")


if __name__ == "__main__":
    asyncio.run(main())
