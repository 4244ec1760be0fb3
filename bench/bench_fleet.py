"""Completions/s of the inference fleet: the head's server alone, then the head and one replica server joined to it
(`python -m art_sky.cluster --join`), in one run, each server pinned to its own core (taskset), the tiny built-in
model on the portable engine.

Each phase sends `--concurrency` completions at a time through the head's /v1 for `--seconds` (distinct
conversations, `--max-tokens` sampled tokens each, EOS ignored so every completion costs the same). Then one
training step: the time from train returning to every replica listing the new step (/health) and to a completion
sampled by the new step from every replica. The last line is `fleet speedup X.XX` (2 replicas / 1; expect >= 1.5
on 2 cores).

    python bench/bench_fleet.py
    python bench/bench_fleet.py --seconds 30 --concurrency 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
import sys  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))

from fleet_nodes import API_KEY, Node, fleet, start_node, wait_fleet  # noqa: E402

MODEL = {"name": "tiny", "project": "bench", "base_model": "art-sky/tiny"}


async def throughput(head: Node, args: argparse.Namespace, phase: str) -> float:
    """Completions per second through the head's /v1 with `args.concurrency` in flight."""
    done = 0
    counter = iter(range(10**9))

    async def worker(http: httpx.AsyncClient, deadline: float) -> None:
        nonlocal done
        while time.monotonic() < deadline:
            response = await http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": f"{phase} conversation {next(counter)}"}],
                "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 1.0})
            response.raise_for_status()
            done += 1

    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=head.url, headers={"authorization": f"Bearer {API_KEY}"}, timeout=300,
                                 limits=limits) as http:
        await asyncio.gather(*(worker(http, time.monotonic() + 3) for _ in range(args.concurrency)))  # warm up
        done = 0
        start = time.monotonic()
        await asyncio.gather(*(worker(http, start + args.seconds) for _ in range(args.concurrency)))
        rate = done / (time.monotonic() - start)
    print(f"{phase}: {rate:.1f} completions/s ({done} in {args.seconds:.0f}s, {args.concurrency} in flight, "
          f"{args.max_tokens} tokens each)", flush=True)
    return rate


async def step_everywhere(head: Node) -> None:
    """Train one step, then time how soon every replica serves it."""
    async with httpx.AsyncClient(base_url=head.url, headers={"authorization": f"Bearer {API_KEY}"},
                                 timeout=300) as http:
        sampled = (await http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "n": 4, "seed": 1,
            "logprobs": True, "return_tokens_as_token_ids": True})).json()
        group = {"trajectories": [{"items": [
            {"role": "user", "content": "hi"},
            {"kind": "choice", "content": c["message"]["content"],
             "token_ids": [int(t["token"].removeprefix("token_id:")) for t in c["logprobs"]["content"]],
             "logprobs": [t["logprob"] for t in c["logprobs"]["content"]]}], "reward": float(i % 2)}
            for i, c in enumerate(sampled["choices"])]}
        response = await http.post("/art/models/tiny/train", json={"groups": [group],
                                                                    "config": {"learning_rate": 1e-3}})
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
            responses = await asyncio.gather(*(http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": f"after {i}"}], "max_tokens": 4})
                for i in range(8)))
            assert {r.json()["model"] for r in responses} == {f"tiny@{step}"}
            if listed is not None and all(r["completions"] > b for r, b in zip(fleet(head), before)):
                sampled_everywhere = time.monotonic() - returned
                break
        swap = result["metrics"].get("time/step_swap_s")
    print(f"step {step}: every replica listed tiny@{step} {listed:.3f}s after train returned; a completion of "
          f"tiny@{step} from every replica {sampled_everywhere:.3f}s after"
          + (f" (the swap inside the step, every replica loading it: {swap:.3f}s)" if swap is not None else ""),
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        root = Path(tmp)
        head = start_node(root, "head", core=0)
        replica = None
        try:
            with head.client() as client:
                client.post("/art/models", json=MODEL).raise_for_status()
            one = asyncio.run(throughput(head, args, "head alone (core 0)"))
            replica = start_node(root, "replica", join=head.url, core=1)
            wait_fleet(head, lambda f: len(f) == 2 and f[1]["steps"].get("tiny") == 0, "the replica serving tiny")
            two = asyncio.run(throughput(head, args, "head (core 0) + replica (core 1)"))
            print("completions per replica: " + ", ".join(f"{r['url']} {r['completions']}" for r in fleet(head)))
            asyncio.run(step_everywhere(head))
        finally:
            for node in (replica, head):
                if node is not None:
                    node.stop()
    print(f"fleet speedup {two / one:.2f}")


if __name__ == "__main__":
    main()
