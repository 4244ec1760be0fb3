"""Checkpoint store benchmark: art-sky's store (obstore) against `aws s3 sync` and plain boto3, side by side.

Starts SeaweedFS on 127.0.0.1 (tests/setup/20-seaweedfs.sh installs it, awscli and boto3), writes a checkpoint
step shaped like a PEFT LoRA (adapter_config.json + adapter_model.safetensors of random bytes) under /tmp, and
times upload, download and an unchanged re-sync for each contender, taking turns, best of `--runs`. art-sky's
download includes checking every file's sha256 against the manifest; the baselines check nothing. Everything is
deleted after.

    python bench/bench_store.py --size-mb 300 --size-mb 1024
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fixtures_s3 import S3Server, seaweedfs  # noqa: E402

from art_sky.checkpoints import CheckpointDir  # noqa: E402
from art_sky.store import CheckpointStore  # noqa: E402

PROJECT, MODEL, STEP = "bench", "lora", 1


def make_step(root: Path, size: int) -> CheckpointDir:
    checkpoints = CheckpointDir(root, PROJECT, MODEL)

    def write(tmp: Path) -> None:
        (tmp / "adapter_config.json").write_text('{"r": 64, "lora_alpha": 128, "peft_type": "LORA"}')
        with open(tmp / "adapter_model.safetensors", "wb") as handle:
            for _ in range(size // (1 << 24)):
                handle.write(os.urandom(1 << 24))
            handle.write(os.urandom(size % (1 << 24)))

    checkpoints.save(STEP, write, base_model="bench")
    return checkpoints


def timed(action: Callable[[int], None], run: int) -> float:
    start = time.perf_counter()
    action(run)
    return time.perf_counter() - start


class Contenders:
    def __init__(self, server: S3Server, bucket: str, checkpoints: CheckpointDir, work: Path):
        self.server, self.bucket, self.checkpoints, self.work = server, bucket, checkpoints, work
        self.step_dir = checkpoints.step_dir(STEP)
        self.client = server.client()
        self.env = os.environ | server.env()

    def uri(self, name: str) -> str:
        return f"s3://{self.bucket}/{name}"

    def fresh(self, name: str) -> Path:
        path = self.work / name
        shutil.rmtree(path, ignore_errors=True)
        return path

    # art-sky: CheckpointStore.upload_step / download_step (verified)
    def artsky_up(self, run: int) -> None:
        asyncio.run(CheckpointStore(self.uri(f"artsky-{run}")).upload_step(self.checkpoints, STEP))

    def artsky_down(self, run: int) -> None:
        asyncio.run(CheckpointStore(self.uri("artsky-0")).download_step(PROJECT, MODEL, STEP, self.fresh("dl-artsky")))

    def artsky_resync(self, run: int) -> None:
        sent = asyncio.run(CheckpointStore(self.uri("artsky-0")).upload_step(self.checkpoints, STEP))
        assert sent == 0, f"an unchanged step re-sync sent {sent} bytes"

    # aws s3 sync (awscli defaults)
    def aws(self, *args: str) -> None:
        subprocess.run(
            ["aws", "s3", "sync", "--only-show-errors", "--endpoint-url", self.server.endpoint, *args],
            check=True,
            env=self.env,
        )

    def aws_up(self, run: int) -> None:
        self.aws(str(self.step_dir), f"{self.uri(f'aws-{run}')}/")

    def aws_down(self, run: int) -> None:
        self.aws(f"{self.uri('aws-0')}/", str(self.fresh("dl-aws")))

    def aws_resync(self, run: int) -> None:
        self.aws(str(self.step_dir), f"{self.uri('aws-0')}/")

    # boto3 defaults: upload_file / download_file per file (managed multipart transfers)
    def boto_up(self, run: int) -> None:
        for path in sorted(self.step_dir.iterdir()):
            self.client.upload_file(str(path), self.bucket, f"boto-{run}/{path.name}")

    def boto_down(self, run: int) -> None:
        dest = self.fresh("dl-boto")
        dest.mkdir()
        for path in sorted(self.step_dir.iterdir()):
            self.client.download_file(self.bucket, f"boto-0/{path.name}", str(dest / path.name))


def bench(server: S3Server, size_mb: int, runs: int, work: Path) -> list[tuple[str, float, float, float | None]]:
    os.environ.update(server.env())
    bucket = server.new_bucket()
    checkpoints = make_step(work / "src", size_mb * 1024 * 1024)
    c = Contenders(server, bucket, checkpoints, work)
    c.boto_up(-1)  # warm-up: SeaweedFS grows its volumes on the first large write; no contender should pay for it
    contenders = [
        ("art-sky (obstore)", c.artsky_up, c.artsky_down, c.artsky_resync),
        ("aws s3 sync", c.aws_up, c.aws_down, c.aws_resync),
        ("boto3 defaults", c.boto_up, c.boto_down, None),
    ]
    times: dict[tuple[str, int], list[float]] = {}
    for column in (1, 2, 3):  # upload, download, re-sync; contenders take turns so noise hits them alike
        for run in range(runs):
            for contender in contenders:
                if contender[column] is not None:
                    times.setdefault((contender[0], column), []).append(timed(contender[column], run))
        print(f"  {['', 'upload', 'download', 're-sync'][column]}: done", file=sys.stderr)
    return [
        (name, min(times[name, 1]), min(times[name, 2]), min(times[name, 3]) if (name, 3) in times else None)
        for name, *_ in contenders
    ]


def table(size_mb: int, rows: list[tuple[str, float, float, float | None]]) -> str:
    ours = rows[0]
    lines = [
        f"checkpoint of {size_mb} MiB (best of runs; ratio = baseline time / art-sky time, >1: art-sky faster)",
        "| contender | upload s | upload MiB/s | download s | download MiB/s | unchanged re-sync s | "
        "upload ratio | download ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, up, down, resync in rows:
        lines.append(
            f"| {name} | {up:.2f} | {size_mb / up:.0f} | {down:.2f} | {size_mb / down:.0f} | "
            f"{'-' if resync is None else f'{resync:.2f}'} | {up / ours[1]:.2f} | {down / ours[2]:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, action="append", help="checkpoint size in MiB (repeatable; 300)")
    parser.add_argument("--runs", type=int, default=3, help="runs per measurement; the best counts")
    args = parser.parse_args()
    if shutil.which("aws") is None:
        sys.exit("`aws` is not installed: run tests/setup/20-seaweedfs.sh")
    work = Path(tempfile.mkdtemp(prefix="art-sky-bench-", dir="/tmp"))
    try:
        with seaweedfs(work / "seaweedfs") as server:
            for size_mb in args.size_mb or [300]:
                print(f"benchmarking {size_mb} MiB ...", file=sys.stderr)
                rows = bench(server, size_mb, args.runs, work / f"{size_mb}")
                print(table(size_mb, rows) + "\n", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
