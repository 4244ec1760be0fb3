"""art-sky: train LLM agents with GRPO on rented GPUs. `import art_sky as art` gives ART's client API."""

__version__ = "0.1.0"

from art_sky.backends import Backend, LocalBackend, SkyPilotBackend, SSHBackend, TrainResult, attach  # noqa: E402
from art_sky.client import (  # noqa: E402
    Model,
    ModelConfig,
    TrainableModel,
    TrainConfig,
    Trajectory,
    TrajectoryGroup,
    gather_trajectory_groups,
)

__all__ = ["Backend", "LocalBackend", "Model", "ModelConfig", "SSHBackend", "SkyPilotBackend", "TrainConfig",
           "TrainableModel", "TrainResult", "Trajectory", "TrajectoryGroup", "attach", "gather_trajectory_groups",
           "__version__"]
