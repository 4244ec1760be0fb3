"""GRPO training throughput and memory: art-sky's trainer (cluster/training/peft_trainer.py, PeftTrainer.train on
real Sequences: packed micro-batches, the fused LM head) against a plain hand-written PEFT loop on the same model,
batch and sequence lengths (the baseline: padded rows, full logits, float32 log-softmax, the same clipped loss from
cluster/training/grpo.py, backward, gradient clipping, AdamW step).

The contenders take turns on one model (each with its own AdamW), best of `--repeats` steps each after a warm-up;
prints tokens/s of each, their ratio to the plain loop, peak memory and, on CUDA, MFU. `--mixed` gives the
sequences mixed lengths (a GRPO group's answers differ) and adds the trainer on padded rows, so packing's saving is
measured against padding in the same run (tokens the model runs, and time). Peak memory: torch's peak allocated on
CUDA; on a CPU each contender's steps run in a child process of their own and the peak is its peak RSS over the RSS
before its first step. `--profile FILE` writes each contender's top operations (torch.profiler) for one step.
Models are built from a config with random weights (bench/random_models.py): nothing downloads.

    python bench/bench_trainer.py                                  # CPU: the tiny model
    python bench/bench_trainer.py --shape tiny-152k-vocab --rows 8 --length 256 --prompt 64 --microbatch-tokens 2048
    python bench/bench_trainer.py --shape qwen2.5-7b --rows 16 --length 1024 --prompt 256 --json out.json  # a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from random_models import SHAPES, build, peak_tflops, sequences, training_flops, with_old_logprobs

from art_sky.checkpoints import CheckpointDir
from art_sky.cluster.model_state import ModelState, load_peft
from art_sky.cluster.training.grpo import grpo_loss_sums
from art_sky.cluster.training.peft_trainer import PeftTrainer
from art_sky.settings import Settings
from art_sky.wire import ModelConfig, RegisterRequest, TrainConfig

BASELINE = "plain PEFT"


class PaddedRows(PeftTrainer):
    """art-sky's trainer on right-padded rows (as before packing; the fused head kept)."""

    def packs(self, model) -> bool:
        return False


def plain_step(model, optimizer, batch, config: TrainConfig, microbatch_tokens: int) -> None:
    """The baseline: what one writes by hand with PEFT and the same loss (rows sorted by length and right-padded to
    the longest of their pass, full logits)."""
    device = next(model.parameters()).device
    total = sum(s.trained_tokens for s in batch)
    model.train()
    for rows in PeftTrainer(microbatch_tokens).microbatches(batch, packed=False):
        width = max(len(s.token_ids) for s in rows)
        ids = torch.tensor([s.token_ids + [0] * (width - len(s.token_ids)) for s in rows], device=device)
        mask = torch.tensor([s.trained + [False] * (width - len(s.trained)) for s in rows], device=device)[:, 1:]
        old = torch.tensor([s.old_logprobs + [float("nan")] * (width - len(s.trained)) for s in rows], device=device)[
            :, 1:
        ]
        advantages = torch.tensor([[s.advantage] for s in rows], device=device)
        logits = model(input_ids=ids).logits[:, :-1].float()
        new = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        parts = grpo_loss_sums(
            new, old, advantages, mask, epsilon=config.epsilon, epsilon_high=config.epsilon_high or config.epsilon
        )
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


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory now (VmRSS) or at its peak (VmHWM: since exec, unlike getrusage's ru_maxrss,
    which a child inherits from the parent that forked it)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(f"{field}:")) * 1024


def setup(args):
    """The model, its state, the batch and the contenders."""
    if args.threads:
        torch.set_num_threads(args.threads)
    path = build(args.shape, args.cache_dir)
    request = RegisterRequest(
        name="bench",
        project="bench",
        base_model=str(path),
        config=ModelConfig(
            lora_rank=args.lora_rank, lora_alpha=2 * args.lora_rank, max_seq_length=max(args.length, 16)
        ),
    )
    model, tokenizer = load_peft(request, Settings(cache_dir=args.cache_dir), None)
    state = ModelState(request, model, tokenizer, CheckpointDir(Path(tempfile.mkdtemp()), "bench", "bench"))
    batch = sequences(args.rows, args.length, args.prompt, model.config.vocab_size, mixed=args.mixed)
    if not args.measure_rss:  # a full-logits pass per row: its own peak would hide the step's
        with_old_logprobs(model, batch)
    config = TrainConfig(learning_rate=1e-6)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=config.learning_rate, weight_decay=0.0
    )
    contenders = {"art-sky": lambda: PeftTrainer(args.microbatch_tokens).train(state, batch, config)}
    if args.mixed:
        contenders["art-sky, padded rows"] = lambda: PaddedRows(args.microbatch_tokens).train(state, batch, config)
    contenders[BASELINE] = lambda: plain_step(model, optimizer, batch, config, args.microbatch_tokens)
    return model, batch, contenders


def measure_rss(args) -> None:
    """A child's job: one contender's steps, and its peak RSS over the RSS before them (bytes, JSON)."""
    _, _, contenders = setup(args)
    before = rss_bytes()
    for _ in range(2):
        contenders[args.measure_rss]()
    print(json.dumps({"before": before, "peak": rss_bytes("VmHWM")}))


def rss_of(name: str) -> float:
    """GiB a contender's step adds to the RSS, measured in a child process of its own."""
    done = subprocess.run(
        [sys.executable, __file__, *sys.argv[1:], "--measure-rss", name], capture_output=True, text=True, check=True
    )
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    return (measured["peak"] - measured["before"]) / 2**30


def profile(contenders: dict, device: torch.device, path: Path) -> None:
    """Each contender's top operations in one step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    sections = []
    for name, step in contenders.items():
        with profiler(activities=activities) as prof:
            step()
            synchronize(device)
        sections.append(f"== {name}\n{prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60)}")
    path.write_text("\n".join(sections))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--rows", type=int, default=16, help="sequences per step")
    parser.add_argument("--length", type=int, default=512, help="tokens per sequence (the longest with --mixed)")
    parser.add_argument("--prompt", type=int, default=128, help="masked prompt tokens at the start of each")
    parser.add_argument("--mixed", action="store_true", help="mixed sequence lengths; adds art-sky on padded rows")
    parser.add_argument(
        "--microbatch-tokens",
        type=int,
        default=Settings().train_microbatch_tokens,
        help="tokens per forward/backward pass, for all (ART_SKY_TRAIN_MICROBATCH_TOKENS)",
    )
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per contender, alternating")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, for MFU")
    parser.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's own choice)")
    parser.add_argument("--no-memory", action="store_true", help="on a CPU: skip the child processes for peak RSS")
    parser.add_argument("--profile", type=Path, help="write each contender's top operations for one step here")
    parser.add_argument("--cache-dir", type=Path, default=Settings().cache_dir)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--measure-rss", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.microbatch_tokens < args.length:
        parser.error("--microbatch-tokens must hold at least one sequence (--length)")
    if args.measure_rss:
        measure_rss(args)
        return

    model, batch, contenders = setup(args)
    device = next(model.parameters()).device
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
    if device.type != "cuda" and not args.no_memory:
        memory = {name: rss_of(name) for name in contenders}
    if args.profile:
        profile(contenders, device, args.profile)

    lengths = [len(s.token_ids) for s in batch]
    tokens = sum(lengths)
    flops = sum(training_flops(model.config, n, n) for n in lengths)
    padded = sum(
        len(rows) * max(len(s.token_ids) for s in rows)
        for rows in PeftTrainer(args.microbatch_tokens).microbatches(batch, packed=False)
    )
    device_name = (
        torch.cuda.get_device_name()
        if device.type == "cuda"
        else f"CPU ({torch.get_num_threads()} of {os.cpu_count()} threads)"
    )
    peak = args.peak_tflops or (peak_tflops(device_name) if device.type == "cuda" else None)
    results = {
        "shape": args.shape,
        "device": device_name,
        "torch": torch.__version__,
        "rows": args.rows,
        "length": args.length,
        "prompt": args.prompt,
        "mixed": args.mixed,
        "tokens": tokens,
        "padded_tokens": padded,
        "model_tflops": flops / 1e12,
        "microbatch_tokens": args.microbatch_tokens,
        "memory": "peak allocated (CUDA)" if device.type == "cuda" else "peak RSS over the RSS before the step",
        "contenders": {},
    }
    print(
        f"{args.shape} on {device_name}, torch {torch.__version__}: {args.rows} sequences, {tokens} tokens "
        f"({padded} padded), {'mixed lengths up to ' if args.mixed else ''}{args.length} ({args.prompt} prompt), "
        f"micro-batches of {args.microbatch_tokens} tokens, best of {args.repeats}"
    )
    for name, runs in times.items():
        best = min(runs)
        entry = {
            "tokens_per_s": tokens / best,
            "best_s": best,
            "median_s": sorted(runs)[len(runs) // 2],
            "tokens_per_cpu_s": tokens / min(cpu_times[name]),
            "peak_memory_gib": memory[name],
            "mfu": flops / best / (peak * 1e12) if peak else None,
        }
        results["contenders"][name] = entry
        mfu = f", MFU {entry['mfu']:.1%}" if entry["mfu"] is not None else ""
        print(
            f"  {name:21s} {entry['tokens_per_s']:10.0f} tokens/s (best {best * 1000:.0f} ms, median "
            f"{entry['median_s'] * 1000:.0f} ms), peak memory {memory[name]:.2f} GiB{mfu}"
        )
    base = results["contenders"][BASELINE]
    for name, entry in results["contenders"].items():
        if name != BASELINE:
            entry["ratio"] = entry["tokens_per_s"] / base["tokens_per_s"]
            entry["cpu_time_ratio"] = entry["tokens_per_cpu_s"] / base["tokens_per_cpu_s"]
            entry["memory_ratio"] = (
                entry["peak_memory_gib"] / base["peak_memory_gib"] if base["peak_memory_gib"] else None
            )
            print(
                f"{name} / {BASELINE}: {entry['ratio']:.2f}x tokens/s (by CPU time {entry['cpu_time_ratio']:.2f}x)"
                f", {entry['peak_memory_gib'] - base['peak_memory_gib']:+.2f} GiB peak memory"
            )
    results["ratio"] = results["contenders"]["art-sky"]["ratio"]
    if args.mixed:
        packed, rows = results["contenders"]["art-sky"], results["contenders"]["art-sky, padded rows"]
        results["packed_over_padded"] = packed["tokens_per_s"] / rows["tokens_per_s"]
        print(
            f"packed / padded rows: {results['packed_over_padded']:.2f}x tokens/s; the model runs {tokens} "
            f"tokens instead of {padded} ({1 - tokens / padded:.0%} fewer)"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
