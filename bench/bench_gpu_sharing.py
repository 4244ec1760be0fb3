"""One GPU, two jobs: what vLLM and the Unsloth trainer leave free of the GPU's memory, with vLLM inside the trainer
sharing its weights (unsloth-standby) and with vLLM's own server asleep while training (vllm-sleep).

For each mode it starts a cluster server (ART_SKY_GPU_SHARING=auto, then sleep), registers the model, samples
rollouts and trains a few GRPO steps, while a thread reads the GPU's used memory from nvidia-smi every 100 ms.
Prints, per phase (loaded and idle, rollouts, training), the most memory used and what that leaves free. Needs a CUDA
host with art-sky[gpu] (vLLM and Unsloth) installed; the model is a local Hugging Face directory or, by default,
a random-weight Qwen2 of the 0.5B shape (bench/random_models.py).

    python bench/bench_gpu_sharing.py [--model DIR] [--steps 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from random_models import build

import art_sky as art
from art_sky.settings import Settings

PROMPT = [{"role": "user", "content": "Name a colour. Answer in lower case."}]


class MemoryWatch:
    """The GPU's used memory (MiB, nvidia-smi: every process) sampled in a thread; the peak per named phase."""

    def __init__(self):
        self.phase, self.peaks, self.total = "start", {}, _smi("memory.total")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            used = _smi("memory.used")
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), used)
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _smi(field: str) -> int:
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(out.strip().splitlines()[0])


async def measure(mode: str, model_dir: str, steps: int) -> dict:
    backend = art.LocalBackend(
        path=tempfile.mkdtemp(prefix=f"sharing-{mode}-"),
        python=sys.executable,
        env={"ART_SKY_ENGINE": "vllm", "ART_SKY_TRAINER": "unsloth", "ART_SKY_GPU_SHARING": mode},
    )
    model = art.TrainableModel(
        name="sharing", project="bench", base_model=model_dir, config=art.ModelConfig(lora_rank=16, max_seq_length=2048)
    )
    watch = MemoryWatch()
    try:
        watch.phase = "loading"
        await model.register(backend)
        health = await backend.health()
        watch.phase = "idle"
        await asyncio.sleep(2)
        client = model.openai_client()
        for step in range(steps):
            watch.phase = "rollouts"
            groups = []
            for seed in range(4):
                completion = await client.chat.completions.create(
                    model=model.name, messages=PROMPT, n=8, max_tokens=128, seed=100 * step + seed
                )
                groups.append(
                    art.TrajectoryGroup(
                        art.Trajectory(
                            messages_and_choices=[*PROMPT, c], reward=float(len(c.message.content or "") < 20)
                        )
                        for c in completion.choices
                    )
                )
            watch.phase = "training"
            await model.train(groups, art.TrainConfig(learning_rate=1e-5))
    finally:
        watch.stop()
        await backend.close()
    return {
        "gpu_sharing": health.gpu_sharing,
        "total_mib": watch.total,
        "peak_used_mib": {phase: watch.peaks.get(phase) for phase in ("idle", "rollouts", "training")},
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local Hugging Face model directory (default: random Qwen2 0.5B shape)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model_dir = args.model or str(build("qwen2-0.5b", Settings().cache_dir))
    results = {}
    for mode in ("auto", "sleep"):
        results[mode] = await measure(mode, model_dir, args.steps)
        entry = results[mode]
        print(f"{entry['gpu_sharing']} (ART_SKY_GPU_SHARING={mode}), GPU of {entry['total_mib']} MiB:")
        for phase, used in entry["peak_used_mib"].items():
            if used is not None:
                print(f"  {phase:9s} at most {used:7d} MiB used, {entry['total_mib'] - used:7d} MiB free")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
