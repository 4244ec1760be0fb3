"""Backends: a cluster server reachable over HTTP, and how the machine running it was obtained."""

from .art_protocol import TrainResult
from .attach import attach
from .base import Backend
from .local import LocalBackend
from .skypilot import SkyPilotBackend
from .ssh import SSHBackend

__all__ = ["Backend", "LocalBackend", "SSHBackend", "SkyPilotBackend", "TrainResult", "attach"]
