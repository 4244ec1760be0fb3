"""ART's `art.dev` names an ART program writes, for `import art_sky as art`: the model's internal config, of which
art-sky reads the LoRA settings and the context length (art_sky/backends/art_protocol.py refuses the rest by name).
"""

from __future__ import annotations

from typing import Any, TypedDict


class InitArgs(TypedDict, total=False):
    max_seq_length: int


class PeftArgs(TypedDict, total=False):
    r: int
    lora_alpha: int
    lora_dropout: float
    target_modules: list[str]
    bias: str


class InternalModelConfig(TypedDict, total=False):
    """`_internal_config=` of a TrainableModel: peft_args and init_args.max_seq_length are read; ART's engine
    tuning (engine_args and the like) is ignored with a warning, as the cluster server has its own settings."""

    init_args: InitArgs
    peft_args: PeftArgs
    engine_args: dict[str, Any]


class TrainSFTConfig(TypedDict, total=False):
    """ART's experimental SFT settings (`train_sft(_config=...)`): art-sky has none, so it must stay empty."""


__all__ = ["InitArgs", "InternalModelConfig", "PeftArgs", "TrainSFTConfig"]
