"""Time to build training sequences for a batch of multi-turn tool-using trajectories: this builder vs the one before
exact contexts.

    python bench/bench_sequences.py                          # 256 trajectories of 8 turns, the tiny model's template
    python bench/bench_sequences.py --trajectories 64 --turns 16 --base-model /models/Qwen3-0.6B

The trajectories are what an engine returns for an agent: a system prompt with tools, a user task, then per turn a
sampled tool call (or a final answer) with the ids the engine sampled from and sampled, and the tool's result. The
prompts are rendered by the chat template, as the portable engine renders them. Three builds of the same batch:

  before      cluster/sequences.py as it was before exact contexts (`git show BASELINE:cluster/sequences.py`,
              loaded from a temp file; --baseline names another revision): re-renders the conversation per turn and
              splices the sampled ids in (sampled ids only)
  exact       this checkout's builder with the engine's prompt ids (what rollouts send today)
  rendered    this checkout's builder without prompt ids (a client that kept only the sampled ids): every prompt is
              rendered by the template, as the old builder does

Best of --repeat runs each; ratios are the old builder's time over the contender's (above 1: faster).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from art_sky.client.trajectories import wire_item, wire_trajectory
from art_sky.cluster.chat_template import prompt_ids
from art_sky.cluster.model_state import resolve_base_model
from art_sky.cluster.training.sequences import build_sequences
from art_sky.settings import Settings
from art_sky.wire import WireChoice

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "c09b81982e89d0dd1980fa38d7648898437befb6"  # main just before exact contexts (the merge of issue 10 part 1)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} two numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
    for name in ("add", "multiply", "subtract")
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=256)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--base-model", default="art-sky/tiny", help="its tokenizer and chat template are used")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", default=BASELINE, help="the revision whose cluster/sequences.py is the baseline")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_base_model(args.base_model, Settings()))
    rng = random.Random(0)
    rollouts = [rollout(tokenizer, rng, args.turns) for _ in range(args.trajectories)]
    trajectories = [wire_trajectory(r) for r in rollouts]
    sent = sum(len(t.model_dump_json()) for t in trajectories)
    uncompressed = sum(
        len(json.dumps([wire_item(i).model_dump(mode="json") for i in r["messages_and_choices"]])) for r in rollouts
    )
    without_prompts = [
        t.model_copy(
            update={
                "items": [
                    item.model_copy(update={"prompt_token_ids": None, "prompt_shared": 0})
                    if isinstance(item, WireChoice)
                    else item
                    for item in t.items
                ]
            }
        )
        for t in trajectories
    ]
    tokens = sum(len(item.token_ids or []) for t in trajectories for item in t.items if isinstance(item, WireChoice))
    eos = {tokenizer.eos_token_id}
    old_builder = _old_builder(args.baseline)

    def new(batch):
        return [build_sequences(tokenizer, t, 10**9, len(tokenizer), eos) for t in batch]

    def old(batch):
        return [old_builder(tokenizer, t, 1.0, 10**9) for t in batch]

    timings = {
        "before": best(old, trajectories, args.repeat),
        "exact": best(new, trajectories, args.repeat),
        "rendered": best(new, without_prompts, args.repeat),
    }
    built = new(trajectories)
    sequences = sum(len(b.sequences) for b in built)
    print(
        f"{args.trajectories} trajectories x {args.turns} turns with {len(TOOLS)} tools, {tokens} sampled tokens; "
        f"{args.base_model}; exact contexts made {sequences} sequences"
    )
    print(
        f"train request: {sent / 2**20:.1f} MiB with each prompt sent after what it shares with the previous "
        f"turn, {uncompressed / 2**20:.1f} MiB with whole prompts"
    )
    print(f"{'builder':<10} {'seconds':>8} {'traj/s':>8} {'ratio':>6}")
    for name, seconds in timings.items():
        print(f"{name:<10} {seconds:>8.3f} {args.trajectories / seconds:>8.0f} {timings['before'] / seconds:>6.2f}")


def rollout(tokenizer, rng: random.Random, turns: int) -> dict:
    """One agent rollout as the engine returned it: tool calls, their results, then an answer."""
    messages = [
        {"role": "system", "content": "You are a calculator agent. Use the tools."},
        {"role": "user", "content": f"Compute {rng.randint(1, 99)} op {rng.randint(1, 99)} step by step."},
    ]
    items = list(messages)
    for turn in range(turns):
        prompt = prompt_ids(tokenizer, messages, TOOLS)
        if turn < turns - 1:
            name, args = rng.choice(TOOLS)["function"]["name"], {"a": rng.randint(1, 999), "b": rng.randint(1, 999)}
            text = f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"
            call = {"id": f"call_{turn}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        else:
            text = f"The result is {rng.randint(1, 10**6)}."
            message = {"role": "assistant", "content": text}
        sampled = tokenizer(text + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        items.append(
            {
                "message": message,
                "token_ids": sampled,
                "prompt_token_ids": prompt,
                "logprobs": {"content": [{"token": "", "logprob": -rng.random()} for _ in sampled]},
            }
        )
        messages.append(message)
        if turn < turns - 1:
            result = {"role": "tool", "content": str(rng.randint(1, 10**6)), "tool_call_id": f"call_{turn}"}
            messages.append(result)
            items.append(result)
    return {"messages_and_choices": items, "tools": TOOLS, "reward": rng.random()}


def best(function, batch, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        function(batch)
        times.append(time.perf_counter() - start)
    return min(times)


def _old_builder(revision: str):
    """`tokenize_trajectory` from `revision`'s cluster/sequences.py, loaded from a temp copy."""
    source = subprocess.run(
        ["git", "show", f"{revision}:cluster/sequences.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="bench-sequences-")) / "old_sequences.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_sequences", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.tokenize_trajectory


if __name__ == "__main__":
    sys.exit(main())
