"""Rollout throughput through art-sky's endpoint vs raw vLLM, streaming and not, and adapter swap latency.

    python bench/bench_engine.py                      # vLLM (from .venv-vllm) on the tiny model, this machine
    python bench/bench_engine.py --no-tunnel          # skip the SSH tunnel (no OpenSSH here)
    python bench/bench_engine.py --base-model /models/Qwen2.5-0.5B-Instruct --python /opt/venv/bin/python

One run starts the cluster server through an SSHBackend to a throwaway sshd on 127.0.0.1 (OpenSSH:
tests/setup/10-openssh.sh), registers a model and, at each concurrency, sends the same chat completions (logprobs
and token ids on, as rollouts ask; ignore_eos so every completion is max_tokens long) with one plain httpx client
to:
  vllm          vLLM's own port: the baseline
  endpoint      the cluster server's /v1 (what users hit: the proxy in front of vLLM)
  tunnel        the same /v1 through the SSH tunnel (what users on a laptop hit)
  vllm-tunnel   vLLM's port through an SSH tunnel of its own: the tunnel's cost alone
first non-streaming, then streaming (each event read as it arrives). Targets take turns, --rounds times, and the
table prints the median completions/s of each and its ratio to vLLM. On a shared machine throughput moves by tens of
percent between rounds, so each row also gives the CPU time per completion of the proxy (the cluster server
process, during the endpoint runs) beside that of vLLM's processes (during the vllm runs; it includes threads of
vLLM's engine that spin while they wait): what the proxy adds, measured without the neighbours' noise. Then one GRPO
step, and the time from train() returning to the first completion served by the new adapter.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
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
    parser.add_argument("--python", help="the server's interpreter (default: .venv-vllm)")
    parser.add_argument("--base-model", default="art-sky/tiny")
    parser.add_argument("--concurrency", default="1,8,64", help="comma-separated levels")
    parser.add_argument(
        "--requests",
        type=int,
        default=32,
        help="completions per level, target and round (at least twice the concurrency)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="turns each target takes per level (median kept)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--gpu-memory", default="0.3", help="ART_SKY_ENGINE_GPU_MEMORY for vLLM")
    parser.add_argument("--no-tunnel", action="store_true", help="a LocalBackend: no SSH tunnel targets")
    args = parser.parse_args()
    python = args.python or str(ROOT / ".venv-vllm" / "bin" / "python")
    env = {"ART_SKY_ENGINE": "vllm", "ART_SKY_ENGINE_GPU_MEMORY": args.gpu_memory}
    with contextlib.ExitStack() as stack:
        if args.no_tunnel:
            backend = art.LocalBackend(path=tempfile.mkdtemp(prefix="art-sky-bench-"), python=python, env=env)
        else:
            backend = ssh_backend(stack, python, env)
        await bench(backend, args, stack)


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


async def bench(backend: art.Backend, args: argparse.Namespace, stack: contextlib.ExitStack) -> None:
    from art_sky.remote.tunnel import Tunnel
    from art_sky.settings import Settings

    model = art.TrainableModel(
        name="bench", project="bench", base_model=args.base_model, config=art.ModelConfig(max_seq_length=1024)
    )
    try:
        started = time.perf_counter()
        await model.register(backend)
        health = await backend.health()
        print(
            f"engine {health.engine}, trainer {health.trainer}, device {health.device}: registered in "
            f"{time.perf_counter() - started:.1f}s"
        )
        step = await model.get_step()
        targets = {"vllm": (f"http://127.0.0.1:{health.engine_port}/v1", f"{model.name}@{step}")}
        tunnel = getattr(backend, "tunnel", None)
        if tunnel is not None:  # the server runs on this machine: its port is reachable without the tunnel too
            targets["endpoint"] = (f"http://127.0.0.1:{tunnel.remote[1]}/v1", model.name)
            targets["tunnel"] = (f"{backend.base_url}/v1", model.name)
            engine_tunnel = Tunnel(tunnel.target, health.engine_port, Settings())
            await asyncio.to_thread(engine_tunnel.start)
            stack.callback(engine_tunnel.close)
            targets["vllm-tunnel"] = (f"{engine_tunnel.base_url}/v1", f"{model.name}@{step}")
        else:
            targets["endpoint"] = (f"{backend.base_url}/v1", model.name)
        body = {
            "messages": PROMPT,
            "max_tokens": args.max_tokens,
            "temperature": 1.0,
            "logprobs": True,
            "return_tokens_as_token_ids": True,
            "ignore_eos": True,
        }
        clients = {
            name: httpx.AsyncClient(
                base_url=url,
                headers={"authorization": f"Bearer {backend.api_key}"},
                timeout=600,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            )
            for name, (url, _) in targets.items()
        }
        senders = {name: (clients[name], target_model) for name, (_, target_model) in targets.items()}
        levels = [int(c) for c in args.concurrency.split(",")]
        server = getattr(backend, "server", None)
        pids = {"endpoint": [server.pid], "vllm": _children(server.pid)} if server else {}
        for stream in (False, True):
            await throughput_table(senders, body, levels, args.requests, args.rounds, stream, pids)
        for client in clients.values():
            await client.aclose()
        await swap_latency(model, backend)
    finally:
        await backend.close()


async def send(client: httpx.AsyncClient, model: str, body: dict, stream: bool) -> None:
    payload = body | {"model": model, "stream": stream}
    if not stream:
        response = await client.post("/chat/completions", json=payload)
        response.raise_for_status()
        assert response.json()["usage"]["completion_tokens"] == body["max_tokens"]
        return
    last = ""
    async with client.stream("POST", "/chat/completions", json=payload) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():  # each event as it arrives (vLLM may put tokens together)
            last = line or last
    assert last == "data: [DONE]", f"the stream ended with {last!r}"


async def throughput_table(
    senders: dict, body: dict, levels: list[int], requests: int, rounds: int, stream: bool, pids: dict[str, list[int]]
) -> None:
    for client, model in senders.values():  # warm every path (connections, vLLM's first batches) before timing
        await run_level(client, model, body, 8, 16, stream)
    kind = "streaming" if stream else "non-streaming"
    print(f"\n{kind}: completions/s (median of {rounds} rounds) and ratio to vLLM")
    print(
        f"{'concurrency':>11} "
        + " ".join(f"{name:>19}" for name in senders)
        + ("   CPU ms/completion: vLLM, proxy" if pids else "")
    )
    for level in levels:
        rates: dict[str, list[float]] = {name: [] for name in senders}
        cpu: dict[str, float] = {name: 0.0 for name in pids}
        done: dict[str, int] = {name: 0 for name in pids}
        for round_ in range(rounds):
            names = list(senders)
            order = names[round_ % len(names) :] + names[: round_ % len(names)]  # each target leads in turn
            for name in order:
                client, model = senders[name]
                count = max(requests, 2 * level)
                before = _cpu_seconds(pids.get(name, []))
                rates[name].append(count / await run_level(client, model, body, level, count, stream))
                if name in pids:
                    cpu[name] += _cpu_seconds(pids[name]) - before
                    done[name] += count
        base = statistics.median(rates["vllm"])
        cells = [f"{statistics.median(r):8.1f} ({statistics.median(r) / base:5.2f}x)" for r in rates.values()]
        costs = (
            f"   {cpu['vllm'] * 1000 / done['vllm']:6.2f}, {cpu['endpoint'] * 1000 / done['endpoint']:5.2f}"
            if pids
            else ""
        )
        print(f"{level:>11} " + " ".join(f"{c:>19}" for c in cells) + costs, flush=True)


def _children(pid: int) -> list[int]:
    """Every process under `pid` (vLLM's API server and engine core under the cluster server)."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        for task in Path(f"/proc/{parent}/task").iterdir():
            for child in (task / "children").read_text().split():
                found.append(int(child))
                queue.append(int(child))
    return found


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes so far (Linux /proc)."""
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


async def run_level(
    client: httpx.AsyncClient, model: str, body: dict, concurrency: int, requests: int, stream: bool
) -> float:
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            await send(client, model, body, stream)

    started = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(requests)))
    return time.perf_counter() - started


async def swap_latency(model: art.TrainableModel, backend: art.Backend) -> None:
    """One GRPO step, then how long until a completion shows the new adapter (its greedy logprobs moved)."""
    client = model.openai_client()

    async def greedy_logprobs() -> list[float]:
        completion = await client.chat.completions.create(
            model=model.name, messages=PROMPT, max_tokens=4, temperature=0, seed=0
        )
        return [t.logprob for t in completion.choices[0].logprobs.content]

    before = await greedy_logprobs()
    groups = []
    for seed in (1, 2):
        completion = await client.chat.completions.create(
            model=model.name, messages=PROMPT, n=4, max_tokens=12, seed=seed
        )
        groups.append(
            art.TrajectoryGroup(
                art.Trajectory(
                    messages_and_choices=[*PROMPT, choice],
                    reward=sum(c.islower() for c in choice.message.content or "") / 12,
                )
                for choice in completion.choices
            )
        )
    started = time.perf_counter()
    await model.train(groups, art.TrainConfig(learning_rate=5e-2))
    trained = time.perf_counter()
    while time.perf_counter() - trained < 120:
        if await greedy_logprobs() != before:
            now = time.perf_counter()
            print(
                f"\ntrain() took {trained - started:.2f}s; first completion from the new adapter "
                f"{(now - trained) * 1000:.0f} ms after train() returned"
            )
            return
    print("\nno completion showed a new adapter within 120 s after train() returned")


if __name__ == "__main__":
    asyncio.run(main())
