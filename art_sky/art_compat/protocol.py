"""ART's Backend protocol (`art.backend.Backend`) on art-sky's backends: the methods an `art.TrainableModel`, ART's
`PipelineTrainer` and ART's helpers call, over the cluster server's requests. Every art-sky backend mixes this in
(art_sky/backends/base.py), so an ART program changes one line.

`register` and `train` are art-sky's own (both clients call them; art_sky/backends/base.py); the rest is here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from art_sky.client.trajectories import wire_trajectory
from art_sky.errors import ConfigError, first_problem
from art_sky.wire import DeleteCheckpointsRequest, ModelInfo, SFTRequest, TrainProgress

from .capture import legacy
from .models import chat_template_kwargs, openai_server_config, served, sft_settings

if TYPE_CHECKING:
    from art_sky.server_client import ServerClient
    from art_sky.settings import Settings

# The steps leases pin, per served run (`served(model)`), in this task and the tasks it starts (as ART's own
# LocalBackend pins them): inside `async with backend.adapter_lease(model, step)`, `model.get_inference_name()`
# is `name@step`.
_pinned: ContextVar[dict[str, int] | None] = ContextVar("art_sky_pinned_steps", default=None)


class ArtProtocol:
    """ART's Backend protocol, for a `Backend`, over its public members (its `server_client`, `register`,
    `model_info`, `run_step`)."""

    if TYPE_CHECKING:  # the public members of the backend this is mixed into (art_sky/backends/base.py)
        api_key: str | None
        settings: Settings

        @property
        def server_client(self) -> ServerClient: ...
        @property
        def inference_base_url(self) -> str: ...

        @property
        def known_hourly_cost(self) -> float | None: ...

        async def ensure_started(self) -> None: ...

        async def register(self, model: Any) -> ModelInfo | None: ...

        async def model_info(self, model: Any) -> ModelInfo: ...

        async def run_step(self, model: Any, route: str, request: Any, verbose: bool) -> TrainProgress: ...

    async def _prepare_backend_for_training(self, model: Any, config: Any = None) -> tuple[str, str]:
        """ART's second step of `register`: the OpenAI endpoint and key its `openai_client()` uses.
        `register(_openai_client_config=...)` tunes ART's own vLLM server; art-sky's engine runs on the cluster
        server with its own settings, so, as `_internal_config`'s engine settings, it is accepted and named."""
        openai_server_config(config)
        await self.register(model)  # idempotent: ART registered it a moment ago
        assert self.api_key is not None
        return self.inference_base_url, self.api_key

    def _model_inference_name(self, model: Any, step: int | None = None) -> str:
        """The run's served name (`name`, or `name:run` for another run of the name) serves its newest step;
        `...@step` an earlier one, or the step a lease pins."""
        name = served(model)
        if step is None:
            step = (_pinned.get() or {}).get(name)
        return name if step is None else f"{name}@{step}"

    async def _get_step(self, model: Any) -> int:
        return (await self.model_info(model)).step

    async def _delete_checkpoint_files(self, model: Any, steps_to_keep: list[int]) -> None:
        """ART's `delete_checkpoints` picks the steps (from its own history); the server deletes the rest (never the
        current step nor a leased one)."""
        await self.ensure_started()
        await self.server_client.delete_checkpoints(served(model), DeleteCheckpointsRequest(keep_steps=steps_to_keep))

    # ART's hooks for `model.log(groups, split="train")`: it times the steps between its calls and, with a price,
    # adds `costs/gpu` (ART's LocalBackend does the same for the GPUs it knows).
    def supports_automatic_train_step_metrics(self) -> bool:
        return True

    def automatic_gpu_cost_per_hour_usd(self, model: Any) -> float | None:
        return self.known_hourly_cost

    @asynccontextmanager
    async def exact_adapter_lease(self, model: Any, step: int) -> AsyncIterator[None]:
        """ART's (0.5.20+): while held, `name@step` is served by exactly that step (`model.get_inference_name()`
        names it inside the block) and its checkpoint is not deleted."""
        async with self.adapter_retention_lease(model, step), _pin(served(model), step):
            yield

    @asynccontextmanager
    async def adapter_lease(self, model: Any, step: int) -> AsyncIterator[None]:
        """ART's: inference inside the block samples step `step` (art-sky serves every step by its exact adapter, so
        this is `exact_adapter_lease`)."""
        async with self.exact_adapter_lease(model, step):
            yield

    @asynccontextmanager
    async def adapter_retention_lease(self, model: Any, step: int) -> AsyncIterator[None]:
        """ART's: step `step`'s checkpoint is kept while held (the server refuses a step it does not have)."""
        await self.ensure_started()
        lease = await self.server_client.lease(served(model), step)
        try:
            yield
        finally:
            await self.server_client.release(served(model), lease)

    async def _train_sft(
        self,
        model: Any,
        trajectories: Iterable[Any],
        config: Any,
        dev_config: Mapping[str, Any] | None = None,
        verbose: bool = False,
    ) -> AsyncIterator[dict[str, float]]:
        """ART's SFT on the model's LoRA: next-token loss on the assistant turns (`assistant_turns` "all" or
        "last"), one optimizer step per batch of `config.batch_size` trajectories ("auto": 2, as ART's
        LocalBackend), one training step per call. Yields each batch's metrics with ART's names."""
        batch_size, rates, turns = sft_settings(config, dev_config)
        defaults = chat_template_kwargs(model)
        wired = [wire_trajectory(legacy(t), f"trajectory {i}", defaults) for i, t in enumerate(trajectories)]
        if not wired:
            raise ConfigError("_train_sft() got no trajectories")
        try:
            request = SFTRequest(trajectories=wired, batch_size=batch_size, learning_rates=rates, assistant_turns=turns)
        except ValidationError as exc:
            raise ConfigError(f"train_sft: {first_problem(exc)[1]}") from exc
        result = await self.run_step(model, "sft", request, verbose)
        for batch in result.batches:
            yield {
                "loss/train": batch["loss"],
                "loss/learning_rate": batch["learning_rate"],
                "loss/grad_norm": batch["grad_norm"],
                "data/step_trainer_tokens": batch["trained_tokens"],
                "data/step_num_trajectories": result.metrics["num_trajectories"],
                "data/step_num_dropped_trajectories": result.metrics["num_dropped_trajectories"],
                "data/step_num_gradient_steps": float(len(result.batches)),
            }


@asynccontextmanager
async def _pin(name: str, step: int) -> AsyncIterator[None]:
    token = _pinned.set((_pinned.get() or {}) | {name: step})
    try:
        yield
    finally:
        _pinned.reset(token)
