"""A real S3 server for the tests: SeaweedFS (`weed server -s3`) on 127.0.0.1, data in a temp dir.

Two identities: `admin` may do everything, `reader` may only read and list (the "no permission" case).
Buckets are not created on upload, so a missing bucket is an error as on AWS.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ADMIN = ("artsky-admin", "artsky-admin-secret")
READER = ("artsky-reader", "artsky-reader-secret")
START_TIMEOUT = 60.0


@dataclass
class S3Server:
    endpoint: str

    def env(self, *, read_only: bool = False) -> dict[str, str]:
        """Environment for a process (or obstore) that talks to this server as admin or as the read-only reader."""
        keys = READER if read_only else ADMIN
        return {
            "AWS_ACCESS_KEY_ID": keys[0],
            "AWS_SECRET_ACCESS_KEY": keys[1],
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
        }

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ADMIN[0],
            aws_secret_access_key=ADMIN[1],
            region_name="us-east-1",
        )

    def new_bucket(self) -> str:
        name = f"test-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


def weed_binary() -> str:
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if found is None:
        raise RuntimeError("SeaweedFS's `weed` is not installed: run tests/setup/20-seaweedfs.sh")
    return found


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@contextmanager
def seaweedfs(root: Path) -> Iterator[S3Server]:
    """Run SeaweedFS with its data under `root` until the block exits (also used by bench/bench_store.py)."""
    (root / "data").mkdir(parents=True, exist_ok=True)
    identities = [
        {"name": name, "credentials": [{"accessKey": keys[0], "secretKey": keys[1]}], "actions": actions}
        for name, keys, actions in [
            ("admin", ADMIN, ["Admin", "Read", "List", "Tagging", "Write"]),
            ("reader", READER, ["Read", "List"]),
        ]
    ]
    (root / "s3.json").write_text(json.dumps({"identities": identities}))
    # Every bucket is a collection with volumes of its own. Left to itself, weed sizes its volume slots from the free
    # disk (1 GiB each) and grows 7 volumes per collection, so a suite's worth of buckets ran out of slots on a small
    # disk ("Not enough data nodes found", a 500 on upload). One volume per bucket, fixed sparse slots: no limit.
    # Its volume server also refuses every write while less than 1% of the disk is free ("no volume server capacity
    # registered"), which a 250 GB CI disk with 2 GB free is: the tests write kilobytes, so 64 MiB free is enough.
    (root / "master.toml").write_text("[master.volume_growth]\ncopy_1 = 1\ncopy_2 = 2\ncopy_3 = 3\ncopy_other = 1\n")
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = free_ports(8)
    command = [
        weed_binary(),
        "server",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={root / 'data'}",
        f"-master.port={master}",
        f"-master.port.grpc={master_grpc}",
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=256",
        "-volume.max=400",
        "-volume.minFreeSpace=64MiB",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_grpc}",
        "-filer",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_grpc}",
        "-s3",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3_grpc}",
        f"-s3.config={root / 's3.json'}",
        "-s3.autoCreateBucket=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
    ]
    with open(root / "weed.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=root, start_new_session=True)
        server = S3Server(endpoint=f"http://127.0.0.1:{s3}")
        try:
            _wait_ready(server, process, root / "weed.log")
            yield server
        finally:
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[S3Server]:
    with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


def _wait_ready(server: S3Server, process: subprocess.Popen, log: Path) -> None:
    """Ready when a bucket can be created and written (the volume server has registered), not merely listening."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"SeaweedFS exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            httpx.get(server.endpoint, timeout=2)
            client = server.client()
            bucket = server.new_bucket()
            client.put_object(Bucket=bucket, Key="probe", Body=b"ok")
            client.delete_object(Bucket=bucket, Key="probe")
            client.delete_bucket(Bucket=bucket)
            return
        except Exception:  # not up yet: connection refused, or no volume server registered
            time.sleep(0.3)
    text = log.read_text()
    disk = [line for line in text.splitlines() if "disk free" in line][-1:]  # weed's own word on a full disk
    raise RuntimeError(f"SeaweedFS was not ready within {START_TIMEOUT:.0f}s:\n" + "\n".join(disk + [text[-3000:]]))
