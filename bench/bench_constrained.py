"""What constrained decoding costs the portable engine: time per sampled token with a JSON schema (llguidance's mask
computed and applied each token, cluster/inference/constraints.py) per decoding step of a batch (its longest row's
tokens) against the same batch unconstrained, measured in
the same run, alternating, best of --repeats each. Random weights (bench/random_models.py): the constrained reply
is a string field the model rarely closes, so both run to about max_tokens.

    python bench/bench_constrained.py                              # the tiny model (261 tokens)
    python bench/bench_constrained.py --shape tiny-152k-vocab      # Qwen's vocabulary: the mask's real size
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from random_models import SHAPES, build

from art_sky.cluster.inference.portable_engine import PortableEngine
from art_sky.cluster.model_state import create_model_state
from art_sky.settings import Settings
from art_sky.wire import ChatCompletionRequest, ModelConfig, RegisterRequest

SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string"}},
    "required": ["story"],
    "additionalProperties": False,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--rows", type=int, action="append", help="completions sampled together (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-dir", type=Path, default=Settings().cache_dir)
    args = parser.parse_args()

    path = build(args.shape, args.cache_dir)
    state = create_model_state(
        RegisterRequest(name="bench", project="bench", base_model=str(path), config=ModelConfig(max_seq_length=2048)),
        Path(tempfile.mkdtemp()),
        Settings(cache_dir=args.cache_dir),
    )
    engine = PortableEngine(args.max_tokens)
    engine.attach(state)
    messages = [{"role": "user", "content": "Write a short story about a lighthouse keeper, as JSON."}]
    print(f"portable engine, {args.shape}: {args.max_tokens} tokens per completion, best of {args.repeats}")
    for rows in args.rows or [1, 8]:
        free = ChatCompletionRequest(
            model="bench", messages=messages, n=rows, max_tokens=args.max_tokens, logprobs=True, seed=0, ignore_eos=True
        )
        constrained = free.model_copy(
            update={
                "ignore_eos": False,
                "response_format": {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}},
            }
        )
        constrained = ChatCompletionRequest.model_validate(constrained.model_dump(by_alias=True))
        engine.complete(state, constrained.model_copy(update={"max_tokens": 4}))  # warm-up: llguidance's tokenizer
        best = {"free": float("inf"), "constrained": float("inf")}
        for _ in range(args.repeats):
            for name, request in (("free", free), ("constrained", constrained)):
                started = time.perf_counter()
                completion = engine.complete(state, request)
                steps = max(len(c.model_extra["token_ids"]) for c in completion.choices)  # the batch's length
                best[name] = min(best[name], (time.perf_counter() - started) / steps)
        print(
            f"  {rows:3d} together: {best['free'] * 1e3:.2f} ms per batch token free, "
            f"{best['constrained'] * 1e3:.2f} constrained: {best['constrained'] / best['free']:.2f}x"
        )


if __name__ == "__main__":
    main()
