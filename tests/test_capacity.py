"""Will a model fit a cluster: refused before anything is rented (its size from its name, the GPU's memory from a
table) and again when it registers on a sharded trainer (its real parameter count), and its longest sequence's
activations beside the weights (with activation checkpointing unless it is off)."""

from __future__ import annotations

import pytest

from art_sky import SkyPilotBackend
from art_sky.capacity import (
    Shape,
    activation_bytes,
    activation_problem,
    check_before_renting,
    layout,
    parameters_from_name,
)
from art_sky.cluster.training.rank_group import RankGroup, ShardedTrainer
from art_sky.errors import ConfigError
from art_sky.settings import Settings
from art_sky.wire import RegisterRequest

GIB = 2**30


@pytest.mark.parametrize(
    "name, parameters",
    [
        ("Qwen/Qwen2.5-32B-Instruct", 32e9),
        ("meta-llama/Llama-3.1-70B-Instruct", 70e9),
        ("Qwen/Qwen2.5-0.5B", 0.5e9),
        ("mistralai/Mixtral-8x7B-v0.1", 56e9),
        ("HuggingFaceTB/SmolLM2-135M", 135e6),
        ("art-sky/tiny", None),
        ("Qwen/Qwen3-4B-Thinking-2507", 4e9),
    ],
)
def test_a_models_size_is_read_from_its_name(name, parameters):
    assert parameters_from_name(name) == parameters


def test_one_gpu_trains_what_fits_beside_the_engine_and_a_node_of_eight_shards_seventy_billion():
    h100 = 80 * GIB
    assert layout(1, h100).problem(14e9) is None
    assert "per GPU" in layout(1, h100).problem(32e9)
    assert layout(8, h100, trainer_gpus=4).problem(70e9) is None  # 35 GiB a trainer GPU, vLLM on four
    assert "vLLM's copy" in layout(8, h100, trainer_gpus=7).problem(70e9)  # vLLM alone on one GPU
    assert layout(8, h100, nodes=2, trainer_gpus=4).trainer_ranks == 8


def test_what_cannot_train_is_refused_before_renting_with_what_to_change():
    with pytest.raises(ConfigError, match="num_nodes=0"):
        check_before_renting("H100:8", 0, 1, None)
    with pytest.raises(ConfigError, match="ART_SKY_TRAINER_GPUS=8 .* at most 7"):
        check_before_renting("H100:8", 1, 8, None)
    with pytest.raises(ConfigError, match="Llama-3.1-70B.*does not fit 1 node.*H100:1.*more GPUs per node"):
        check_before_renting("H100:1", 1, 1, "meta-llama/Llama-3.1-70B-Instruct")
    check_before_renting(None, 2, 1, None)  # CPU nodes: the trainer's ranks are gloo processes
    check_before_renting(["H100:8", "A100-80GB:8"], 2, 4, "meta-llama/Llama-3.1-70B-Instruct")
    check_before_renting("H100:1", 1, 1, "someone/unknown-model")  # the server checks it when it registers
    check_before_renting("TPU-v5:8", 1, 1, "Qwen/Qwen2.5-32B")  # not in the table: the server checks


def test_initialize_cluster_refuses_before_anything_is_rented(tmp_path, monkeypatch):
    monkeypatch.setenv("ART_SKY_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="does not fit"):
        SkyPilotBackend.for_cluster(cluster_name="big", gpu="L4:1", base_model="Qwen/Qwen2.5-32B-Instruct")
    env = tmp_path / "cluster.env"
    env.write_text("ART_SKY_TRAINER_GPUS=2\n")
    with pytest.raises(ConfigError, match="ART_SKY_TRAINER_GPUS=2"):
        SkyPilotBackend.for_cluster(cluster_name="big", gpu="H100:2", env_path=env)
    backend = SkyPilotBackend.for_cluster(
        cluster_name="big", gpu="H100:8", num_nodes=2, env_path=env, base_model="meta-llama/Llama-3.1-70B-Instruct"
    )
    assert backend.spec.num_nodes == 2


def test_a_model_whose_shards_do_not_fit_is_refused_when_it_registers(tmp_path):
    """The tiny model's real size against trainer GPUs too small for it; the ranks never start."""
    settings = Settings(cache_dir=tmp_path / "cache")
    trainer = ShardedTrainer(RankGroup(settings, ranks_per_node=2), mirrored=False, gpu_memory_bytes=10_000)
    try:
        with pytest.raises(ConfigError, match="does not fit this cluster.*2 trainer GPU"):
            trainer.load_model(RegisterRequest(name="m", project="p", base_model="art-sky/tiny"), settings, None)
        assert trainer.group._process is None
    finally:
        trainer.close()


QWEN_7B = Shape(layers=28, hidden=3584, intermediate=18944, kv_width=512)


def test_a_7b_lora_at_8k_tokens_fits_one_80_gb_gpu_with_activation_checkpointing_only():
    h100 = 80 * GIB
    assert activation_bytes(QWEN_7B, 1, checkpointing=False) == pytest.approx(7.8e6, rel=0.05)  # measured at 7B
    assert activation_problem(QWEN_7B, 7.6e9, 1, h100, 8192, checkpointing=True) is None
    problem = activation_problem(QWEN_7B, 7.6e9, 1, h100, 8192, checkpointing=False)
    assert "8192 tokens keeps 59.3 GiB of activations (ART_SKY_ACTIVATION_CHECKPOINTING=off)" in problem
    assert activation_problem(QWEN_7B, 7.6e9, 1, h100, 4096, checkpointing=False) is None  # half of it does


def test_a_model_whose_longest_sequence_cannot_train_is_refused_when_it_registers():
    from types import SimpleNamespace

    from transformers import Qwen2Config

    from art_sky.cluster.training.activations import refuse_unfit

    model = SimpleNamespace(
        config=Qwen2Config(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
        )
    )
    request = RegisterRequest(
        name="m", project="p", base_model="Qwen/Qwen2.5-7B-Instruct", config={"max_seq_length": 32768}
    )
    refuse_unfit(request, model, 7.6e9, 1, 80 * GIB, 4096, "auto")  # 32k tokens fit, checkpointed
    with pytest.raises(
        ConfigError,
        match="Qwen2.5-7B-Instruct cannot train here: a micro-batch of 32768 tokens "
        ".*smaller max_seq_length.*ART_SKY_ACTIVATION_CHECKPOINTING=auto",
    ):
        refuse_unfit(request, model, 7.6e9, 1, 80 * GIB, 4096, "off")
    with pytest.raises(ConfigError, match="with activation checkpointing"):
        refuse_unfit(request, model, 7.6e9, 1, 24 * GIB, 4096, "auto")  # an L4: the weights leave no room
