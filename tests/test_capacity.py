"""Will a model fit a cluster: refused before anything is rented (its size from its name, the GPU's memory from a
table) and again when it registers on a sharded trainer (its real parameter count)."""

from __future__ import annotations

import pytest

from art_sky import SkyPilotBackend
from art_sky.capacity import check_before_renting, layout, parameters_from_name
from art_sky.cluster.training.rank_group import RankGroup, ShardedTrainer
from art_sky.errors import ConfigError
from art_sky.settings import Settings
from art_sky.wire import RegisterRequest

GIB = 2**30


@pytest.mark.parametrize("name, parameters", [
    ("Qwen/Qwen2.5-32B-Instruct", 32e9), ("meta-llama/Llama-3.1-70B-Instruct", 70e9), ("Qwen/Qwen2.5-0.5B", 0.5e9),
    ("mistralai/Mixtral-8x7B-v0.1", 56e9), ("HuggingFaceTB/SmolLM2-135M", 135e6), ("art-sky/tiny", None),
    ("Qwen/Qwen3-4B-Thinking-2507", 4e9),
])
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
    backend = SkyPilotBackend.for_cluster(cluster_name="big", gpu="H100:8", num_nodes=2, env_path=env,
                                          base_model="meta-llama/Llama-3.1-70B-Instruct")
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
