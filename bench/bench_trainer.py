"""GRPO training throughput: art-sky's trainer (cluster/training/peft_trainer.py, PeftTrainer.train on real Sequences)
against a plain hand-written PEFT loop on the same model, batch and sequence lengths: forward, the same clipped loss
(cluster/training/grpo.py), backward, gradient clipping, AdamW step.

The two take turns on one model (each with its own AdamW), best of `--repeats` steps each after a warm-up; prints
tokens/s of both, their ratio (target >= 0.95), peak memory and, on CUDA, MFU. Models are built from a config with
random weights (bench/random_models.py): nothing downloads.

    python bench/bench_trainer.py                                  # CPU: the tiny model
    python bench/bench_trainer.py --shape qwen2-0.5b --rows 32 --length 1024 --json out.json   # a GPU
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

from random_models import SHAPES, build, peak_tflops, sequences, training_flops, with_old_logprobs  # noqa: E402

from art_sky.checkpoints import CheckpointDir  # noqa: E402
from art_sky.cluster.model_state import ModelState, load_peft  # noqa: E402
from art_sky.cluster.training.grpo import grpo_loss_sums  # noqa: E402
from art_sky.cluster.training.peft_trainer import PeftTrainer  # noqa: E402
from art_sky.settings import Settings  # noqa: E402
from art_sky.wire import ModelConfig, RegisterRequest, TrainConfig  # noqa: E402


def plain_step(model, optimizer, batch, config: TrainConfig, rows_per_pass: int) -> None:
    """The baseline: what one writes by hand with PEFT and the same loss (equal-length rows, no padding)."""
    device = next(model.parameters()).device
    total = sum(s.trained_tokens for s in batch)
    model.train()
    for start in range(0, len(batch), rows_per_pass):
        rows = batch[start:start + rows_per_pass]
        ids = torch.tensor([s.token_ids for s in rows], device=device)
        mask = torch.tensor([s.trained for s in rows], device=device)[:, 1:]
        old = torch.tensor([s.old_logprobs for s in rows], device=device)[:, 1:]
        advantages = torch.tensor([[s.advantage] for s in rows], device=device)
        logits = model(input_ids=ids).logits[:, :-1].float()
        new = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        parts = grpo_loss_sums(new, old, advantages, mask, epsilon=config.epsilon,
                               epsilon_high=config.epsilon_high or config.epsilon)
        (parts.policy / total).backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], config.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(step, device: torch.device) -> tuple[float, float, float]:
    """Wall seconds of one step, this process's CPU seconds (on a shared CPU the steadier measure of the work
    done), and its peak memory in GiB (CUDA; 0 elsewhere)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    synchronize(device)
    started, cpu_started = time.perf_counter(), time.process_time()
    step()
    synchronize(device)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return seconds, cpu, (torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--rows", type=int, default=16, help="sequences per step")
    parser.add_argument("--length", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--prompt", type=int, default=128, help="masked prompt tokens at the start of each")
    parser.add_argument("--microbatch-tokens", type=int, default=Settings().train_microbatch_tokens,
                        help="tokens per forward/backward pass, for both (ART_SKY_TRAIN_MICROBATCH_TOKENS)")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per contender, alternating")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, for MFU")
    parser.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's own choice)")
    parser.add_argument("--cache-dir", type=Path, default=Settings().cache_dir)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.microbatch_tokens < args.length:
        parser.error("--microbatch-tokens must hold at least one sequence (--length)")

    if args.threads:
        torch.set_num_threads(args.threads)
    path = build(args.shape, args.cache_dir)
    request = RegisterRequest(name="bench", project="bench", base_model=str(path),
                              config=ModelConfig(lora_rank=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                                 max_seq_length=max(args.length, 16)))
    model, tokenizer = load_peft(request, Settings(cache_dir=args.cache_dir), None)
    device = next(model.parameters()).device
    state = ModelState(request, model, tokenizer, CheckpointDir(Path(tempfile.mkdtemp()), "bench", "bench"))
    batch = sequences(args.rows, args.length, args.prompt, model.config.vocab_size)
    with_old_logprobs(model, batch)
    config = TrainConfig(learning_rate=1e-6)
    trainer = PeftTrainer(args.microbatch_tokens)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.learning_rate,
                                  weight_decay=0.0)
    rows_per_pass = max(1, args.microbatch_tokens // args.length)
    contenders = {"art-sky": lambda: trainer.train(state, batch, config),
                  "plain PEFT": lambda: plain_step(model, optimizer, batch, config, rows_per_pass)}
    for step in contenders.values():  # warm-up: allocator, kernels, optimizer state
        step()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    cpu_times: dict[str, list[float]] = {name: [] for name in contenders}
    memory: dict[str, float] = {name: 0.0 for name in contenders}
    for _ in range(args.repeats):
        for name, step in contenders.items():
            seconds, cpu, peak = timed(step, device)
            times[name].append(seconds)
            cpu_times[name].append(cpu)
            memory[name] = max(memory[name], peak)

    tokens = args.rows * args.length
    flops = training_flops(model.config, tokens, args.length)
    device_name = (torch.cuda.get_device_name() if device.type == "cuda"
                   else f"CPU ({torch.get_num_threads()} of {os.cpu_count()} threads)")
    peak = args.peak_tflops or (peak_tflops(device_name) if device.type == "cuda" else None)
    results = {"shape": args.shape, "device": device_name, "torch": torch.__version__, "rows": args.rows,
               "length": args.length, "prompt": args.prompt, "microbatch_tokens": args.microbatch_tokens,
               "contenders": {}}
    print(f"{args.shape} on {device_name}, torch {torch.__version__}: {args.rows} x {args.length} tokens "
          f"({args.prompt} prompt), micro-batches of {args.microbatch_tokens} tokens, best of {args.repeats}")
    for name, runs in times.items():
        best = min(runs)
        entry = {"tokens_per_s": tokens / best, "best_s": best, "median_s": sorted(runs)[len(runs) // 2],
                 "tokens_per_cpu_s": tokens / min(cpu_times[name]), "peak_memory_gib": memory[name],
                 "mfu": flops / best / (peak * 1e12) if peak else None}
        results["contenders"][name] = entry
        mfu = f", MFU {entry['mfu']:.1%}" if entry["mfu"] is not None else ""
        mem = f", peak {memory[name]:.2f} GiB" if device.type == "cuda" else ""
        print(f"  {name:11s} {entry['tokens_per_s']:10.0f} tokens/s (best {best * 1000:.0f} ms, median "
              f"{entry['median_s'] * 1000:.0f} ms){mem}{mfu}")
    ours, plain = results["contenders"]["art-sky"], results["contenders"]["plain PEFT"]
    results["ratio"] = ratio = ours["tokens_per_s"] / plain["tokens_per_s"]
    results["cpu_time_ratio"] = ours["tokens_per_cpu_s"] / plain["tokens_per_cpu_s"]
    print(f"ratio art-sky / plain PEFT: {ratio:.2f}x (target >= 0.95); by CPU time {results['cpu_time_ratio']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
