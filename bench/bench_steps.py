"""A training step's wall time split through the real server app (in this process, the portable engine): the
trainer, the checkpoint on the step's path (`time/step_checkpoint_s`), the adapter swap, the whole step. Three
modes in the same run, on one model each, fixed trajectories so all train the same steps: the checkpoint written
before the step commits (ART_SKY_CHECKPOINT_BACKGROUND=false), written in the background and answered before it is
on disk (the code before the durable answer: a kill -9 right after train() returned could lose the step), and
written in the background with the answer waiting for it (the default: durable once returned). The durable
guarantee's cost is the last two's ratio.

    python bench/bench_steps.py                                        # CPU: the tiny model
    python bench/bench_steps.py --shape qwen2-0.5b --lora-rank 16 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from random_models import SHAPES, build

from art_sky.settings import Settings

KEY = "bench-key"
MODES = (  # name, checkpoint_background, answered once on disk
    ("checkpoint on the step's path", False, True),
    ("checkpoint in the background, answered before it is on disk", True, False),
    ("checkpoint in the background, answered once on disk", True, True),
)
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


@contextlib.asynccontextmanager
async def server(background: bool, args, model_dir: Path, work: Path) -> AsyncIterator[httpx.AsyncClient]:
    """A server app with the bench model registered, and its client."""
    from art_sky.cluster.server import create_app

    settings = Settings(engine="portable", trainer="peft", cache_dir=args.cache_dir, checkpoint_background=background)
    app = create_app(work, KEY, settings)
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
        yield client


async def train(client: httpx.AsyncClient, step: int, args) -> dict:
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
    return {key: result["metrics"][key] for key in PHASES} | {"returned_s": returned}


def answer_early(roots: list[Path]) -> None:
    """The models under `roots` are answered before their step is on disk (the code before the durable answer)."""
    from art_sky.cluster.checkpoint_writer import CheckpointWriter

    durable = CheckpointWriter.durable

    def maybe(self, step: int) -> None:
        if not any(root in self.checkpoints.path.parents for root in roots):
            durable(self, step)

    CheckpointWriter.durable = maybe  # type: ignore[method-assign]


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
    steps: dict[str, list[dict]] = {mode: [] for mode, _, _ in MODES}
    with tempfile.TemporaryDirectory(prefix="bench-steps-") as work:
        roots = [Path(work) / f"mode-{index}" for index in range(len(MODES))]
        answer_early([root for root, (_, _, durable) in zip(roots, MODES, strict=True) if not durable])
        async with contextlib.AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(server(background, args, model_dir, root))
                for root, (_, background, _) in zip(roots, MODES, strict=True)
            ]
            for step in range(args.steps + 1):  # the first is a warm-up; the modes in turn, so noise falls on all
                for client, (mode, _, _) in zip(clients, MODES, strict=True):
                    timed = await train(client, step, args)
                    if step:
                        steps[mode].append(timed)
    for mode, _, _ in MODES:
        medians = {key: statistics.median(s[key] for s in steps[mode]) for key in (*PHASES, "returned_s")}
        results["modes"][mode] = {"medians": medians, "steps": steps[mode]}
        print(
            f"{args.shape} on {device}, {mode}: "
            + ", ".join(f"{k.removeprefix('time/')} {v:.3f}" for k, v in medians.items())
        )
    before, after, durable = (m["medians"] for m in results["modes"].values())
    results["checkpoint_ratio"] = before["time/step_checkpoint_s"] / max(after["time/step_checkpoint_s"], 1e-9)
    results["returned_ratio"] = before["returned_s"] / after["returned_s"]
    results["durable_ratio"] = durable["returned_s"] / after["returned_s"]
    added = durable["returned_s"] - after["returned_s"]
    print(
        f"checkpoint on the step's path {results['checkpoint_ratio']:.1f}x shorter in the background; "
        f"train() returns {results['returned_ratio']:.2f}x sooner; answered once on disk (durable) the step takes "
        f"{results['durable_ratio']:.3f}x the background step's time ({added:+.3f} s)"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
