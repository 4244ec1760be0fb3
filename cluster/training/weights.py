"""A model's trainable state, the LoRA and its AdamW: snapshotted before a step and put back if the step fails,
saved with each checkpoint, loaded on a restart. One implementation for the trainer in the server process and for
each sharded trainer rank (cluster/training/sharded.py), whose parameters are `DTensor` shards: the same calls
copy a rank's own shards.

The optimizer's state is saved keyed by parameter name (torch.distributed.checkpoint's full state dict), not by
position, so a checkpoint written by one process resumes on N ranks and the other way round.
"""

from __future__ import annotations

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

from art_sky.layout import OPTIMIZER_STATE

ADAPTER = "default"


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
    moments = {i: {key: _host(value) for key, value in optimizer.state[p].items()}
               for i, p in enumerate(params) if p in optimizer.state}
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


def save_optimizer(state: dict[str, Any], directory: Path) -> None:
    (directory / OPTIMIZER_STATE).parent.mkdir(exist_ok=True)
    torch.save(_to_host(state), directory / OPTIMIZER_STATE)


def read_optimizer(step_dir: Path) -> dict[str, Any] | None:
    """The optimizer state saved with a step, or None (a step saved before art-sky kept it)."""
    saved = step_dir / OPTIMIZER_STATE
    return torch.load(saved, map_location="cpu", weights_only=True) if saved.is_file() else None


def load_optimizer(model: Any, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Put a saved state into the optimizer (on ranks: each takes its shards). A state saved by position (art-sky
    before name-keyed checkpoints) is read in the order of the LoRA's parameters, which is the optimizer's."""
    if saved["state"] and all(isinstance(key, int) for key in saved["state"]):
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        saved = {"state": {names[i]: value for i, value in saved["state"].items()},
                 "param_groups": [group | {"params": [names[i] for i in group["params"]]}
                                  for group in saved["param_groups"]]}
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
