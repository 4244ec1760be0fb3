"""A training step's wall time split through the real server app (in this process, the portable engine): the
trainer, the checkpoint on the step's path (`time/step_checkpoint_s`), the adapter swap, the whole step. The
checkpoint written before the step returns (ART_SKY_CHECKPOINT_BACKGROUND=false, the baseline) against written in
the background (the default), in the same run, on one model each; fixed trajectories, so both train the same steps.

    python bench/bench_steps.py                                        # CPU: the tiny model
    python bench/bench_steps.py --shape qwen2-0.5b --lora-rank 16 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from random_models import SHAPES, build

from art_sky.settings import Settings

KEY = "bench-key"
PHASES = ("time/step_trainer_s", "time/step_checkpoint_s", "time/step_swap_s")


def group(step: int, size: int, words: int) -> dict:
    """A train request's group on fixed answers (rendered by the chat template, no sampling)."""
    return {
        "trajectories": [
            {
                "items": [
                    {"role": "user", "content": f"Say something {step}."},
                    {"kind": "choice", "content": " ".join(f"w{step}-{i}-{w}" for w in range(words))},
                ],
                "reward": float(i % 2),
            }
            for i in range(size)
        ]
    }


async def run(mode: str, background: bool, args, model_dir: Path, work: Path) -> list[dict]:
    from art_sky.cluster.server import create_app

    fields = {"checkpoint_background": background} if "checkpoint_background" in Settings.model_fields else {}
    if not background and not fields:
        mode += " (the code before background checkpoints)"
    app = create_app(
        work / mode.split()[0], KEY, Settings(engine="portable", trainer="peft", cache_dir=args.cache_dir, **fields)
    )
    steps = []
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://server",
            timeout=3600,
            headers={"authorization": f"Bearer {KEY}"},
        ) as client,
    ):
        response = await client.post(
            "/art/models",
            json={
                "name": "bench",
                "project": "bench",
                "base_model": str(model_dir),
                "config": {"lora_rank": args.lora_rank, "lora_alpha": 2 * args.lora_rank, "max_seq_length": 4096},
            },
        )
        assert response.status_code == 200, response.text
        for step in range(args.steps + 1):  # the first is a warm-up
            started = time.perf_counter()
            response = await client.post(
                "/art/models/bench/train",
                json={
                    "groups": [group(step, args.group, args.words) for _ in range(args.groups)],
                    "config": {"learning_rate": 1e-4},
                },
            )
            returned = time.perf_counter() - started
            result = json.loads(response.text.splitlines()[-1])
            assert result["type"] == "result", result
            if step:
                steps.append({key: result["metrics"][key] for key in PHASES} | {"returned_s": returned})
    return steps


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode, after one warm-up step")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group", type=int, default=4, help="trajectories per group")
    parser.add_argument("--words", type=int, default=8, help="words in each answer")
    parser.add_argument("--cache-dir", type=Path, default=Settings().cache_dir)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model_dir = build(args.shape, args.cache_dir)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    results = {
        "shape": args.shape,
        "device": device,
        "torch": torch.__version__,
        "lora_rank": args.lora_rank,
        "modes": {},
    }
    with tempfile.TemporaryDirectory(prefix="bench-steps-") as work:
        for mode, background in (("checkpoint on the step's path", False), ("checkpoint in the background", True)):
            steps = await run(mode, background, args, model_dir, Path(work))
            medians = {key: statistics.median(s[key] for s in steps) for key in (*PHASES, "returned_s")}
            results["modes"][mode] = {"medians": medians, "steps": steps}
            print(
                f"{args.shape} on {device}, {mode}: "
                + ", ".join(f"{k.removeprefix('time/')} {v:.3f}" for k, v in medians.items())
            )
    before, after = (m["medians"] for m in results["modes"].values())
    results["checkpoint_ratio"] = before["time/step_checkpoint_s"] / max(after["time/step_checkpoint_s"], 1e-9)
    results["returned_ratio"] = before["returned_s"] / after["returned_s"]
    print(
        f"checkpoint on the step's path {results['checkpoint_ratio']:.1f}x shorter in the background; "
        f"train() returns {results['returned_ratio']:.2f}x sooner"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
