"""The sharded trainer (FSDP2 ranks under torchrun: cluster/training/rank_group.py) against the one-process PEFT
trainer on the same model and batch: GRPO tokens/s of each, their ratio (the price of sharding where one device
would do), and how closely the two agree after the same steps (their losses).

On CUDA the ranks are the machine's GPUs (NCCL; one GPU: a single rank, which measures FSDP2's own overhead); on a
CPU, `--ranks` processes over gloo. Models are built from a config with random weights (bench/random_models.py).

    python bench/bench_sharded.py                                   # CPU: the tiny model on 2 ranks
    python bench/bench_sharded.py --shape qwen2-1.5b --rows 16 --length 1024 --json out.json   # a GPU machine
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from random_models import SHAPES, build, sequences, with_old_logprobs

from art_sky.cluster.model_state import create_model_state
from art_sky.cluster.training.peft_trainer import PeftTrainer
from art_sky.cluster.training.rank_group import RankGroup, ShardedTrainer
from art_sky.settings import Settings
from art_sky.wire import ModelConfig, RegisterRequest, TrainConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument(
        "--ranks",
        type=int,
        default=torch.cuda.device_count() or 2,
        help="trainer ranks (default: every GPU, else 2 CPU ranks)",
    )
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--microbatch-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-dir", type=Path, default=Settings().cache_dir)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    path = build(args.shape, args.cache_dir)
    settings = Settings(cache_dir=args.cache_dir, train_microbatch_tokens=args.microbatch_tokens)
    request = RegisterRequest(
        name="bench", project="bench", base_model=str(path), config=ModelConfig(max_seq_length=max(args.length, 16))
    )
    config = TrainConfig(learning_rate=1e-6)
    work = Path(tempfile.mkdtemp(prefix="bench-sharded-"))
    single = PeftTrainer(args.microbatch_tokens)
    one = create_model_state(request, work / "one", settings, single.load_model, None, single.load_weights)
    batch = sequences(args.rows, args.length, args.prompt, one.model.config.vocab_size)
    with_old_logprobs(one.model, batch)
    sharded = ShardedTrainer(RankGroup(settings, ranks_per_node=args.ranks), mirrored=False)
    try:
        started = time.perf_counter()
        ranked = create_model_state(request, work / "ranks", settings, sharded.load_model, None, sharded.load_weights)
        load_s = time.perf_counter() - started
        contenders = {"one process": (single, one), f"{args.ranks} rank(s)": (sharded, ranked)}
        times: dict[str, list[float]] = {name: [] for name in contenders}
        losses: dict[str, list[float]] = {name: [] for name in contenders}
        for repeat in range(args.repeats + 1):  # the first is a warm-up
            for name, (trainer, state) in contenders.items():
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                started = time.perf_counter()
                metrics = trainer.train(state, batch, config)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                if repeat:
                    times[name].append(time.perf_counter() - started)
                losses[name].append(metrics["loss"])
    finally:
        sharded.close()

    tokens = args.rows * args.length
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    results = {
        "shape": args.shape,
        "device": device,
        "ranks": args.ranks,
        "rows": args.rows,
        "length": args.length,
        "torch": torch.__version__,
        "ranks_load_s": load_s,
        "contenders": {},
    }
    print(
        f"{args.shape} on {device}, torch {torch.__version__}: {args.rows} x {args.length} tokens, "
        f"best of {args.repeats}; the ranks loaded the model in {load_s:.1f} s"
    )
    for name, runs in times.items():
        entry = {"tokens_per_s": tokens / min(runs), "best_s": min(runs), "losses": losses[name]}
        results["contenders"][name] = entry
        print(
            f"  {name:12s} {entry['tokens_per_s']:10.0f} tokens/s (best {min(runs) * 1000:.0f} ms), "
            f"losses {', '.join(f'{x:.5f}' for x in losses[name])}"
        )
    one_process, ranks = results["contenders"].values()
    results["loss_max_diff"] = max(abs(a - b) for a, b in zip(one_process["losses"], ranks["losses"], strict=True))
    results["ratio"] = ranks["tokens_per_s"] / one_process["tokens_per_s"]
    print(f"loss max difference {results['loss_max_diff']:.2e}")
    print(f"sharded / one process: {results['ratio']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
