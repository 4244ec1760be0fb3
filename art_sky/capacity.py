"""Will the model fit the cluster? The memory arithmetic behind the scale table (docs/guides/scale.md), used twice:
by `initialize_cluster` / `art-sky up` before anything is rented (the model's size read from its name, the GPU's memory
from a table), and by the server when a model registers (the model's real parameter count, nvidia-smi's memory).

Training holds the bf16 base weights sharded over the trainer's ranks (FSDP2): 2 bytes x parameters / ranks on each
trainer GPU, at most TRAINER_SHARE of its memory (the rest: the layer being gathered, activations, the LoRA and its
AdamW state, CUDA's own). vLLM holds a full copy per replica, split over at most one node's inference GPUs (tensor
parallel never crosses nodes), at most ENGINE_SHARE of their memory (the rest: the KV cache). On one GPU both jobs
share it (vLLM sleeps or shares Unsloth's weights while a step trains): the trainer's rule.

When the model registers, the server knows its shape too: a micro-batch as long as the model's max_seq_length must
keep its activations beside the weights' shard in ACTIVATION_SHARE of a trainer GPU, with activation checkpointing
(ART_SKY_ACTIVATION_CHECKPOINTING) unless it is off; `activation_bytes` is also what the trainer weighs against the
device's free memory to decide, micro-batch by micro-batch, whether to checkpoint (cluster/training/activations.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from art_sky.errors import ConfigError

BF16_BYTES = 2
TRAINER_SHARE = 0.6
ENGINE_SHARE = 0.9
ACTIVATION_SHARE = 0.9  # of a trainer GPU: the weights' shard and a micro-batch's activations (the rest: the LoRA
# and its AdamW state, the LM head's slices, CUDA's own)

# GiB of memory per accelerator, as SkyPilot names them (the common training GPUs).
GPU_MEMORY_GIB = {
    "H100": 80,
    "H100-MEGA": 80,
    "H100-SXM": 80,
    "H200": 141,
    "B200": 180,
    "GH200": 96,
    "A100-80GB": 80,
    "A100": 40,
    "L40S": 48,
    "L40": 48,
    "L4": 24,
    "A10G": 24,
    "A10": 24,
    "A6000": 48,
    "RTX6000-Ada": 48,
    "V100": 16,
    "V100-32GB": 32,
    "T4": 16,
    "MI300X": 192,
}

_SIZE = re.compile(r"(?<![A-Za-z0-9.])(?:(\d+)x)?(\d+(?:\.\d+)?)([BbMm])(?![A-Za-z])")


@dataclass(frozen=True)
class Layout:
    """How a cluster's GPUs are split: per node, `engine_gpus` for vLLM and `trainer_gpus` for the trainer's ranks
    (the same GPU in the shared layout)."""

    gpu_memory_bytes: int
    nodes: int
    engine_gpus: int
    trainer_gpus: int

    @property
    def shared(self) -> bool:
        return self.engine_gpus == 0

    @property
    def trainer_ranks(self) -> int:
        return self.trainer_gpus * self.nodes

    def problem(self, parameters: float) -> str | None:
        """Why a model of `parameters` does not fit, with the arithmetic; None when it fits."""
        weights = parameters * BF16_BYTES
        gib = self.gpu_memory_bytes / 2**30
        per_rank = weights / self.trainer_ranks
        if per_rank > TRAINER_SHARE * self.gpu_memory_bytes:
            return (
                f"its {weights / 2**30:.0f} GiB of bf16 weights over {self.trainer_ranks} trainer GPU(s) are "
                f"{per_rank / 2**30:.0f} GiB per GPU, more than {TRAINER_SHARE:.0%} of a {gib:.0f} GiB GPU"
            )
        if not self.shared and weights / self.engine_gpus > ENGINE_SHARE * self.gpu_memory_bytes:
            return (
                f"vLLM's copy ({weights / 2**30:.0f} GiB of bf16 weights) over a node's {self.engine_gpus} "
                f"inference GPU(s) is {weights / self.engine_gpus / 2**30:.0f} GiB per GPU, more than "
                f"{ENGINE_SHARE:.0%} of a {gib:.0f} GiB GPU"
            )
        return None

    def largest(self) -> float:
        """The most parameters that fit (the docs' scale table)."""
        trainer = TRAINER_SHARE * self.gpu_memory_bytes * self.trainer_ranks / BF16_BYTES
        if self.shared:
            return trainer
        return min(trainer, ENGINE_SHARE * self.gpu_memory_bytes * self.engine_gpus / BF16_BYTES)


@dataclass(frozen=True)
class Shape:
    """What a micro-batch's activations depend on: a decoder's layers and widths."""

    layers: int
    hidden: int
    intermediate: int
    kv_width: int

    @classmethod
    def of(cls, config: Any) -> Shape:
        """From a transformers model config."""
        hidden, heads = config.hidden_size, config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(
            config.num_hidden_layers,
            hidden,
            getattr(config, "intermediate_size", None) or 4 * hidden,
            kv_heads * head_dim,
        )


def activation_bytes(shape: Shape, tokens: int, checkpointing: bool) -> float:
    """What a micro-batch of `tokens` keeps for its backward pass (bf16, LoRA on every projection): 2 x (12 hidden +
    2 kv + 5 intermediate) bytes a token in each layer, which fits the peak memory measured on an H200 at Qwen2.5's
    0.5B and 7B shapes (7.8 MB a token at 7B, the logits' share taken out); with checkpointing, each layer's input
    and one layer's worth."""
    layer = 2 * (12 * shape.hidden + 2 * shape.kv_width + 5 * shape.intermediate) * tokens
    if checkpointing:
        return shape.layers * BF16_BYTES * shape.hidden * tokens + layer
    return shape.layers * layer


def activation_problem(
    shape: Shape, parameters: float, ranks: int, gpu_memory_bytes: int, tokens: int, checkpointing: bool
) -> str | None:
    """Why a micro-batch of `tokens` cannot train beside the weights' shard on trainer GPUs of `gpu_memory_bytes`,
    with the arithmetic; None when it fits."""
    weights = parameters * BF16_BYTES / ranks
    needed = activation_bytes(shape, tokens, checkpointing)
    if weights + needed <= ACTIVATION_SHARE * gpu_memory_bytes:
        return None
    how = "with activation checkpointing" if checkpointing else "(ART_SKY_ACTIVATION_CHECKPOINTING=off)"
    return (
        f"a micro-batch of {tokens} tokens keeps {needed / 2**30:.1f} GiB of activations {how} beside "
        f"{weights / 2**30:.1f} GiB of bf16 weights per trainer GPU, more than {ACTIVATION_SHARE:.0%} of a "
        f"{gpu_memory_bytes / 2**30:.0f} GiB GPU"
    )


def layout(gpus_per_node: int, memory_bytes: int, nodes: int = 1, trainer_gpus: int = 1) -> Layout:
    """The layout the server chooses (cluster/node/placement.py): one GPU shared, else the last `trainer_gpus` of
    each node train and the others serve. A trainer with every GPU of a node is refused: on the laptop before
    renting, on the server when it splits its node's GPUs."""
    if nodes < 1:
        raise ConfigError(f"num_nodes={nodes}: a cluster has at least one node")
    if gpus_per_node <= 1:
        return Layout(memory_bytes, nodes, engine_gpus=0, trainer_gpus=1)
    if trainer_gpus >= gpus_per_node:
        raise ConfigError(
            f"ART_SKY_TRAINER_GPUS={trainer_gpus} leaves none of a node's {gpus_per_node} GPUs for "
            f"vLLM: give the trainer at most {gpus_per_node - 1}, ask for more GPUs per node, or set "
            "ART_SKY_GPU_LAYOUT=shared"
        )
    return Layout(memory_bytes, nodes, engine_gpus=gpus_per_node - trainer_gpus, trainer_gpus=trainer_gpus)


def accelerator(gpu: str) -> tuple[str, int, int | None]:
    """'H100:8' -> ('H100', 8, its memory in bytes, or None for an accelerator not in the table)."""
    name, _, count = gpu.partition(":")
    try:
        number = int(float(count)) if count else 1
    except ValueError:
        raise ConfigError(f"gpu={gpu!r}: write an accelerator and a count, e.g. H100:8") from None
    gib = {key.lower(): value for key, value in GPU_MEMORY_GIB.items()}.get(name.strip().lower())
    return name, number, gib * 2**30 if gib else None


def parameters_from_name(model: str) -> float | None:
    """A model's parameter count from the size in its name ('Qwen2.5-32B-Instruct': 32e9, 'Mixtral-8x7B': 56e9);
    None when its name gives none."""
    found = [
        (int(experts or 1), float(size), unit.lower())
        for experts, size, unit in _SIZE.findall(model.rsplit("/", 1)[-1])
    ]
    if not found:
        return None
    experts, size, unit = max(found, key=lambda f: f[0] * f[1] * (1e9 if f[2] == "b" else 1e6))
    return experts * size * (1e9 if unit == "b" else 1e6)


def check_before_renting(gpu: str | list[str] | None, nodes: int, trainer_gpus: int, base_model: str | None) -> None:
    """Refuse, before anything is rented, a cluster the model cannot train on: each accelerator asked for (a
    fallback list: each one) checked with the model's size from its name. Unknown sizes and accelerators pass:
    the server checks again with the real numbers when the model registers."""
    if nodes < 1:
        raise ConfigError(f"num_nodes={nodes}: a cluster has at least one node")
    if gpu is None:  # CPU nodes (several: gloo ranks, ART_SKY_TRAINER_CPU_RANKS each): nothing to weigh up front
        return
    for choice in [gpu] if isinstance(gpu, str) else gpu:
        name, count, memory = accelerator(choice)
        planned = layout(count, memory or 0, nodes, trainer_gpus)  # checks the trainer's GPUs against the node's
        parameters = parameters_from_name(base_model) if base_model else None
        if memory is None or parameters is None:
            continue
        problem = planned.problem(parameters)
        if problem:
            raise ConfigError(
                f"{base_model} ({parameters / 1e9:g}B parameters) does not fit {nodes} node(s) of "
                f"{choice}: {problem}. Ask for more GPUs per node, more nodes (the trainer shards "
                f"over every node's trainer GPUs: ART_SKY_TRAINER_GPUS), larger GPUs, or a smaller "
                "model"
            )
