"""`art-sky checkpoints` against a real S3 server: push, ls, pull (byte-identical), rm, and errors as one line."""

from __future__ import annotations

import os

import pytest
from rich.console import Console
from typer.testing import CliRunner

from art_sky.checkpoints import CheckpointDir
from art_sky.cli.checkpoints import app as checkpoints_app

pytest_plugins = ["fixtures_s3"]


@pytest.fixture
def s3_env(s3_server, monkeypatch) -> str:
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    uri = f"s3://{s3_server.new_bucket()}/cli"
    monkeypatch.setenv("ART_SKY_CHECKPOINT_URI", uri)
    return uri


def invoke(*args: str):
    return CliRunner().invoke(checkpoints_app, list(args), catch_exceptions=False)


def test_push_ls_pull_rm(s3_env, tmp_path, monkeypatch):
    local = CheckpointDir(tmp_path / ".art", "proj", "agent")
    for step in (1, 2, 3):
        local.save(
            step,
            lambda tmp: (tmp / "adapter_model.safetensors").write_bytes(os.urandom(300_000)),
            base_model="art-sky/tiny",
            metrics={"reward": step / 4},
        )
        local.append_history({"step": step, "val/reward": [0.1, 0.9, 0.5][step - 1]})

    pushed = invoke("push", "proj", "agent", "--path", str(tmp_path / ".art"))
    assert pushed.exit_code == 0 and pushed.output.count("sent") == 3
    again = invoke("push", "proj", "agent", "--path", str(tmp_path / ".art"), "--step", "3")
    assert "already in the store" in again.output

    monkeypatch.setattr("art_sky.cli.checkpoints.console", Console(width=250))
    listing = invoke("ls")
    assert listing.exit_code == 0
    for step in (1, 2, 3):
        assert f"{s3_env}/proj/models/agent/checkpoints/000{step}" in listing.output
    assert "reward=0.75" in listing.output

    monkeypatch.chdir(tmp_path)
    pulled = invoke("pull", "proj", "agent")
    assert pulled.exit_code == 0, pulled.output
    assert (tmp_path / "agent-0003" / "adapter_model.safetensors").read_bytes() == (
        local.step_dir(3) / "adapter_model.safetensors"
    ).read_bytes()

    pruned = invoke("rm", "proj", "agent", "--keep-last", "1", "--best-metric", "val/reward")
    assert pruned.exit_code == 0 and "[1]" in pruned.output  # keeps 3 (newest) and 2 (best val/reward)
    invoke("rm", "proj", "agent", "2")
    remaining = invoke("pull", "proj", "agent", "--step", "2")
    assert remaining.exit_code == 1 and "step 2 is not in" in remaining.output and "[3]" in remaining.output


def test_errors_are_one_line_naming_the_uri(s3_server, monkeypatch):
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    result = invoke("ls", "--uri", "s3://missing-bucket-cli/x")
    assert result.exit_code == 1
    assert "s3://missing-bucket-cli/x" in result.output and "bucket does not exist" in result.output
    assert "Traceback" not in result.output
    result = invoke("ls", "--uri", "ftp://x/y")
    assert result.exit_code == 1 and "unknown scheme" in result.output


def test_every_command_has_help():
    for command in ("ls", "pull", "push", "rm"):
        result = invoke(command, "--help")
        assert result.exit_code == 0 and "--uri" in result.output
