"""The ART-style user API: code written for ART runs with `import art_sky as art`."""

from art_sky.wire import ModelConfig, TrainConfig, TrainSFTConfig

from .gather import TooManyRolloutErrors, gather_trajectory_groups
from .model import Model, TrainableModel
from .pipeline import pipeline
from .trajectories import History, Trajectory, TrajectoryGroup

__all__ = [
    "History",
    "Model",
    "ModelConfig",
    "TooManyRolloutErrors",
    "TrainConfig",
    "TrainSFTConfig",
    "TrainableModel",
    "Trajectory",
    "TrajectoryGroup",
    "gather_trajectory_groups",
    "pipeline",
]
