"""Settings are read once per entry point (environment, then .env in the working directory) and passed down: what
a remote server needs of them is forwarded the same way by every backend, and the client's timeouts follow them."""

from __future__ import annotations

import pytest

import art_sky as art
from art_sky.errors import ConfigError
from art_sky.settings import Settings
from art_sky.store import server_env


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A working directory whose .env is the only place the store is configured."""
    for name in (
        "ART_SKY_CHECKPOINT_URI",
        "ART_SKY_CHECKPOINT_ENDPOINT",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "ART_SKY_REQUEST_TIMEOUT",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_store_configured_only_in_dotenv_is_forwarded(project, monkeypatch):
    (project / ".env").write_text(
        "ART_SKY_CHECKPOINT_URI=s3://bucket/runs\nART_SKY_CHECKPOINT_ENDPOINT="
        "http://127.0.0.1:8333\nAWS_ACCESS_KEY_ID=from-dotenv\nAWS_SECRET_ACCESS_KEY=s\n"
    )
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "from-environment")  # the environment wins over .env
    env = server_env(Settings())
    assert env == {
        "ART_SKY_CHECKPOINT_URI": "s3://bucket/runs",
        "ART_SKY_CHECKPOINT_STRICT": "false",
        "ART_SKY_CHECKPOINT_ENDPOINT": "http://127.0.0.1:8333",
        "AWS_ACCESS_KEY_ID": "from-environment",
        "AWS_SECRET_ACCESS_KEY": "s",
    }
    # every backend forwards that same environment (the SkyPilot one as secrets)
    assert art.SSHBackend("me@127.0.0.1").options.env == env
    assert art.LocalBackend().env == env
    assert "AWS_SECRET_ACCESS_KEY=s" not in repr(Settings())


def test_no_store_forwards_nothing_and_a_bad_uri_fails_here(project):
    assert server_env(Settings()) == {}
    with pytest.raises(ConfigError, match="unknown scheme 'gcs'"):
        art.SSHBackend("me@127.0.0.1", checkpoint_uri="gcs://bucket/x")


async def test_openai_client_uses_the_request_timeout(project, monkeypatch):
    monkeypatch.setenv("ART_SKY_REQUEST_TIMEOUT", "7")
    backend = art.Backend(base_url="http://127.0.0.1:9", api_key="k")
    model = art.Model(name="m", project="p", inference_base_url=backend.inference_base_url)
    await model.register(backend)
    assert model.openai_client().timeout.read == 7.0
    (project / ".env").write_text("ART_SKY_REQUEST_TIMEOUT=11\n")
    monkeypatch.delenv("ART_SKY_REQUEST_TIMEOUT")
    unregistered = art.Model(name="m", project="p", inference_base_url="http://127.0.0.1:9/v1")
    assert unregistered.openai_client().timeout.read == 11.0
