"""`Model` and `TrainableModel`, with ART's names: register with a backend, sample through OpenAI, train."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Iterable, Mapping
from typing import Any, Protocol

import httpx
from openai import AsyncOpenAI
from pydantic import BaseModel, ConfigDict, Field, ModelWrapValidatorHandler, PrivateAttr, model_validator

from art_sky.dev import InternalModelConfig, LoRAConfig
from art_sky.dev import TrainSFTConfig as DevTrainSFTConfig
from art_sky.errors import ConfigError
from art_sky.settings import Settings
from art_sky.wire import CheckpointInfo, ModelConfig, ModelInfo, TrainConfig, TrainSFTConfig, served_name

from .langfuse_traces import LangfuseTraces, langfuse_wanted, require_langfuse
from .reporting import WandbRun, require_wandb, wandb_wanted
from .trajectories import TrajectoryGroup, summarize

log = logging.getLogger("art_sky")


class StepResult(Protocol):
    step: int
    metrics: dict[str, float]
    totals: dict[str, float]


class Backend(Protocol):
    """What a model needs of the backend it is registered with (art_sky.backends implements it; the client does
    not import them)."""

    api_key: str | None
    settings: Settings

    @property
    def inference_base_url(self) -> str: ...

    @property
    def request_timeout(self) -> float: ...

    async def register(self, model: TrainableModel) -> ModelInfo | None: ...

    async def model_info(self, model: Model) -> ModelInfo: ...

    async def log(self, model: Model, split: str, metrics: dict[str, float], step: int | None = None) -> None: ...

    async def train(
        self,
        model: TrainableModel,
        trajectory_groups: Iterable[TrajectoryGroup],
        *,
        config: TrainConfig | None = None,
        verbose: bool = False,
        wait: bool = True,
        max_steps_off_policy: int = 1,
    ) -> StepResult | asyncio.Task: ...

    async def list_checkpoints(self, model: Model) -> list[CheckpointInfo]: ...

    async def delete_checkpoints(self, model: Model, best_checkpoint_metric: str | None) -> list[CheckpointInfo]: ...

    def _model_inference_name(self, model: Model, step: int | None = None) -> str: ...

    def _train_sft(
        self,
        model: TrainableModel,
        trajectories: Iterable[Any],
        config: Any,
        dev_config: Mapping[str, Any] | None = None,
        verbose: bool = False,
    ) -> AsyncIterator[dict[str, float]]: ...


class Model(BaseModel):
    """A model you sample from (any OpenAI-compatible endpoint). `TrainableModel` is the one you train.

    `report_metrics`, as ART's: None logs to Weights & Biases when WANDB_API_KEY is set and traces rollouts to
    Langfuse when LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY are; ["wandb"], ["langfuse"] ask for them; [] logs to
    the server's history only."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")  # a misspelt option is an error

    name: str = Field(description="the model's name: what completions ask for, and its checkpoints' folder")
    project: str = Field(description="groups models: checkpoints and history under `<project>/models/<name>`")
    inference_model_name: str | None = Field(None, description="the name the endpoint serves it as (set by register)")
    inference_api_key: str | None = Field(None, description="the endpoint's key (set by register)")
    inference_base_url: str | None = Field(None, description="the OpenAI-compatible endpoint (set by register)")
    trainable: bool = Field(False, description="whether this model trains (a TrainableModel)")
    report_metrics: list[str] | None = Field(
        None, description='where metrics go besides the server: None (by the keys set), ["wandb"], ["langfuse"], []'
    )
    _backend: Backend | None = PrivateAttr(None)
    _openai: AsyncOpenAI | None = PrivateAttr(None)
    _sampling: InFlight = PrivateAttr(default_factory=lambda: InFlight())
    _wandb: WandbRun | None = PrivateAttr(None)
    _langfuse: LangfuseTraces | None = PrivateAttr(None)

    async def register(self, backend: Backend) -> None:
        self._backend = backend
        self._openai = None
        key = backend.settings.wandb_api_key
        wandb_key = key.get_secret_value() if key is not None else None
        self._wandb = None
        if wandb_wanted(self.report_metrics, wandb_key):
            try:
                require_wandb()
            except ConfigError:
                if self.report_metrics is not None:
                    raise
                log.warning(
                    "WANDB_API_KEY is set but wandb is not installed: %s's metrics go to the server's "
                    'history only (pip install "art-sky[wandb]" to log them to W&B)',
                    self.name,
                )
            else:
                self._wandb = WandbRun(self.project, self.name, wandb_key)
        self._langfuse = None
        if langfuse_wanted(self.report_metrics, backend.settings):
            try:
                require_langfuse()
            except ConfigError:
                if self.report_metrics is not None:
                    raise
                log.warning(
                    "LANGFUSE_PUBLIC_KEY is set but langfuse is not installed: %s's rollouts are not traced "
                    '(pip install "art-sky[langfuse]" to trace them)',
                    self.name,
                )
            else:
                self._langfuse = LangfuseTraces(self.project, self.name, backend.settings)

    def openai_client(self) -> AsyncOpenAI:
        """An AsyncOpenAI client for this model's endpoint and key (one per model, reused). Its timeout is the
        backend's request timeout (ART_SKY_REQUEST_TIMEOUT)."""
        if self.inference_base_url is None:
            raise ConfigError(f"model {self.name!r} has no endpoint yet: `await model.register(backend)` first")
        if self._openai is None:
            transport = _TrainingDefaults(httpx.AsyncHTTPTransport(), self._sampling) if self.trainable else None
            seconds = self._backend.request_timeout if self._backend else Settings().request_timeout
            self._openai = AsyncOpenAI(
                base_url=self.inference_base_url,
                api_key=self.inference_api_key or "none",
                max_retries=3,
                http_client=httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(seconds, connect=30.0)),
            )
        return self._openai

    def get_inference_name(self, step: int | None = None) -> str:
        """The name to send to the endpoint (ART's): the newest step's, or `name@step` for an older one."""
        if self._backend is not None:
            return self._backend._model_inference_name(self, step=step)
        name = self.inference_model_name or self.name
        return name if step is None else f"{name}@{step}"

    def litellm_completion_params(self, step: int | None = None) -> dict[str, Any]:
        """Keyword arguments for `litellm.completion` (ART's): the endpoint, its key, this model (or `name@step`)
        through litellm's hosted_vllm provider when trainable, and temperature 1, which training samples need."""
        name = self.get_inference_name(step)
        return {
            "model": f"hosted_vllm/{name}" if self.trainable else name,
            "base_url": self.inference_base_url,
            "api_key": self.inference_api_key,
            "temperature": 1,
        }

    async def log(
        self,
        trajectories: Iterable[TrajectoryGroup] | None = None,
        split: str = "val",
        *,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> dict[str, float]:
        """Record these groups' mean reward and metrics (ART's `model.log`), and/or `metrics` as given, at `step`
        (default: the current one): a line of history.jsonl on the server, a W&B row when W&B is on, and the
        rollouts' traces when Langfuse is."""
        groups = list(trajectories) if trajectories is not None else None
        values = (summarize(groups) if groups is not None else {}) | (metrics or {})
        if not values:
            return values
        backend = self._require_backend()
        if step is None:
            step = (await backend.model_info(self)).step if self.trainable else 0
        await backend.log(self, split, values, step)
        self._report(split, values, step, groups)
        return values

    def _report(
        self, split: str, metrics: dict[str, float], step: int, groups: list[TrajectoryGroup] | None = None
    ) -> None:
        if self._wandb is not None:
            self._wandb.log(split, metrics, step)
        if self._langfuse is not None and groups:
            self._langfuse.log(split, groups, step)

    def _require_backend(self) -> Backend:
        if self._backend is None:
            raise ConfigError(f"model {self.name!r} is not registered: `await model.register(backend)` first")
        return self._backend


class TrainableModel(Model):
    """A LoRA on `base_model`, served and trained by the backend it is registered with.

    ART's `_internal_config=` (art_sky.dev.InternalModelConfig) is taken too, as ART takes it: a private setting
    whose LoRA settings apply where `config` gives none."""

    base_model: str = Field(
        description="the Hugging Face model the LoRA trains on: a hub id (Qwen/Qwen2.5-1.5B-Instruct), a directory "
        "on the server's machine, or art-sky/tiny (built from code, for CPUs)"
    )
    config: ModelConfig | None = Field(None, description="the LoRA's rank, alpha, targets and sequence length")
    run_name: str | None = Field(
        None,
        description="ART's lineage: checkpoints and history under this name (a new one starts at step 0)",
    )
    lora_config: LoRAConfig | None = Field(None, description="ART 0.5.20's LoRA settings, where `config` gives none")
    trainable: bool = Field(True, description="always True: this model trains")
    _internal_config: InternalModelConfig | None = PrivateAttr(None)

    @model_validator(mode="wrap")
    @classmethod
    def _art_internal_config(cls, data: Any, handler: ModelWrapValidatorHandler[TrainableModel]) -> TrainableModel:
        """`_internal_config=` is no field (pydantic keeps names with `_` private), so it is taken out of the
        arguments here: the fields alone make the signature that IDEs and the docs show."""
        internal = None
        if isinstance(data, dict) and "_internal_config" in data:
            data = dict(data)
            internal = data.pop("_internal_config")
        model = handler(data)
        if internal is not None:
            model._internal_config = internal
        return model

    async def register(self, backend: Backend) -> None:
        await super().register(backend)
        await backend.register(self)
        self.inference_base_url = backend.inference_base_url
        self.inference_api_key = backend.api_key
        self.inference_model_name = served_name(self.name, self.run_name)  # this run's, beside the name's others

    async def get_step(self) -> int:
        return (await self._require_backend().model_info(self)).step

    async def train(
        self,
        trajectory_groups: Iterable[TrajectoryGroup],
        config: TrainConfig = TrainConfig(),
        *,
        verbose: bool = False,
        wait: bool = True,
        max_steps_off_policy: int = 1,
    ) -> dict[str, float] | asyncio.Task[dict[str, float]]:
        """One GRPO step on these groups (ART 0.4's `model.train`); returns the step's metrics and `step`.
        Inference goes on with the previous step while it trains (or waits, on an engine that must pause: /health
        says which). `backend.train(model, groups, ...)` is ART 0.5's form of the same.

        `wait=False` returns at once with an asyncio.Task of those metrics: gather the next batch meanwhile
        (`art_sky.pipeline` runs that loop). Groups sampled more than `max_steps_off_policy` steps behind the step
        they train at are dropped and counted in `discarded_stale_groups` (client/pipeline.py)."""
        groups = list(trajectory_groups)
        step = await self._require_backend().train(
            self, groups, config=config, verbose=verbose, wait=False, max_steps_off_policy=max_steps_off_policy
        )
        assert isinstance(step, asyncio.Task)  # wait=False
        metrics = asyncio.ensure_future(self._step_metrics(step, groups))
        return await metrics if wait else metrics

    async def _step_metrics(self, step: Awaitable[StepResult], groups: list[TrajectoryGroup]) -> dict[str, float]:
        result = await step
        self._report("train", result.metrics | result.totals, result.step, groups)
        return result.metrics | result.totals | {"step": float(result.step)}

    async def train_sft(
        self,
        trajectories: Iterable[Any],
        config: TrainSFTConfig | None = None,
        _config: DevTrainSFTConfig | None = None,
        verbose: bool = False,
    ) -> None:
        """Supervised fine-tuning on the assistant turns (ART's `model.train_sft`): one step, one optimizer step
        per batch; the batches' mean metrics are reported at the new step, as ART reports them."""
        batches = [
            metrics
            async for metrics in self._require_backend()._train_sft(
                self, trajectories, config or TrainSFTConfig(), _config, verbose
            )
        ]
        if batches:
            mean = {key: sum(b[key] for b in batches) / len(batches) for key in batches[0]}
            await self.log(metrics=mean, split="train")

    async def delete_checkpoints(self, best_checkpoint_metric: str = "val/reward") -> list[CheckpointInfo]:
        """Keep the newest step and the best by `best_checkpoint_metric`; delete the rest."""
        return await self._require_backend().delete_checkpoints(self, best_checkpoint_metric)

    async def list_checkpoints(self) -> list[CheckpointInfo]:
        return await self._require_backend().list_checkpoints(self)


class InFlight:
    """The chat completions a model's client is waiting on. `art_sky.pipeline` sends a step once the next batch's
    first completions are answered: sent while the step trains, they would wait for it."""

    def __init__(self) -> None:
        self.count = 0  # waiting now
        self.sent = 0  # ever sent
        self.changed = asyncio.Event()

    def start(self) -> None:
        self.count += 1
        self.sent += 1
        self.changed.set()

    def end(self) -> None:
        self.count -= 1
        self.changed.set()


_answered = 0  # chat completions this process's training clients got back (gather's progress bar shows the rate)


def completions_answered() -> int:
    return _answered


class _TrainingDefaults(httpx.AsyncBaseTransport):
    """Ask for what the trainer needs on every chat completion: logprobs, and the prompt and sampled token ids
    (vLLM's `return_token_ids`: art-sky's server returns them anyway, vLLM's own port only when asked).

    A trajectory then trains on the exact tokens the engine sampled, in the exact prompt it sampled them from;
    without them the chat template re-renders the turns. Values the caller set explicitly are kept. Where the
    engine put the prompt ids on the completion only (vLLM's own port), they are copied onto each choice, so a
    Choice alone carries its context (as ART's client does).
    """

    def __init__(self, inner: httpx.AsyncBaseTransport, sampling: InFlight):
        self.inner, self.sampling = inner, sampling

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method != "POST" or not request.url.path.endswith("/chat/completions"):
            return await self.inner.handle_async_request(request)
        body: dict[str, Any] = json.loads(await request.aread() or b"{}")
        body.setdefault("logprobs", True)
        body.setdefault("return_token_ids", True)
        content = json.dumps(body).encode()
        headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() != "content-length"]
        request = httpx.Request(
            request.method,
            request.url,
            headers=headers + [("content-length", str(len(content)))],
            content=content,
            extensions=request.extensions,
        )
        self.sampling.start()
        try:
            response = await self.inner.handle_async_request(request)
        finally:
            self.sampling.end()
        global _answered
        _answered += response.status_code == 200
        if response.status_code != 200 or not response.headers.get("content-type", "").startswith("application/json"):
            return response  # errors and streams pass as they are
        content = await response.aread()  # decoded: the copy below goes out without the content encoding
        completion = json.loads(content)
        prompt = completion.get("prompt_token_ids") if isinstance(completion, dict) else None
        choices = (completion.get("choices") or []) if prompt is not None else []
        if any("prompt_token_ids" not in choice for choice in choices):
            for choice in choices:
                choice.setdefault("prompt_token_ids", prompt)
            content = json.dumps(completion).encode()
        headers = [
            (k, v) for k, v in response.headers.multi_items() if k.lower() not in ("content-length", "content-encoding")
        ]
        return httpx.Response(response.status_code, headers=headers, content=content, extensions=response.extensions)

    async def aclose(self) -> None:
        await self.inner.aclose()
