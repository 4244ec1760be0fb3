"""The checkpoint store against a real S3 server (SeaweedFS) and a directory: round trip, atomic visibility,
corruption caught, bad URIs and credentials named."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from fleet_nodes import API_KEY

from art_sky.checkpoints import CheckpointDir, CorruptCheckpointError
from art_sky.errors import CheckpointStoreError, ConfigError
from art_sky.settings import Settings
from art_sky.store import CHUNK, CheckpointStore

pytest_plugins = ["fixtures_s3"]

PROJECT, MODEL = "proj", "agent"


def make_step(root, step: int, size: int) -> CheckpointDir:
    """A step shaped like a PEFT LoRA: a config and a weights file of `size` random bytes."""
    checkpoints = CheckpointDir(root, PROJECT, MODEL)

    def write(tmp):
        (tmp / "adapter_config.json").write_text(f'{{"r": 8, "step": {step}}}')
        (tmp / "adapter_model.safetensors").write_bytes(os.urandom(size))

    checkpoints.save(step, write, base_model="art-sky/tiny", metrics={"reward": step / 10})
    return checkpoints


def files_of(directory) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def s3_uri(s3_server, monkeypatch) -> str:
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    return f"s3://{s3_server.new_bucket()}/runs"


@pytest.fixture(params=["s3", "file"])
def store(request, tmp_path) -> CheckpointStore:
    uri = request.getfixturevalue("s3_uri") if request.param == "s3" else f"file://{tmp_path}/store"
    return CheckpointStore(uri)


async def test_round_trip_is_byte_identical_and_resync_sends_nothing(store, tmp_path):
    size = 2 * CHUNK + 12345  # several multipart parts and download ranges, the last one short
    local = make_step(tmp_path / "a", 3, size)
    sent = []
    assert await store.upload_step(local, 3, sent.append) == local.manifest(3).size_bytes
    assert sum(sent) == size + len((local.step_dir(3) / "adapter_config.json").read_bytes())
    assert await store.upload_step(local, 3) == 0  # unchanged step: nothing transferred

    [manifest] = await store.manifests(PROJECT, MODEL)
    assert manifest == local.manifest(3)
    assert await store.models() == [(PROJECT, MODEL)]
    dest = tmp_path / "pulled"
    await store.download_step(PROJECT, MODEL, 3, dest)
    assert files_of(dest) == files_of(local.step_dir(3))


async def test_restore_takes_newest_step_and_history(store, tmp_path):
    local = make_step(tmp_path / "a", 1, 1000)
    make_step(tmp_path / "a", 2, 1000)
    local.append_history({"step": 2, "val/reward": 1.0})
    for step in (1, 2):
        await store.upload_step(local, step)
    await store.upload_history(local)

    fresh = CheckpointDir(tmp_path / "b", PROJECT, MODEL)
    assert await store.restore(fresh) == 2
    assert fresh.steps() == [2]
    assert files_of(fresh.step_dir(2)) == files_of(local.step_dir(2))
    assert fresh.history() == local.history()


async def test_delete_hides_then_removes_a_step(store, tmp_path):
    local = make_step(tmp_path / "a", 1, 1000)
    make_step(tmp_path / "a", 2, 1000)
    for step in (1, 2):
        await store.upload_step(local, step)
    await store.delete_steps(PROJECT, MODEL, [1])
    assert [m.step for m in await store.manifests(PROJECT, MODEL)] == [2]
    with pytest.raises(CheckpointStoreError, match="not in the store"):
        await store.download_step(PROJECT, MODEL, 1, tmp_path / "gone")


async def test_upload_killed_halfway_leaves_no_visible_step(s3_uri, s3_server, tmp_path):
    local = make_step(tmp_path / "a", 5, 6 * CHUNK)
    script = textwrap.dedent(f"""
        import asyncio, os, signal
        from art_sky.checkpoints import CheckpointDir
        from art_sky.store import CheckpointStore
        sent = 0
        def progress(n):
            global sent
            sent += n
            if sent > {3 * CHUNK}:
                os.kill(os.getpid(), signal.SIGKILL)
        store = CheckpointStore({s3_uri!r})
        asyncio.run(store.upload_step(CheckpointDir({str(tmp_path / "a")!r}, {PROJECT!r}, {MODEL!r}), 5, progress))
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], env=os.environ | s3_server.env(), timeout=120, capture_output=True
    )
    assert result.returncode == -9, result.stderr.decode()

    store = CheckpointStore(s3_uri)
    assert await store.manifests(PROJECT, MODEL) == []
    fresh = CheckpointDir(tmp_path / "b", PROJECT, MODEL)
    assert await store.restore(fresh) is None
    assert fresh.steps() == []
    # the same step uploads whole afterwards
    await store.upload_step(local, 5)
    assert [m.step for m in await store.manifests(PROJECT, MODEL)] == [5]


async def test_flipped_byte_is_caught_and_the_step_skipped(s3_uri, s3_server, tmp_path, caplog):
    local = make_step(tmp_path / "a", 1, 5000)
    make_step(tmp_path / "a", 2, 5000)
    store = CheckpointStore(s3_uri)
    for step in (1, 2):
        await store.upload_step(local, step)
    bucket, prefix = s3_uri.removeprefix("s3://").split("/", 1)
    key = f"{prefix}/{PROJECT}/models/{MODEL}/checkpoints/0002/adapter_model.safetensors"
    client = s3_server.client()
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))

    with pytest.raises(CorruptCheckpointError, match="0002/adapter_model.safetensors does not match"):
        await store.download_step(PROJECT, MODEL, 2, tmp_path / "pulled")
    assert not (tmp_path / "pulled").exists()

    fresh = CheckpointDir(tmp_path / "b", PROJECT, MODEL)
    with caplog.at_level(logging.WARNING, logger="art_sky.store"):
        assert await store.restore(fresh) == 1
    assert "skipping step 2" in caplog.text and "0002" in caplog.text
    assert fresh.steps() == [1]


def test_unknown_scheme_and_malformed_uris_are_named():
    for uri, problem in [
        ("ftp://host/x", "unknown scheme 'ftp'"),
        ("s3:///prefix-only", "names no bucket"),
        ("file://relative/path", "not an absolute"),
    ]:
        with pytest.raises(ConfigError, match=problem) as caught:
            CheckpointStore(uri)
        assert uri in str(caught.value)


async def test_missing_bucket_is_named(s3_server, monkeypatch, tmp_path):
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    store = CheckpointStore("s3://no-such-bucket-here/runs")
    with pytest.raises(CheckpointStoreError, match="s3://no-such-bucket-here/runs.*bucket does not exist"):
        await store.check()
    with pytest.raises(CheckpointStoreError, match="bucket does not exist"):
        await store.upload_step(make_step(tmp_path, 1, 100), 1)


async def test_wrong_credentials_are_named(s3_uri, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    store = CheckpointStore(s3_uri)
    with pytest.raises(CheckpointStoreError, match=f"{s3_uri}.*credentials were refused"):
        await store.check()


async def test_no_write_permission_is_named(s3_uri, s3_server, monkeypatch, tmp_path):
    for key, value in s3_server.env(read_only=True).items():
        monkeypatch.setenv(key, value)
    store = CheckpointStore(s3_uri)
    await store.check()  # reading is allowed
    with pytest.raises(CheckpointStoreError, match=f"{s3_uri}.*access denied"):
        await store.upload_step(make_step(tmp_path, 1, 100), 1)


WHERE = "in the environment or .env where you start art-sky, which forwards them to the cluster"


async def register(art_path, uri: str) -> httpx.Response:
    """Register the tiny model on a server (the real app, in this process) whose store is `uri`."""
    from art_sky.cluster.server import create_app

    app = create_app(art_path, "key", Settings(checkpoint_uri=uri))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://server", headers={"authorization": "Bearer key"}
    ) as client:
        return await client.post("/art/models", json={"name": MODEL, "project": PROJECT, "base_model": "art-sky/tiny"})


async def test_register_refuses_a_store_without_its_bucket_or_credentials_before_loading(
    s3_server, monkeypatch, tmp_path
):
    """At `register`, before the model loads: a bucket that does not exist, and S3 credentials that are not set
    (obstore's words were about the instance metadata service at 169.254.169.254), each said with its fix."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    uri = "s3://no-such-bucket-at-register/runs"
    response = await register(tmp_path / "art", uri)
    assert (response.status_code, response.json()) == (
        502,
        {
            "detail": f"checkpoint store {uri}: cannot list the store: the bucket does not exist: create it (`aws "
            "s3 mb s3://no-such-bucket-at-register`), or fix the bucket's name in the URI (ART_SKY_CHECKPOINT_URI)",
            "code": "store",
        },
    )
    assert not (tmp_path / "art" / PROJECT).exists()  # nothing loaded, no step 0 written

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    uri = f"s3://{s3_server.new_bucket()}/runs"
    response = await register(tmp_path / "art", uri)
    assert response.status_code == 502 and response.json()["detail"] == (
        f"checkpoint store {uri}: cannot list the store: no S3 credentials: AWS_ACCESS_KEY_ID and "
        f"AWS_SECRET_ACCESS_KEY are not set ({WHERE}), and this machine has no instance role to fall back on (its "
        "metadata service refused)"
    )
    assert not (tmp_path / "art" / PROJECT).exists()


def test_half_a_credential_pair_is_named_by_its_missing_variable(s3_server, monkeypatch):
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    for missing, beside in (
        ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID"),
        ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
    ):
        with monkeypatch.context() as patch:
            patch.delenv(missing)
            with pytest.raises(CheckpointStoreError) as caught:
                CheckpointStore("s3://bucket/runs")
        assert str(caught.value) == (
            f"checkpoint store s3://bucket/runs: cannot open it: {missing} is not set, though {beside} is: set both "
            f"({WHERE})"
        )
        assert caught.value.misconfigured


def test_a_url_with_credentials_or_a_known_secret_is_redacted():
    from art_sky.redact import add_secrets, redact

    add_secrets(["short", "a-secret-value-0123"])
    assert redact("GET http://user:pw@host:9/x?a=b, s3://k:v@bucket/p and https://tok@h") == (
        "GET http://***@host:9/x?a=b, s3://***@bucket/p and https://***@h"
    )
    assert redact("key a-secret-value-0123 and short, user@host:22, mailto:x@y") == (
        "key *** and short, user@host:22, mailto:x@y"  # short values and SSH targets are no secrets
    )


@pytest.mark.slow
def test_a_store_endpoints_password_is_in_no_log_line_or_error(s3_server, tmp_path):
    """An S3 endpoint written `http://user:pass@host:port` (obstore quotes its request URLs in its errors): the
    server's log and its answers show the URL as `http://***@...`, never the password nor the store's secret key."""
    from fleet_nodes import start_node

    def server(name: str, endpoint: str, bucket: str):
        env = s3_server.env() | {
            "ART_SKY_CHECKPOINT_URI": f"s3://{bucket}/runs",
            "ART_SKY_CHECKPOINT_ENDPOINT": endpoint,
        }
        return start_node(tmp_path, name, env=env)

    password, secret = "pass-in-the-url-0123", s3_server.env()["AWS_SECRET_ACCESS_KEY"]
    with_user = s3_server.endpoint.replace("http://", f"http://user:{password}@")
    closed = f"http://user:{password}@127.0.0.1:9"
    for name, endpoint, bucket, status in (
        ("seaweedfs", with_user, s3_server.new_bucket(), 200),  # obstore sends the request: the store works
        ("missing", with_user, "no-such-bucket-redacted", 502),
        ("refused", closed, s3_server.new_bucket(), 200),  # unreachable: a warning, and the upload fails
    ):
        node = server(name, endpoint, bucket)
        try:
            with node.client() as http:
                response = http.post(
                    "/art/models", json={"name": MODEL, "project": PROJECT, "base_model": "art-sky/tiny"}
                )
                assert response.status_code == status, response.text
                synced = http.post("/art/checkpoints/flush").text + http.get("/art/checkpoints/sync").text
        finally:
            node.stop()
        log = Path(node.layout.log_file).read_text()
        for text in (response.text, synced, log):
            assert password not in text and secret not in text and API_KEY not in text
        if name == "refused":
            # obstore's words, its request's URL in them: in the flush's errors and the log, redacted
            assert f"http://***@127.0.0.1:9/{bucket}/runs/{PROJECT}/models/{MODEL}/checkpoints/0000/" in synced
            assert f"cannot be checked now (checkpoint store s3://{bucket}/runs: cannot list the store: " in log
            assert f"Error performing GET http://***@127.0.0.1:9/{bucket}?delimiter" in log
        if name == "missing":
            assert response.json()["detail"].startswith(f"checkpoint store s3://{bucket}/runs: cannot list the store: ")
