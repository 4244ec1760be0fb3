"""art-sky: train LLM agents with GRPO on rented GPUs. `import art_sky as art` gives ART's client API.

The public names load on first use (PEP 562), so the cluster server (`python -m art_sky.cluster`) imports none of
the laptop's stack (backends, SSH, tunnel).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "Backend": "art_sky.backends",
    "LocalBackend": "art_sky.backends",
    "SSHBackend": "art_sky.backends",
    "SkyPilotBackend": "art_sky.backends",
    "TrainResult": "art_sky.backends",
    "attach": "art_sky.backends",
    "BootstrapOptions": "art_sky.remote.install",
    "Model": "art_sky.client",
    "ModelConfig": "art_sky.client",
    "TrainableModel": "art_sky.client",
    "TrainConfig": "art_sky.client",
    "TrainSFTConfig": "art_sky.client",
    "Trajectory": "art_sky.client",
    "TrajectoryGroup": "art_sky.client",
    "gather_trajectory_groups": "art_sky.client",
    "pipeline": "art_sky.client",
}
__all__ = sorted(_PUBLIC) + ["__version__", "dev", "rewards"]

if TYPE_CHECKING:
    from art_sky.backends import Backend, LocalBackend, SkyPilotBackend, SSHBackend, TrainResult, attach
    from art_sky.client import (
        Model,
        ModelConfig,
        TrainableModel,
        TrainConfig,
        TrainSFTConfig,
        Trajectory,
        TrajectoryGroup,
        gather_trajectory_groups,
        pipeline,
    )
    from art_sky.remote.install import BootstrapOptions


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif name in ("client", "cluster", "backends", "dev", "rewards"):  # `art.dev.X` works before any import
        value = importlib.import_module(f"art_sky.{name}")
    else:
        raise AttributeError(f"module 'art_sky' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
