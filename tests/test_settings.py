"""Settings are read once per entry point (environment, then .env in the working directory) and passed down: what
a remote server needs of them is forwarded the same way by every backend, and the client's timeouts follow them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import art_sky as art
from art_sky import settings as settings_module
from art_sky.cli import app
from art_sky.errors import ConfigError
from art_sky.settings import NOT_SETTINGS, Settings, variables
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
    # every backend forwards that same environment (the SkyPilot one in its 0600 secrets file)
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


# -- the settings' surface ------------------------------------------------------------------------------------------

# Every setting, by its variable(s), and its type: a new setting, a removed one or a changed choice is a deliberate
# change of this list (as torchtitan's test_no_new_cli_options). A choice is a Literal, checked once, in Settings.
SURFACE = {
    "ART_SKY_CACHE_DIR": "Path",
    "ART_SKY_API_KEY": "SecretStr | None",
    "ART_SKY_SERVER_START_TIMEOUT": "float",
    "ART_SKY_REQUEST_TIMEOUT": "float",
    "ART_SKY_MAX_REQUEST_BYTES": "int",
    "ART_SKY_MAX_COMPLETION_REQUEST_BYTES": "int",
    "ART_SKY_TRAIN_RETRY_TIMEOUT": "float",
    "ART_SKY_MAX_LEASES_PER_MODEL": "int",
    "ART_SKY_MAX_NEW_TOKENS_LIMIT": "int",
    "ART_SKY_MAX_BATCH_ROWS": "int",
    "ART_SKY_TRAIN_MICROBATCH_TOKENS": "int",
    "ART_SKY_ACTIVATION_CHECKPOINTING": "Literal['auto', 'on', 'off']",
    "ART_SKY_HOME": "Path",
    "ART_SKY_SSH_CONNECT_TIMEOUT": "float",
    "ART_SKY_REMOTE_INSTALL_TIMEOUT": "float",
    "ART_SKY_REMOTE_PYTHON": "str | None",
    "ART_SKY_ENGINE": "Literal['auto', 'vllm', 'portable']",
    "ART_SKY_TRAINER": "Literal['auto', 'unsloth', 'peft']",
    "ART_SKY_ALLOW_UNTESTED_STACK": "bool",
    "ART_SKY_GPU_SHARING": "Literal['auto', 'sleep']",
    "ART_SKY_ENGINE_GPU_MEMORY": "float",
    "ART_SKY_GPU_LAYOUT": "Literal['auto', 'shared', 'dedicated']",
    "ART_SKY_TRAINER_GPUS": "int",
    "ART_SKY_TRAINER_CPU_RANKS": "int",
    "ART_SKY_NODES": "int",
    "ART_SKY_RENDEZVOUS_HOST": "str",
    "ART_SKY_TRAINER_MAX_RESTARTS": "int",
    "ART_SKY_TRAINER_RANK_TIMEOUT": "float",
    "ART_SKY_ENGINE_TENSOR_PARALLEL": "int",
    "ART_SKY_DEDICATED_GPU_MEMORY": "float",
    "ART_SKY_VLLM_START_TIMEOUT": "float",
    "ART_SKY_VLLM_MAX_LORAS": "int",
    "ART_SKY_VLLM_COMPACT_JSON": "bool",
    "ART_SKY_TOOL_PARSER": "str",
    "ART_SKY_CHECKPOINT_URI": "str | None",
    "ART_SKY_CHECKPOINT_ENDPOINT": "str | None",
    "ART_SKY_CHECKPOINT_BACKGROUND": "bool",
    "ART_SKY_CHECKPOINT_STRICT": "bool",
    "ART_SKY_CLUSTER_NAME": "str | None",
    "ART_SKY_OWNER_STALE_AFTER": "float",
    "ART_SKY_HOURLY_COST": "float | None",
    "ART_SKY_TRAIN_STALL_TIMEOUT": "float",
    "ART_SKY_RECOVER_AFTER": "float",
    "ART_SKY_RECOVER_TIMEOUT": "float",
    "WANDB_API_KEY": "SecretStr | None",
    "ART_SKY_SKYPILOT_PYTHON": "Path | None",
    "LANGFUSE_PUBLIC_KEY": "str | None",
    "LANGFUSE_SECRET_KEY": "SecretStr | None",
    "LANGFUSE_HOST, LANGFUSE_BASE_URL": "str | None",
}


def type_name(annotation) -> str:
    text = annotation.__name__ if isinstance(annotation, type) else repr(annotation)
    return re.sub(r"\b(typing|pathlib|pydantic\.types)\.", "", text)


def test_every_setting_is_listed_with_its_type():
    found = {", ".join(variables(n, f)): type_name(f.annotation) for n, f in Settings.model_fields.items()}
    assert found == SURFACE


def test_every_art_sky_variable_the_code_uses_is_known():
    """A name the code or its templates read or set is a setting or one of NOT_SETTINGS, so the warning about
    unknown names never fires for art-sky's own."""
    root = Path(__file__).resolve().parent.parent
    files = [p for folder in ("art_sky", "client", "cluster", "templates") for p in (root / folder).rglob("*.*")]
    used = {
        v for p in files if p.suffix in (".py", ".yaml") for v in re.findall(r"ART_SKY_[A-Z][A-Z0-9_]*", p.read_text())
    }
    known = {v for n, f in Settings.model_fields.items() for v in variables(n, f)} | NOT_SETTINGS
    assert sorted(used - known) == []


# -- what a user reads --------------------------------------------------------------------------------------------


@pytest.fixture
def warnings_anew(monkeypatch, tmp_path):
    """Each unknown name is warned about once per process: here, as if for the first time; no clusters recorded."""
    monkeypatch.setattr(settings_module, "_warned", set())
    monkeypatch.setenv("ART_SKY_HOME", str(tmp_path / "home"))


def test_a_bad_value_names_its_variable_and_where_it_was_read(project, warnings_anew, monkeypatch):
    (project / ".env").write_text("ART_SKY_REQUEST_TIMEOUT=soon\n")
    result = CliRunner().invoke(app, ["status"])
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == (
        f"error: ART_SKY_REQUEST_TIMEOUT=soon (in {project / '.env'}) is not a valid setting: input should be a "
        "valid number, unable to parse string as a number\n"
    )
    monkeypatch.setenv("ART_SKY_ENGINE", "vlm")
    with pytest.raises(ConfigError) as caught:
        Settings()
    assert str(caught.value) == (
        f"ART_SKY_REQUEST_TIMEOUT=soon (in {project / '.env'}) is not a valid setting: input should be a valid "
        "number, unable to parse string as a number; ART_SKY_ENGINE=vlm (in the environment) is not a valid "
        "setting: use one of auto, vllm, portable (did you mean vllm?)"
    )
    with pytest.raises(ConfigError, match=r"^Settings\(trainer='trl'\) is not a valid setting: use one of auto, "):
        Settings(trainer="trl", engine="auto", request_timeout=1)


def test_an_unknown_art_sky_name_is_a_warning_with_the_nearest_setting(project, warnings_anew, monkeypatch):
    monkeypatch.setenv("ART_SKY_ENGNE", "vllm")
    (project / ".env").write_text("ART_SKY_CHECKPOINT_UIR=s3://bucket/runs\nART_SKY_WHATEVER=1\n")
    result = CliRunner().invoke(app, ["status", "--json"])
    assert (result.exit_code, result.stdout) == (0, "[]\n"), result.output
    assert sorted(result.stderr.splitlines()) == [
        f"warning: ART_SKY_CHECKPOINT_UIR (in {project / '.env'}) is not an art-sky setting and is ignored: did you "
        "mean ART_SKY_CHECKPOINT_URI?",
        "warning: ART_SKY_ENGNE (in the environment) is not an art-sky setting and is ignored: did you mean "
        "ART_SKY_ENGINE?",
        f"warning: ART_SKY_WHATEVER (in {project / '.env'}) is not an art-sky setting and is ignored (the "
        "settings: docs/reference/settings.md)",
    ]
    again = CliRunner().invoke(app, ["status", "--json"])
    assert again.stderr == ""  # once per process
