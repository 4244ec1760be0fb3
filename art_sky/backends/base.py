"""`Backend`: the HTTP client of a cluster server. Every backend (local, SSH host, SkyPilot) is this plus a way
to get the server running; after that they share this one code path.

It serves art-sky's own client and openpipe-art's: `register` and `train` take either's models and keywords, and
the rest of ART's Backend protocol (`_prepare_backend_for_training`, `exact_adapter_lease`, `_train_sft`, ...)
comes from art_sky/art_compat/protocol.py, where ART compatibility lives.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

import art_sky
from art_sky.art_compat import releases
from art_sky.art_compat.capture import conversations
from art_sky.art_compat.models import chat_template_kwargs, register_request, served
from art_sky.art_compat.protocol import ArtProtocol
from art_sky.art_compat.training import Ready, StepOptions, TrainResult, train_options, train_result
from art_sky.client.pipeline import check_bound, drop_stale, group_versions
from art_sky.client.trajectories import wire_groups
from art_sky.errors import (
    BackendUnavailableError,
    CheckpointStoreError,
    ConfigError,
    ErrorCode,
    NotFoundError,
    ServerError,
    VersionMismatchError,
)
from art_sky.server_client import ServerClient, StallWatch, StreamLost, backoff
from art_sky.settings import Settings
from art_sky.wire import (
    CheckpointInfo,
    DeleteCheckpointsRequest,
    HealthResponse,
    LogRequest,
    ModelInfo,
    SFTRequest,
    StepClock,
    SyncStatus,
    TrainConfig,
    TrainProgress,
    TrainRequest,
    WireGroup,
)

if TYPE_CHECKING:  # the backend serves the client's models; the client knows backends only by a protocol
    from art_sky.client import Model, TrainableModel

log = logging.getLogger("art_sky")
RESTARTED_STEP_RETRIES = 2  # a step answered 503 (rolled back, the trainer's ranks restarting) is retried this often


class _Default:
    """`max_steps_off_policy` not given: its default depends on whose model trains."""


DEFAULT = _Default()


class Backend(ArtProtocol):
    """Talks to a cluster server at `base_url` with `api_key`. Subclasses start the server in `_start()`.

    `settings` (default: read now from the environment and .env) are this backend's for its whole life.
    """

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, settings: Settings | None = None):
        self.base_url = base_url.rstrip("/") if base_url else None
        self.api_key = api_key
        self.settings = settings or Settings()
        self._server_client: ServerClient | None = None
        self._started = False
        self._start_lock = asyncio.Lock()
        self._steps: dict[str, asyncio.Task[TrainResult]] = {}  # each model's newest training step, in turn
        self._at_step: dict[str, int] = {}  # each model's step as this backend last saw it: staleness is measured to it
        self._returned: dict[str, float] = {}  # model name -> when its last step returned (or it registered)
        self._price: tuple[float | None] | None = None  # the machine's hourly price, once asked

    @property
    def inference_base_url(self) -> str:
        """The OpenAI endpoint models sample from: the server's own /v1, whatever engine serves behind it."""
        return f"{self.base_url}/v1"

    @property
    def request_timeout(self) -> float:
        """Seconds for one request to the server (ART_SKY_REQUEST_TIMEOUT); the OpenAI clients use it too."""
        return self.settings.request_timeout

    async def _start(self) -> None:
        """Make the server reachable and set base_url and api_key. A plain Backend is given both."""
        if self.base_url is None or self.api_key is None:
            raise ConfigError("Backend(base_url=..., api_key=...) needs both, or use LocalBackend / SSHBackend")

    @property
    def server_client(self) -> ServerClient:
        """The HTTP client of the server (made once `_start` has set base_url and api_key)."""
        if self._server_client is None:
            assert self.base_url is not None  # requests follow `ensure_started`, whose `_start` sets it
            self._server_client = ServerClient(self.base_url, self.api_key, self.request_timeout, self._recovered)
        return self._server_client

    def known_step(self, name: str) -> int | None:
        """Model `name`'s step as this backend last saw it (staleness is measured to it); None when not known."""
        return self._at_step.get(name)

    def saw_step(self, name: str, step: int) -> None:
        self._at_step[name] = step

    async def ensure_started(self) -> None:
        async with self._start_lock:
            if not self._started:
                await self._start()
                await self.check_server()
                self._started = True

    async def check_server(self) -> HealthResponse:
        """Health and version: a client and a server of different art-sky versions refuse to work together."""
        health = await self.server_client.health()
        if health.version != art_sky.__version__:
            raise VersionMismatchError(
                f"the cluster server runs art-sky {health.version}, this client {art_sky.__version__}: restart the "
                f"server with this client's build (e.g. `art-sky up --force-restart`) or install art-sky=="
                f"{health.version} here"
            )
        return health

    async def health(self) -> HealthResponse:
        await self.ensure_started()
        return await self.server_client.health()

    async def register(self, model: TrainableModel) -> ModelInfo | None:
        """Load a trainable model (art-sky's or ART's) on the server; a model that is not trainable needs nothing."""
        await self.ensure_started()
        if not getattr(model, "trainable", False):
            return None
        releases.check(self, model)
        request = register_request(model, uuid.uuid4().hex)
        info = await self.server_client.register(request, retry_for=self.settings.train_retry_timeout)
        self._returned.setdefault(served(model), time.monotonic())  # the first step's rollouts start now
        self.saw_step(served(model), info.step)
        return info

    async def models(self) -> list[ModelInfo]:
        """Every model the server has registered, with its step (what `art-sky status` shows)."""
        health = await self.health()
        return [await self.server_client.model(name) for name in health.models]

    async def model_info(self, model: Model) -> ModelInfo:
        await self.ensure_started()
        info = await self.server_client.model(served(model))
        self._at_step[served(model)] = info.step
        return info

    async def log(self, model: Model, split: str, metrics: dict[str, float], step: int | None = None) -> None:
        """Add a line to the model's history (at `step`, default the current one)."""
        await self.ensure_started()
        await self.server_client.log(served(model), LogRequest(split=split, metrics=metrics, step=step))

    async def history(self, name: str) -> list[dict]:
        """Model `name`'s history.jsonl on the server: a line per step and per `model.log`, ART's flat keys."""
        await self.ensure_started()
        return await self.server_client.history(name)

    async def hourly_cost(self) -> float | None:
        """The machine's price in $ per hour: ART_SKY_HOURLY_COST where set, else what its provider knows (SkyPilot's
        price of the cluster), else None. Each step's cost is this price over the step's wall time."""
        if self.settings.hourly_cost is not None:
            return self.settings.hourly_cost
        if self._price is None:
            self._price = (await self._provider_price(),)
        return self._price[0]

    @property
    def known_hourly_cost(self) -> float | None:
        """The price `hourly_cost()` gave, without asking anyone (None before it was asked, or where none is known)."""
        if self.settings.hourly_cost is not None:
            return self.settings.hourly_cost
        return self._price[0] if self._price is not None else None

    async def _provider_price(self) -> float | None:
        """The price the machine's provider knows; a plain server's machine has none."""
        return None

    async def _recovered(self, cause: Exception) -> bool:
        """A request lost its connection (`cause`): True once the server is back on a relaunched machine (retry
        now, afresh), False to retry as usual; raises when the machine is lost for good. Only a SkyPilot cluster
        with recovery relaunches (backends/recovery.py)."""
        return False

    async def list_checkpoints(self, model: Model) -> list[CheckpointInfo]:
        await self.ensure_started()
        return await self.server_client.checkpoints(served(model))

    async def delete_checkpoints(self, model: Model, best_checkpoint_metric: str | None) -> list[CheckpointInfo]:
        await self.ensure_started()
        request = DeleteCheckpointsRequest(best_checkpoint_metric=best_checkpoint_metric)
        return await self.server_client.delete_checkpoints(served(model), request)

    async def flush_checkpoints(self) -> SyncStatus:
        """Wait until every checkpoint so far is on the cluster's disk (each step's is written in the background) and in
        the object store (training never waits for uploads itself).

        Raises CheckpointStoreError naming the steps that could not be uploaded; they stay on the cluster.
        """
        await self.ensure_started()
        status = await self.server_client.flush()
        if status.errors:
            raise CheckpointStoreError(
                f"{len(status.errors)} checkpoint(s) are not in the store: " + "; ".join(status.errors)
            )
        return status

    async def _finish_steps(self, force: bool) -> None:
        """Steps asked for with `wait=False` train before the connection closes (they are the user's rollouts);
        `force` cancels those not done. Their errors stay their callers'."""
        pending = [step for step in self._steps.values() if not step.done()]
        if not pending:
            return
        if force:
            for step in pending:
                step.cancel()
        else:
            log.info("waiting for %d training step(s) asked for with wait=False", len(pending))
        await asyncio.wait(pending)

    async def _flush_before_stop(self, force: bool, where: str) -> None:
        """A server is never stopped with checkpoints the store does not have yet, unless `force`."""
        if force or not self._started:
            return
        try:
            await self.flush_checkpoints()
        except CheckpointStoreError as exc:
            raise CheckpointStoreError(
                f"{exc}. The server is still running: fix the store and close again, or `close(force=True)` to stop "
                f"it anyway (the steps stay in {where})"
            ) from exc

    async def train(
        self,
        model: TrainableModel,
        trajectory_groups: Iterable[Any],
        *,
        config: TrainConfig | None = None,
        verbose: bool = False,
        wait: bool = True,
        max_steps_off_policy: int | None | _Default = DEFAULT,
        **kwargs: Any,
    ) -> TrainResult | asyncio.Task[TrainResult]:
        """One training step on these groups (art-sky's or openpipe-art's), ART's `backend.train`: ART's keywords
        (`learning_rate`, `loss_fn`, `importance_sampling_level`, `save_checkpoint`, ...; see
        art_sky/art_compat/training.py) or art-sky's `config=TrainConfig(...)`. Inference goes on with the previous
        step while it trains (where the engine can: /health's serves_while_training); progress streams from the
        server.

        `wait=False` returns at once with an asyncio.Task of the TrainResult, so the next batch can be gathered
        while this one trains; a model's steps train in the order they were asked for, and `close()` waits for
        them (`close(force=True)` cancels them). Groups sampled more than
        `max_steps_off_policy` steps behind the step they train at are dropped and counted (client/pipeline.py): 1
        by default for art-sky's models, None (no bound, as ART's backends) for ART's, whose loops (ART's
        PipelineTrainer) bound it themselves. Bad input raises here, before anything is sent."""
        config, options = train_options(config, kwargs)
        if isinstance(max_steps_off_policy, _Default):
            max_steps_off_policy = None if releases.is_art_object(model) else 1
        bound = check_bound(max_steps_off_policy)
        trajectory_groups = [conversations(group) for group in trajectory_groups]
        groups = wire_groups(trajectory_groups, chat_template_kwargs(model))
        if not groups:
            raise ConfigError("train() got no trajectory groups with trajectories: every rollout failed or none ran")
        versions = group_versions(trajectory_groups, groups)
        step = asyncio.create_task(
            self._train_in_turn(
                self._steps.get(served(model)), model, groups, versions, bound, config, options, verbose
            )
        )
        self._steps[served(model)] = step

        def forget(done: asyncio.Task) -> None:
            if self._steps.get(served(model)) is done:
                del self._steps[served(model)]

        step.add_done_callback(forget)
        return await step if wait else step

    async def _train_in_turn(
        self,
        previous: asyncio.Task | None,
        model: TrainableModel,
        groups: list[WireGroup],
        versions: list[int | None],
        bound: int | None,
        config: TrainConfig,
        options: StepOptions,
        verbose: bool,
    ) -> TrainResult:
        """After the model's previous step (whose errors are its caller's), the groups still within the staleness
        bound at the step the model is now at (as registering, `get_step()` and the last step told this backend;
        asked when it does not know), trained."""
        if previous is not None:
            await asyncio.wait([previous])
        current = self._at_step.get(served(model))
        if current is None:
            current = await self._get_step(model)
        kept, staleness = drop_stale(groups, versions, current, bound)
        if staleness["discarded_stale_groups"]:  # never without a bound
            log.warning(
                "%s: dropped %d group(s) sampled more than %d step(s) before step %d (or behind it without logprobs)",
                served(model),
                int(staleness["discarded_stale_groups"]),
                bound,
                current,
            )
        if not kept:
            return train_result(current, staleness | {"num_trajectories": 0.0})
        request = TrainRequest(groups=kept, config=config, save_checkpoint=options.save_checkpoint)
        try:
            result = await self.run_step(model, "train", request, verbose)
        except BaseException:
            self._at_step.pop(served(model), None)  # the step may have committed on the server all the same
            raise
        assert result.step is not None
        self._at_step[served(model)] = result.step
        ready = self._checkpoint_ready(model) if result.checkpoint_path else None
        return train_result(result.step, result.metrics | staleness, result.checkpoint_path, result.totals, ready)

    def _checkpoint_ready(self, model: TrainableModel) -> Ready | None:
        """ART's signal that a step's checkpoint is on disk at its `checkpoint_path` (already: the server answers a
        step once it is); None where that path is on another machine."""
        return None

    async def run_step(
        self, model: Model, route: str, request: TrainRequest | SFTRequest, verbose: bool
    ) -> TrainProgress:
        """POST a training request and follow its progress stream to the result.

        The request carries the step's clock (how long its rollouts took, the machine's price) and an id. A
        connection lost on the way (a tunnel drop, a server restarting) is retried with that id, with backoff, for
        up to ART_SKY_TRAIN_RETRY_TIMEOUT seconds: the server trains one id once, follows the step still running,
        or answers with the step it committed. A server that restarted without the model has it registered again
        first. A step answered 503 (rolled back: the trainer's ranks restarted, e.g. a node was lost) is trained
        again, RESTARTED_STEP_RETRIES times at most. A step whose progress stops for ART_SKY_TRAIN_STALL_TIMEOUT
        seconds raises TrainingStalledError, naming what the server is doing."""
        await self.ensure_started()
        returned = self._returned.get(served(model))
        clock = StepClock(
            gather_s=time.monotonic() - returned if returned is not None else None, hourly_cost=await self.hourly_cost()
        )
        request = request.model_copy(update={"request_id": request.request_id or uuid.uuid4().hex, "clock": clock})
        deadline = time.monotonic() + self.settings.train_retry_timeout
        bar = tqdm(desc=f"{route} {served(model)}", unit="batch", disable=not verbose)
        stall = StallWatch(served(model), self.settings.train_stall_timeout)
        lost: Exception | None = None  # why the previous attempt did not finish

        def show(event: TrainProgress) -> None:
            bar.total, bar.n = event.total, event.done
            if event.activity is not None:
                bar.set_description(f"{route} {served(model)}: {event.activity.phase}", refresh=False)
            bar.refresh()

        restarts = 0  # attempts answered 503 (retried a few times, not for ever: a step may fail that way each time)
        try:
            for attempt in itertools.count():
                try:
                    result = await self.server_client.follow_step(served(model), route, request, stall, show)
                    if result.replayed:
                        log.info(
                            "%s: the server had trained this request already (step %d): its result",
                            served(model),
                            result.step,
                        )
                    for skipped in result.skipped:  # the step trained without them; say which and why
                        log.warning("%s: skipped %s", served(model), skipped)
                    self._returned[served(model)] = time.monotonic()
                    return result
                except StreamLost as exc:
                    cause = exc.__cause__  # the transport's error, or None where the stream just ended
                    lost, wait = cause if isinstance(cause, Exception) else exc, backoff(attempt, 10.0)
                    if await self._recovered(lost):  # the cluster was lost and is back: retry at once, time anew
                        deadline, wait = time.monotonic() + self.settings.train_retry_timeout, 0.0
                except NotFoundError as exc:
                    if lost is None or exc.code != ErrorCode.NOT_REGISTERED:
                        raise
                    log.warning(
                        "%s: the cluster server restarted without the model: registering it again", served(model)
                    )
                    await self.register(model)  # restored from its newest checkpoint; then the step is retried
                    wait = 0.0
                except ServerError as exc:
                    if exc.code != ErrorCode.ROLLED_BACK or restarts >= RESTARTED_STEP_RETRIES:
                        raise
                    restarts += 1  # the trainer's ranks restarted (a node lost): the step rolled back, train it again
                    lost, wait = exc, 1.0
                if time.monotonic() + wait > deadline:
                    break
                if wait:
                    log.warning(
                        "%s: %s during %s (%s); retrying request %s in %.1fs",
                        served(model),
                        "the step was rolled back"
                        if isinstance(lost, ServerError)
                        else "connection to the cluster server lost",
                        route,
                        lost,
                        request.request_id,
                        wait,
                    )
                    await asyncio.sleep(wait)
        finally:
            bar.close()
        raise BackendUnavailableError(
            f"{route} of {served(model)} did not finish: the cluster server could not be reached for "
            f"{self.settings.train_retry_timeout:.0f}s (ART_SKY_TRAIN_RETRY_TIMEOUT; last: {lost!r}). The step was "
            "not lost: call train() again with the same groups once the server is back (`art-sky status`), and "
            "check `await model.get_step()`"
        )

    async def close(self) -> None:
        """Close the connection. Subclasses also stop what they started."""
        if self._server_client is not None:
            await self._server_client.aclose()
            self._server_client = None
        self._started = False

    async def __aenter__(self) -> Backend:
        await self.ensure_started()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()
