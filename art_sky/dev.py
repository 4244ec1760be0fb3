"""ART's `art.dev` names an ART program writes, for `import art_sky as art`: the LoRA settings (`LoRAConfig`, ART
0.5.20+) and the model's internal config, of which art-sky reads the LoRA settings, the context length and the
chat template's arguments (art_sky/art_compat/models.py refuses the rest by name).
"""

from __future__ import annotations

from typing import Any

from typing_extensions import TypedDict  # pydantic reads these on Python 3.11 (art-sky's TrainableModel.lora_config)


class InitArgs(TypedDict, total=False):
    max_seq_length: int


class PeftArgs(TypedDict, total=False):
    r: int
    lora_alpha: int
    lora_dropout: float
    target_modules: list[str]
    bias: str


class LoRAConfig(TypedDict, total=False):
    """`lora_config=` of ART 0.5.20+'s TrainableModel (art-sky's own takes `config=ModelConfig(...)`)."""

    rank: int
    alpha: int
    dropout: float
    target_modules: list[str]
    max_seq_length: int


class InternalModelConfig(TypedDict, total=False):
    """`_internal_config=` of a TrainableModel: peft_args, init_args.max_seq_length and chat_template_kwargs are
    read; ART's engine tuning (engine_args and the like) is ignored with a warning, as the cluster server has its own
    settings."""

    init_args: InitArgs
    peft_args: PeftArgs
    engine_args: dict[str, Any]
    chat_template_kwargs: dict[str, Any]


class TrainSFTConfig(TypedDict, total=False):
    """ART's experimental SFT settings (`train_sft(_config=...)`): art-sky has none, so it must stay empty."""


__all__ = ["InitArgs", "InternalModelConfig", "LoRAConfig", "PeftArgs", "TrainSFTConfig"]
