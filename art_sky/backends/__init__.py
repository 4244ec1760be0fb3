"""Backends: a cluster server reachable over HTTP, and how the machine running it was obtained."""

from .base import Backend
from .local import LocalBackend
from .ssh import SSHBackend

__all__ = ["Backend", "LocalBackend", "SSHBackend"]
