"""Engine and trainer selection: the production pair where it can run, the portable pair otherwise, and the
health route says which; a forced choice that cannot run fails at start with what to do."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from art_sky.backends.base import Backend
from art_sky.cluster import selection
from art_sky.cluster.peft_trainer import PeftTrainer
from art_sky.cluster.portable_engine import PortableEngine
from art_sky.cluster.server import create_app
from art_sky.cluster.vllm_engine import VllmEngine
from art_sky.errors import ConfigError
from art_sky.settings import Settings


@pytest.fixture
def installed(monkeypatch):
    """Pretend these modules are (or are not) importable, and CUDA present or not."""
    def setup(*modules: str, cuda: bool = False):
        monkeypatch.setattr(selection, "importable", lambda name: name in modules)
        monkeypatch.setattr(selection, "device", lambda: type("D", (), {"type": "cuda" if cuda else "cpu"})())
    return setup


def test_auto_picks_vllm_when_importable(installed, tmp_path):
    installed("vllm")
    assert isinstance(selection.select_engine(Settings(engine="auto"), tmp_path, "key"), VllmEngine)
    installed()
    assert isinstance(selection.select_engine(Settings(engine="auto"), tmp_path, "key"), PortableEngine)


def test_forced_engine_that_cannot_run_is_a_config_error(installed, tmp_path):
    installed()
    with pytest.raises(ConfigError, match="vllm is not installed"):
        selection.select_engine(Settings(engine="vllm"), tmp_path, "key")
    with pytest.raises(ConfigError, match="unknown engine 'sglang'"):
        selection.select_engine(Settings(engine="sglang"), tmp_path, "key")
    installed("vllm")
    assert isinstance(selection.select_engine(Settings(engine="portable"), tmp_path, "key"), PortableEngine)


def test_unsloth_only_with_cuda(installed):
    installed("unsloth", cuda=False)
    assert type(selection.select_trainer(Settings(trainer="auto"))) is PeftTrainer
    with pytest.raises(ConfigError, match="needs CUDA"):
        selection.select_trainer(Settings(trainer="unsloth"))
    with pytest.raises(ConfigError, match="unknown trainer"):
        selection.select_trainer(Settings(trainer="trl"))


def test_health_reports_the_selected_pair(tmp_path, monkeypatch):
    monkeypatch.setenv("ART_SKY_ENGINE", "portable")
    monkeypatch.setenv("ART_SKY_TRAINER", "auto")
    with TestClient(create_app(tmp_path, "key", Settings())) as client:
        health = client.get("/health").json()
    assert (health["engine"], health["trainer"], health["inference_port"]) == ("portable", "peft", None)
