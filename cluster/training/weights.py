"""A model's trainable state, the LoRA and its AdamW: snapshotted before a step and put back if the step fails,
saved with each checkpoint, loaded on a restart. One implementation for the trainer in the server process and for
each sharded trainer rank (cluster/training/sharded.py), whose parameters are `DTensor` shards: the same calls
copy a rank's own shards.

The optimizer's state is saved keyed by parameter name (torch.distributed.checkpoint's full state dict), not by
position, so a checkpoint written by one process resumes on N ranks and the other way round; as safetensors (its
tensors) with its param groups in the file's metadata, like the adapter (`training_state/optimizer.pt`, torch.save's
format of older checkpoints, is still read).

A step's checkpoint is staged first (`stage`: the adapter as PEFT saves it and the optimizer's state, copied to host
memory, the only part on the step's path) and written from that copy (cluster/checkpoint_writer.py).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from art_sky.layout import OPTIMIZER_STATE, OPTIMIZER_STATE_PICKLED

from .tensor_file import save_tensors

ADAPTER = "default"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # PEFT's names, what vLLM loads
ADAPTER_CONFIG = "adapter_config.json"


def make_optimizer(model: Any) -> torch.optim.Optimizer:
    """AdamW over the LoRA's parameters; the learning rate is set by each step."""
    return torch.optim.AdamW(trainable(model), lr=1e-5, weight_decay=0.0)


def trainable(model: Any) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


@dataclass
class Snapshot:
    weights: list[torch.Tensor]
    optimizer: dict[int, dict[str, Any]]  # by the parameter's position: its state's values


def snapshot(model: Any, optimizer: torch.optim.Optimizer) -> Snapshot:
    """Copies in host memory of the LoRA's weights and the optimizer's state (the device keeps its memory for
    training); on a rank, of its own shards."""
    params = trainable(model)
    moments = {
        i: {key: _host(value) for key, value in optimizer.state[p].items()}
        for i, p in enumerate(params)
        if p in optimizer.state
    }
    return Snapshot([_host(p) for p in params], moments)


def restore(model: Any, optimizer: torch.optim.Optimizer, saved: Snapshot) -> None:
    """Copy a snapshot back in place (shards stay shards); optimizer state the step created is dropped."""
    with torch.no_grad():
        for i, (param, value) in enumerate(zip(trainable(model), saved.weights, strict=True)):
            _local(param).copy_(value)
            if i not in saved.optimizer:
                optimizer.state.pop(param, None)
                continue
            state = optimizer.state[param]
            for key, value in saved.optimizer[i].items():
                if isinstance(value, torch.Tensor) and isinstance(state.get(key), torch.Tensor):
                    _local(state[key]).copy_(value)
                else:
                    state[key] = value
    optimizer.zero_grad(set_to_none=True)
    model.eval()


def optimizer_state(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's whole state keyed by parameter name, on the host. On ranks a collective: every rank calls it
    and every rank gets the whole state (the LoRA's moments: small)."""
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))


@dataclass
class Staged:
    """A step's adapter and optimizer state on the host, as PEFT and this module save them."""

    adapter: dict[str, torch.Tensor]  # PEFT's keys (no adapter name)
    config: Any  # the LoRA's PEFT config, as saved (inference mode)
    optimizer: dict[str, Any] | None  # keyed by parameter name; None: a step saved without it (not a resume point)

    @property
    def nbytes(self) -> int:
        moments = self.optimizer["state"].values() if self.optimizer is not None else []
        tensors = [
            *self.adapter.values(),
            *(value for entries in moments for value in entries.values() if isinstance(value, torch.Tensor)),
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    def write_adapter(self, directory: Path) -> None:
        """The adapter, in PEFT's layout (what vLLM and PEFT load)."""
        directory.mkdir(parents=True, exist_ok=True)
        save_tensors(self.adapter, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        self.config.save_pretrained(str(directory))

    def write(self, directory: Path) -> None:
        self.write_adapter(directory)
        if self.optimizer is not None:
            save_optimizer(self.optimizer, directory)

    def release(self) -> None:
        """Written: nothing to free but memory."""


def stage(model: Any, optimizer: torch.optim.Optimizer | None) -> Staged:
    """Copies on the host of the adapter (`PeftModel.save_pretrained`'s tensors and config) and the optimizer's
    state (unless None): what a step's checkpoint holds. Not for ranks (whose parameters are shards)."""
    from peft import get_peft_model_state_dict

    config = copy.deepcopy(model.peft_config[ADAPTER])
    config.inference_mode = True
    adapter = {name: _host(value) for name, value in get_peft_model_state_dict(model, adapter_name=ADAPTER).items()}
    if optimizer is None:
        return Staged(adapter, config, None)
    return Staged(
        adapter,
        config,
        _named_state(model, optimizer) if optimizer.state else _to_host(optimizer_state(model, optimizer)),
    )


def _named_state(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer_state` of a model in this process (no shards) whose optimizer has stepped, on the host, without
    torch.distributed.checkpoint's walk of the model (a tenth of a second at 7B). A fresh optimizer goes through
    `optimizer_state`, which makes its state with a step at learning rate 0, as the ranks' does."""
    names = {param: name for name, param in model.named_parameters() if param.requires_grad}
    state = {names[param]: _to_host(values) for param, values in optimizer.state.items()}
    groups = [
        {key: value for key, value in group.items() if key != "params"}
        | {"params": [names[param] for param in group["params"]]}
        for group in optimizer.param_groups
    ]
    return {"state": state, "param_groups": groups}


def save_optimizer(state: dict[str, Any], directory: Path) -> None:
    """safetensors: each parameter's state tensors as `<name>/<key>` (a scalar step count included), the rest (its
    param groups, any value that is not a tensor) as JSON in the metadata."""
    tensors, values = {}, {}
    for name, entries in state["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}/{key}"] = _local(value).detach().cpu().contiguous()  # staged on the host: no copy
            else:
                values[f"{name}/{key}"] = value
    (directory / OPTIMIZER_STATE).parent.mkdir(exist_ok=True)
    save_tensors(
        tensors,
        directory / OPTIMIZER_STATE,
        metadata={"param_groups": json.dumps(state["param_groups"]), "values": json.dumps(values)},
    )


def read_optimizer(step_dir: Path) -> dict[str, Any] | None:
    """The optimizer state saved with a step, or None (a step saved before art-sky kept it)."""
    from safetensors import safe_open

    saved = step_dir / OPTIMIZER_STATE
    if not saved.is_file():
        pickled = step_dir / OPTIMIZER_STATE_PICKLED
        return torch.load(pickled, map_location="cpu", weights_only=True) if pickled.is_file() else None
    state: dict[str, dict[str, Any]] = {}
    with safe_open(str(saved), framework="pt") as handle:
        metadata = handle.metadata()
        for key in handle.keys():
            name, _, entry = key.rpartition("/")
            state.setdefault(name, {})[entry] = handle.get_tensor(key)
    for key, value in json.loads(metadata["values"]).items():
        name, _, entry = key.rpartition("/")
        state.setdefault(name, {})[entry] = value
    return {"state": state, "param_groups": json.loads(metadata["param_groups"])}


def load_optimizer(model: Any, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Put a saved state into the optimizer (on ranks: each takes its shards). A state saved by position (art-sky
    before name-keyed checkpoints) is read in the order of the LoRA's parameters, which is the optimizer's."""
    if saved["state"] and all(isinstance(key, int) for key in saved["state"]):
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        saved = {
            "state": {names[i]: value for i, value in saved["state"].items()},
            "param_groups": [
                group | {"params": [names[i] for i in group["params"]]} for group in saved["param_groups"]
            ],
        }
    set_optimizer_state_dict(model, optimizer, saved, options=StateDictOptions(full_state_dict=True))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A rank's own shard of a sharded tensor; the tensor itself otherwise."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _host(value: Any) -> Any:
    return _local(value).detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def _to_host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _host(value)
    if isinstance(value, dict):
        return {key: _to_host(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_host(item) for item in value)
    return value
