"""Generation throughput of the portable engine (cluster/inference/portable_engine.py): completion tokens/s when 1, 8
and 32 completions are sampled together (one batch, one forward pass per token), with peak device memory.

Tokens/s is the completion tokens generated over the wall time of the batch, prompt included (a random-weight
model with a large vocabulary almost never samples its end token, so every row runs to max_tokens). Models are
built from a config with random weights (bench/random_models.py): nothing downloads.

    python bench/bench_portable_engine.py                         # CPU: the tiny model
    python bench/bench_portable_engine.py --shape qwen2-0.5b --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from random_models import SHAPES, build

from art_sky.cluster.inference.portable_engine import PortableEngine
from art_sky.cluster.model_state import create_model_state
from art_sky.settings import Settings
from art_sky.wire import ChatCompletionRequest, ModelConfig, RegisterRequest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--rows", type=int, action="append", help="completions sampled together (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many batches per size")
    parser.add_argument("--cache-dir", type=Path, default=Settings().cache_dir)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    sizes = args.rows or [1, 8, 32]

    path = build(args.shape, args.cache_dir)
    settings = Settings(cache_dir=args.cache_dir)
    request = RegisterRequest(
        name="bench", project="bench", base_model=str(path), config=ModelConfig(max_seq_length=2048)
    )
    state = create_model_state(request, Path(tempfile.mkdtemp()), settings)
    engine = PortableEngine(args.max_tokens)
    engine.attach(state)  # as the server does at registration: it samples from its own copy of the adapter
    cuda = torch.cuda.is_available()
    device_name = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} threads)"
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."},
    ]
    results = {
        "shape": args.shape,
        "device": device_name,
        "torch": torch.__version__,
        "max_tokens": args.max_tokens,
        "sizes": {},
    }
    print(
        f"portable engine, {args.shape} on {device_name}, torch {torch.__version__}: {args.max_tokens} tokens "
        f"per completion, best of {args.repeats}"
    )
    for rows in sizes:
        chat = ChatCompletionRequest(
            model="bench", messages=messages, n=rows, max_tokens=args.max_tokens, temperature=1.0, logprobs=True, seed=0
        )
        engine.complete(state, chat.model_copy(update={"max_tokens": 4}))  # warm-up
        best, tokens = float("inf"), 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.repeats):
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            completion = engine.complete(state, chat)
            if cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - started)
            tokens = completion.usage.completion_tokens
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        results["sizes"][str(rows)] = {
            "tokens_per_s": tokens / best,
            "best_s": best,
            "completion_tokens": tokens,
            "peak_memory_gib": peak,
        }
        memory = f", peak {peak:.2f} GiB" if peak is not None else ""
        print(f"  {rows:3d} together: {tokens / best:9.0f} tokens/s ({tokens} tokens in {best:.2f}s){memory}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
