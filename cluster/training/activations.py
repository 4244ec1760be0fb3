"""Activation checkpointing, decided per micro-batch: each decoder layer keeps only its input for the backward pass
and recomputes the rest there (transformers' own gradient checkpointing, non-reentrant), which costs about a third
more compute and leaves a micro-batch's activations at a layer's worth. ART_SKY_ACTIVATION_CHECKPOINTING=auto turns
it on only for a micro-batch whose activations (art_sky/capacity.py's estimate) would not fit the device's free
memory, so short micro-batches run at full speed and a long sequence (a 7B model at 8k tokens) still fits one GPU;
on a CPU auto never checkpoints. The Unsloth trainer keeps its own (always on).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from art_sky import capacity
from art_sky.errors import ConfigError
from art_sky.wire import RegisterRequest

from ..model_state import device


def activations_fit(model: Any, tokens: int) -> bool:
    """Would a micro-batch of `tokens` keep its activations in the device's free memory (what the allocator holds
    unused counts as free)? Always on a CPU."""
    if device().type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info()
    free += torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    return capacity.activation_bytes(capacity.Shape.of(model.config), tokens, checkpointing=False) <= free


def set_checkpointing(model: Any, on: bool) -> None:
    """Turn the model's activation checkpointing on or off (nothing when it already is)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if _checkpointing(base) == on:
        return
    if on:
        enable = getattr(base, "activation_checkpointing_enable", None)  # transformers >= 5.2x; the old name warns
        if enable is not None:
            enable({"use_reentrant": False})
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    disable = getattr(base, "activation_checkpointing_disable", None) or base.gradient_checkpointing_disable
    disable()
    with contextlib.suppress(AttributeError):  # transformers before 5 kept one hook, or none was added
        base.disable_input_require_grads()  # enabling added it; the next enable would add it again


def _checkpointing(base: Any) -> bool:
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # the new name, then the old
        if hasattr(type(base), name):
            return bool(getattr(base, name))
    return False


def refuse_unfit(
    request: RegisterRequest,
    model: Any,
    parameters: float,
    ranks: int,
    gpu_memory_bytes: int,
    microbatch_tokens: int,
    setting: str,
) -> None:
    """At registration: ConfigError, saying what to change, when the model's longest sequence (or a full
    micro-batch) cannot train beside its weights on the trainer's GPUs, even with checkpointing unless it is off."""
    tokens = max(microbatch_tokens, request.config.max_seq_length)
    problem = capacity.activation_problem(
        capacity.Shape.of(model.config), parameters, ranks, gpu_memory_bytes, tokens, checkpointing=setting != "off"
    )
    if problem:
        raise ConfigError(
            f"{request.base_model} cannot train here: {problem}. Register it with a smaller "
            "max_seq_length, lower ART_SKY_TRAIN_MICROBATCH_TOKENS, set ART_SKY_ACTIVATION_CHECKPOINTING"
            "=auto, or use more trainer GPUs or larger ones"
        )
