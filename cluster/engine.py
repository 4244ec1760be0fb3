"""What the server asks of an inference engine (the portable one, vLLM): one small protocol, as httpx's transports.

An engine raises art-sky errors (art_sky.errors), never HTTP ones; the server maps them to status codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from openai.types.chat import ChatCompletion

from art_sky.wire import ChatCompletionRequest, RegisterRequest

from .model_state import ModelState


@dataclass
class Job:
    """One validated chat completion request: its prompt ids and its completion budget."""

    state: ModelState
    request: ChatCompletionRequest
    prompt: list[int]
    budget: int


class Engine(Protocol):
    name: str
    inference_port: int | None  # an engine's own OpenAI port on the server's machine (vLLM), reported by /health

    def check(self, request: RegisterRequest) -> None:
        """Before a model is loaded: ConfigError when this engine cannot serve it."""

    def attach(self, state: ModelState) -> None:
        """Serve a newly registered model."""

    def pause(self) -> None:
        """Before a training step: hold inference (and free device memory where the engine can)."""

    def resume(self, state: ModelState, trained: bool) -> None:
        """After a training step: serve the new step (when `trained`), then release inference."""

    def prepare(self, state: ModelState, request: ChatCompletionRequest) -> Job:
        """Validate one request before it queues: ValueError (a 400) when it asks too much."""

    def run(self, jobs: list[Job]) -> list[ChatCompletion | Exception]:
        """Blocking: complete a batch of jobs for one model; a refused job's entry is an art-sky error."""

    def close(self) -> None:
        """Stop what the engine started (a child server)."""
