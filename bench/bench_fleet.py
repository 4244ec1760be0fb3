"""Completions/s of the inference fleet: the head's server alone, then the head and one replica server joined to it
(`python -m art_sky.cluster --join`), in one run, each server pinned to its own core (taskset), the tiny built-in
model on the portable engine.

Each phase sends `--concurrency` completions at a time through the head's /v1 for `--seconds` (distinct
conversations, `--max-tokens` sampled tokens each, EOS ignored so every completion costs the same). Then one
training step: the time from train returning to every replica listing the new step (/health) and to a completion
sampled by the new step from every replica. Each phase also says how much CPU the servers got (on a machine others
share, two pinned servers may get less than two cores) and the completions per CPU-second. The last line is `fleet
speedup X.XX` (2 replicas / 1; expect >= 1.5 on 2 otherwise idle cores).

    python bench/bench_fleet.py
    python bench/bench_fleet.py --seconds 30 --concurrency 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parent.parent
import sys  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))

from fleet_nodes import API_KEY, Node, fleet, start_node, wait_fleet  # noqa: E402

MODEL = {"name": "tiny", "project": "bench", "base_model": "art-sky/tiny"}


def cpu_seconds(nodes: list[Node]) -> float:
    """CPU time the servers have used (user + system, every thread): what they got of a shared machine."""
    total = 0
    for node in nodes:
        fields = Path(f"/proc/{node.server.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


async def throughput(nodes: list[Node], args: argparse.Namespace, phase: str) -> float:
    """Completions per second through the head's /v1 with `args.concurrency` in flight."""
    head = nodes[0]
    done = 0
    counter = iter(range(10**9))

    async def worker(http: aiohttp.ClientSession, deadline: float) -> None:
        nonlocal done
        while time.monotonic() < deadline:
            async with http.post(
                "/v1/chat/completions",
                json={
                    "model": "tiny",
                    "messages": [{"role": "user", "content": f"{phase} conversation {next(counter)}"}],
                    "max_tokens": args.max_tokens,
                    "ignore_eos": True,
                    "temperature": 1.0,
                },
            ) as response:
                response.raise_for_status()
                await response.read()
            done += 1

    async with aiohttp.ClientSession(
        base_url=head.url, headers={"authorization": f"Bearer {API_KEY}"}, connector=aiohttp.TCPConnector(limit=0)
    ) as http:  # a light client: 2 cores
        await asyncio.gather(*(worker(http, time.monotonic() + 3) for _ in range(args.concurrency)))  # warm up
        done = 0
        before = {r["url"]: r["completions"] for r in fleet(head)}
        cpu, start = cpu_seconds(nodes), time.monotonic()
        await asyncio.gather(*(worker(http, start + args.seconds) for _ in range(args.concurrency)))
        took = time.monotonic() - start
        cpu = cpu_seconds(nodes) - cpu
        each = ", ".join(f"{r['url']} {(r['completions'] - before[r['url']]) / took:.1f}/s" for r in fleet(head))
    rate = done / took
    print(
        f"{phase}: {rate:.1f} completions/s ({done} in {args.seconds:.0f}s, {args.concurrency} in flight, "
        f"{args.max_tokens} tokens each; {each}); the servers got {cpu / took:.2f} cores ({rate * took / cpu:.1f} "
        f"completions per CPU-second) with this machine's load average at {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    return rate


async def step_everywhere(head: Node) -> None:
    """Train one step, then time how soon every replica serves it."""
    async with httpx.AsyncClient(
        base_url=head.url, headers={"authorization": f"Bearer {API_KEY}"}, timeout=300
    ) as http:
        sampled = (
            await http.post(
                "/v1/chat/completions",
                json={
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 8,
                    "n": 4,
                    "seed": 1,
                    "logprobs": True,
                    "return_tokens_as_token_ids": True,
                },
            )
        ).json()
        group = {
            "trajectories": [
                {
                    "items": [
                        {"role": "user", "content": "hi"},
                        {
                            "kind": "choice",
                            "content": c["message"]["content"],
                            "token_ids": [int(t["token"].removeprefix("token_id:")) for t in c["logprobs"]["content"]],
                            "logprobs": [t["logprob"] for t in c["logprobs"]["content"]],
                        },
                    ],
                    "reward": float(i % 2),
                }
                for i, c in enumerate(sampled["choices"])
            ]
        }
        response = await http.post(
            "/art/models/tiny/train", json={"groups": [group], "config": {"learning_rate": 1e-3}}
        )
        returned = time.monotonic()
        result = json.loads(response.text.splitlines()[-1])
        assert result["type"] == "result", result
        step = result["step"]
        before = [r["completions"] for r in fleet(head)]
        listed = None
        while True:
            replicas = fleet(head)
            if listed is None and all(r["steps"].get("tiny") == step for r in replicas):
                listed = time.monotonic() - returned
            responses = await asyncio.gather(
                *(
                    http.post(
                        "/v1/chat/completions",
                        json={
                            "model": "tiny",
                            "messages": [{"role": "user", "content": f"after {i}"}],
                            "max_tokens": 4,
                        },
                    )
                    for i in range(8)
                )
            )
            assert {r.json()["model"] for r in responses} == {f"tiny@{step}"}
            if listed is not None and all(r["completions"] > b for r, b in zip(fleet(head), before, strict=False)):
                sampled_everywhere = time.monotonic() - returned
                break
        swap = result["metrics"].get("time/step_swap_s")
    print(
        f"step {step}: every replica listed tiny@{step} {listed:.3f}s after train returned; a completion of "
        f"tiny@{step} from every replica {sampled_everywhere:.3f}s after"
        + (f" (the swap inside the step, every replica loading it: {swap:.3f}s)" if swap is not None else ""),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        root = Path(tmp)
        head = start_node(root, "head", core=0)
        replica = None
        try:
            with head.client() as client:
                client.post("/art/models", json=MODEL).raise_for_status()
            one = asyncio.run(throughput([head], args, "head alone (core 0)"))
            replica = start_node(root, "replica", join=head.url, core=1)
            wait_fleet(head, lambda f: len(f) == 2 and f[1]["steps"].get("tiny") == 0, "the replica serving tiny")
            two = asyncio.run(throughput([head, replica], args, "head (core 0) + replica (core 1)"))
            asyncio.run(step_everywhere(head))
        finally:
            for node in (replica, head):
                if node is not None:
                    node.stop()
    print(f"fleet speedup {two / one:.2f}")


if __name__ == "__main__":
    main()
