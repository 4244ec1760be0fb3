"""The cluster server: art-sky's control API and an OpenAI-compatible endpoint, one FastAPI app.

Binds 127.0.0.1 (reached through an SSH tunnel from the laptop); every route but /health needs the API key.
The OpenAI surface (/v1) is cluster/openai_api.py. The device gate (cluster/gate.py) keeps inference and training
apart, ART's semantics: while a model trains, completions wait.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import statistics
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

import art_sky
from art_sky.checkpoints import CheckpointDir, history_entry, steps_to_keep
from art_sky.errors import (
    ArtSkyError,
    CheckpointStoreError,
    ConfigError,
    EngineError,
    TokenizationError,
)
from art_sky.settings import Settings
from art_sky.store import CheckpointStore
from art_sky.wire import (
    CheckpointInfo,
    DeleteCheckpointsRequest,
    HealthResponse,
    LogRequest,
    ModelInfo,
    RegisterRequest,
    SFTRequest,
    StepClock,
    SyncStatus,
    TrainProgress,
    TrainRequest,
)

from . import openai_api
from .activity import ModelActivity, StepTimer, reset_peak_memory, step_metrics
from .gate import DeviceGate
from .gpu_sharing import sharing_of
from .grpo import group_advantages
from .model_state import ModelState, create_model_state, device, restore_from_store
from .peft_trainer import Progress
from .selection import select_engine, select_trainer
from .sequences import Built, Sequence, build_sequences, sft_sequence
from .stack import installed_versions, stack_status
from .sync import CheckpointSync

log = logging.getLogger("art_sky.cluster")
_LOGGED_SKIPS = 100  # skipped trajectories named one by one in the log and the step's result
HEARTBEAT = 5.0  # seconds between progress lines of a training step, so a client sees what a slow step waits on


class BodySizeLimit:
    """Refuse request bodies over the limit with 413 before reading them whole."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and int(declared) > self.limit:
            return await self._refuse(send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge()
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await self._refuse(send)

    async def _refuse(self, send):
        response = JSONResponse(
            {"detail": f"request body is larger than the server's limit of {self.limit} bytes "
                       "(ART_SKY_MAX_REQUEST_BYTES): send fewer trajectory groups per request"},
            status_code=413)
        await response({"type": "http"}, None, send)


class _TooLarge(Exception):
    pass


class Arrival:
    """Stamp each request with when it reached the server, before its body is read: a step's upload time."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrived"] = time.monotonic()
        await self.app(scope, receive, send)


def create_app(art_path: Path, api_key: str, settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    engine, trainer = select_engine(settings, art_path, api_key), select_trainer(settings)
    versions, stack = installed_versions(), stack_status(engine.name, trainer.name)
    store = CheckpointStore.from_settings(settings)
    sync = CheckpointSync(store, settings.checkpoint_strict) if store else None
    states: dict[str, ModelState] = {}
    gate = DeviceGate()
    activities: dict[str, ModelActivity] = {}  # what the server is doing with each model (cluster/activity.py)
    background: set[asyncio.Task] = set()
    bearer = HTTPBearer(auto_error=False)

    def authorized(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if credentials is None or not secrets.compare_digest(credentials.credentials.encode(), api_key.encode()):
            raise HTTPException(401, openai_api.UNAUTHORIZED)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            await engine.aclose()  # connections made on this event loop
            await asyncio.to_thread(engine.close)  # a child engine (vLLM) stops with the server

    app = FastAPI(title="art-sky cluster server", version=art_sky.__version__, lifespan=lifespan)
    app.add_middleware(BodySizeLimit, limit=settings.max_request_bytes)
    app.add_middleware(Arrival)
    guarded = [Depends(authorized)]

    @app.exception_handler(ArtSkyError)
    async def _art_sky_error(request: Request, exc: ArtSkyError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=http_status(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
        return JSONResponse({"detail": f"invalid request: {problems}"}, status_code=422)

    def model(name: str) -> ModelState:
        if name not in states:
            raise HTTPException(404, f"model {name!r} is not registered on this server (registered: "
                                     f"{sorted(states) or 'none'}): call `await model.register(backend)` first")
        return states[name]

    @app.get("/health")
    async def health() -> HealthResponse:
        return HealthResponse(version=art_sky.__version__, engine=engine.name, trainer=trainer.name,
                              device=str(device()), models=sorted(states),
                              engine_port=engine.engine_port, versions=versions, stack=stack,
                              gpu_sharing=sharing_of(engine))

    openai_api.install(app, engine, states, gate, api_key, guarded, activities)

    @app.post("/art/models", dependencies=guarded)
    async def register(body: RegisterRequest) -> ModelInfo:
        async with gate.exclusive():
            if body.name in states:
                existing = states[body.name].request
                if (existing.project, existing.base_model) != (body.project, body.base_model):
                    raise HTTPException(409, f"model {body.name!r} is already registered with project "
                                             f"{existing.project!r} and base model {existing.base_model!r}")
                return states[body.name].info()
            engine.check(body)  # before loading anything (or writing a step 0 checkpoint)
            checkpoints = CheckpointDir(art_path, body.project, body.name)
            downloaded = await restore_from_store(store, checkpoints, settings.checkpoint_strict) if store else None
            state = await asyncio.to_thread(create_model_state, body, art_path, settings, trainer.load_model,
                                            downloaded)
            await asyncio.to_thread(engine.attach, state)
            activities[body.name] = ModelActivity(gate, state.checkpoints.history())
            states[body.name] = state
        if sync:
            sync.submit(states[body.name].checkpoints, states[body.name].step)
        log.info("registered %s (%s) at step %d", body.name, body.base_model, states[body.name].step)
        return states[body.name].info()

    @app.get("/art/models/{name}", dependencies=guarded)
    async def model_info(name: str) -> ModelInfo:
        """The model, with what the server is doing with it now (`art-sky status`)."""
        state, activity = model(name), activities[name]
        return state.info().model_copy(update={
            "activity": activity.activity(), "serving": activity.serving(f"{name}@{state.step}"),
            "last_step": activity.last_step, "sync": sync.model_sync(name) if sync else None})

    @app.get("/art/models/{name}/history", dependencies=guarded)
    async def history(name: str) -> list[dict]:
        """The model's history.jsonl: a line per step and per `model.log` (`art-sky plot`)."""
        return model(name).checkpoints.history()

    def stream_step(name: str, state: ModelState, work: Callable[[Progress], dict[str, float]], timer: StepTimer,
                    clock: StepClock, batches: Callable[[], list[dict[str, float]]] = list,
                    skipped: list[str] | None = None) -> StreamingResponse:
        """Run one training step (`work(progress)` returns its metrics) with inference paused, commit it as the next
        checkpoint, and stream progress lines (at least every HEARTBEAT seconds, with what the step is doing) then
        the result (or the error), naming what was `skipped`. `timer` times its phases; `clock` is the client's."""
        if sync and (problem := sync.blocking_error()):
            timer.end()
            raise HTTPException(502, problem)
        queue: asyncio.Queue[TrainProgress] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        activity = timer.activity

        def progress(done: int, total: int) -> None:
            activity.trained(done, total)
            loop.call_soon_threadsafe(queue.put_nowait, TrainProgress(type="progress", done=done, total=total,
                                                                      activity=activity.activity()))

        def step() -> tuple[dict[str, float], dict[str, float]]:
            reset_peak_memory()
            timer.begin("swapping", "the engine hands the device to the trainer")
            engine.pause()  # inference waits while training (a vLLM engine also frees its GPU memory)
            trained = False
            try:
                timer.begin("training")
                metrics = work(progress)
                state.step += 1
                timer.begin("saving", f"checkpoint of step {state.step}")
                state.save_checkpoint(metrics)
                trained = True
            finally:
                timer.begin("swapping", "the engine loads the new adapter" if trained else "the engine resumes")
                engine.resume(state, trained)  # serves the new step before inference resumes
                timer.end()
            metrics, totals = step_metrics(timer, metrics, clock.gather_s, clock.hourly_cost)
            entry = history_entry(state.step, "train", metrics | totals)
            state.checkpoints.append_history(entry)
            activity.last_step = {key: value for key, value in entry.items() if key != "recorded_at"}
            return metrics, totals

        async def run() -> None:
            timer.begin("waiting")
            try:
                async with gate.exclusive():
                    try:
                        metrics, totals = await asyncio.to_thread(step)
                    except Exception as exc:  # reported to the client; the server keeps serving
                        log.exception("training %s failed", name)
                        await queue.put(TrainProgress(type="error", message=f"training failed: {exc}"))
                        return
            finally:
                timer.end()
            if sync:
                sync.submit(state.checkpoints, state.step)  # uploads while the next rollouts run
            named = (skipped or [])[:_LOGGED_SKIPS]
            if len(skipped or []) > _LOGGED_SKIPS:
                named.append(f"... and {len(skipped) - _LOGGED_SKIPS} more")
            await queue.put(TrainProgress(type="result", step=state.step, metrics=metrics, batches=batches(),
                                          skipped=named, totals=totals))

        task = asyncio.create_task(run())  # runs to the end even if the client goes away
        background.add(task)
        task.add_done_callback(background.discard)

        def now() -> TrainProgress:
            return TrainProgress(type="progress", done=activity.done, total=activity.total,
                                 activity=activity.activity())

        async def lines():
            yield now().model_dump_json(exclude_defaults=True) + "\n"  # where the step stands, at once
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), HEARTBEAT)
                except TimeoutError:
                    item = now()
                yield item.model_dump_json(exclude_defaults=True) + "\n"
                if item.type != "progress":
                    return

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    def step_timer(name: str, request: Request) -> StepTimer:
        return StepTimer(activities[name], getattr(request.state, "arrived", time.monotonic()))

    @app.post("/art/models/{name}/train", dependencies=guarded)
    async def train(name: str, body: TrainRequest, request: Request) -> StreamingResponse:
        state = model(name)
        timer = step_timer(name, request)
        timer.begin("preparing", f"building the sequences of {len(body.groups)} groups")
        try:
            prepared = await asyncio.to_thread(_prepare, state, body)  # templates and tokenizers: off the event loop
        except BaseException:
            timer.end()
            raise

        def work(progress: Progress) -> dict[str, float]:
            sequences = prepared.sequences
            metrics = (trainer.train(state, sequences, body.config, progress) if sequences else
                       {"trained_tokens": 0.0, "sequences": 0.0})  # nothing to learn
            return metrics | prepared.metrics

        return stream_step(name, state, work, timer, body.clock, skipped=prepared.skipped)

    @app.post("/art/models/{name}/sft", dependencies=guarded)
    async def sft(name: str, body: SFTRequest, request: Request) -> StreamingResponse:
        """ART's `_train_sft`: one optimizer step per batch, one checkpoint (one step) for the request."""
        state = model(name)
        timer = step_timer(name, request)
        timer.begin("preparing", f"tokenizing {len(body.trajectories)} trajectories")
        size, count = body.batch_size, len(body.trajectories)
        try:
            rates = body.learning_rates * -(-count // size) if len(body.learning_rates) == 1 else body.learning_rates
            batches, batch_rates, dropped = [], [], []
            for start, rate in zip(range(0, count, size), rates):  # as ART: batches of the list given, each its rate
                batch = []
                for index in range(start, min(start + size, count)):
                    try:
                        batch.append(sft_sequence(state.tokenizer, body.trajectories[index],
                                                  state.request.config.max_seq_length))
                    except TokenizationError as exc:  # skipped and reported, as ART drops it from its batch
                        dropped.append(f"trajectory {index}: {exc}")
                if batch:
                    batches.append(batch)
                    batch_rates.append(rate)
            if not batches:
                raise HTTPException(422, "no trajectory can be trained: " + "; ".join(dropped[:3]))
        except BaseException:
            timer.end()
            raise
        for problem in dropped:
            log.warning("SFT of %s skips %s", name, problem)
        per_batch: list[dict[str, float]] = []

        def work(progress: Progress) -> dict[str, float]:
            per_batch.extend(trainer.sft(state, batches, batch_rates, body.max_grad_norm, progress))
            tokens = sum(b["trained_tokens"] for b in per_batch)
            return {"loss": sum(b["loss"] * b["trained_tokens"] for b in per_batch) / tokens,
                    "trained_tokens": tokens, "num_trajectories": float(count - len(dropped)),
                    "num_dropped_trajectories": float(len(dropped)), "num_batches": float(len(batches))}

        return stream_step(name, state, work, timer, body.clock, lambda: per_batch)

    @app.post("/art/models/{name}/log", dependencies=guarded)
    async def log_metrics(name: str, body: LogRequest) -> dict:
        state = model(name)
        entry = history_entry(state.step if body.step is None else body.step, body.split, body.metrics)
        state.checkpoints.append_history(entry)
        return entry

    @app.get("/art/models/{name}/checkpoints", dependencies=guarded)
    async def checkpoints(name: str) -> list[CheckpointInfo]:
        store = model(name).checkpoints
        return [_checkpoint_info(store, step) for step in store.steps()]

    @app.post("/art/models/{name}/checkpoints/delete", dependencies=guarded)
    async def delete_checkpoints(name: str, body: DeleteCheckpointsRequest) -> list[CheckpointInfo]:
        state = model(name)
        async with gate.exclusive():
            steps = state.checkpoints.steps()
            keep = (set(body.keep_steps) if body.keep_steps is not None else
                    steps_to_keep(steps, state.checkpoints.history(), body.best_checkpoint_metric, body.keep_last))
            keep.add(state.step)  # the adapter being served and trained stays
            state.checkpoints.delete([s for s in steps if s not in keep])
        if sync:
            sync.submit_retention(state.checkpoints, body.best_checkpoint_metric, body.keep_last, state.step,
                                  body.keep_steps)
        return [_checkpoint_info(state.checkpoints, step) for step in state.checkpoints.steps()]

    @app.get("/art/checkpoints/sync", dependencies=guarded)
    async def sync_status() -> SyncStatus:
        return sync.status() if sync else SyncStatus()

    @app.post("/art/checkpoints/flush", dependencies=guarded)
    async def flush_checkpoints() -> SyncStatus:
        """Wait until every checkpoint so far is in the store (failed uploads are retried once)."""
        return await sync.flush() if sync else SyncStatus()

    return app


def http_status(exc: ArtSkyError) -> int:
    """The one mapping from art-sky's errors to HTTP: the client's fault 4xx, the engine's or the store's 5xx."""
    for kind, status in ((ConfigError, 422), (TokenizationError, 422), (CheckpointStoreError, 502),
                         (EngineError, 503)):
        if isinstance(exc, kind):
            return status
    return 500


def _checkpoint_info(store, step: int) -> CheckpointInfo:
    manifest = store.manifest(step)
    return CheckpointInfo(step=step, size_bytes=manifest.size_bytes, created_at=manifest.created_at,
                          metrics=manifest.metrics)


@dataclass
class Prepared:
    """A train request turned into sequences, with what was left out and why."""

    sequences: list[Sequence]
    metrics: dict[str, float]
    skipped: list[str]  # "group G, trajectory T: reason", one per trajectory that could not be built


def _prepare(state: ModelState, body: TrainRequest) -> Prepared:
    """Build every trajectory's sequences; one that cannot be built is skipped and reported, never fails the batch.

    Advantages are computed among the trajectories of a group that were built, so the trained ones are centred and a
    skipped rollout's reward (often a broken one's) does not shift its group's baseline.
    """
    tokenizer, max_length = state.tokenizer, state.request.config.max_seq_length
    vocab_size = state.model.get_input_embeddings().num_embeddings
    sequences: list[Sequence] = []
    skipped: list[str] = []
    rewards: list[float] = []
    group_stds: list[float] = []
    metric_values: dict[str, list[float]] = {}
    groups_skipped = exact = rerendered = 0
    for g, group in enumerate(body.groups):
        built: list[tuple[float, Built]] = []
        group_stds.append(statistics.pstdev(t.reward for t in group.trajectories))
        for t, trajectory in enumerate(group.trajectories):
            rewards.append(trajectory.reward)
            for key, value in trajectory.metrics.items():
                metric_values.setdefault(key, []).append(value)
            try:
                built.append((trajectory.reward, build_sequences(tokenizer, trajectory, max_length, vocab_size,
                                                                 state.eos_token_ids)))
            except TokenizationError as exc:
                skipped.append(f"group {g}, trajectory {t}: {exc}")
            except Exception as exc:  # a bug here must not cost the batch either; the log has the traceback
                log.exception("building group %d trajectory %d failed", g, t)
                skipped.append(f"group {g}, trajectory {t}: could not be built ({exc!r}); see the server log")
        advantages = (group_advantages([reward for reward, _ in built], body.config.scale_rewards)
                      if len(built) >= 2 else None)
        if advantages is None:
            groups_skipped += 1
            continue
        for (_, result), advantage in zip(built, advantages):
            if advantage == 0.0:
                continue
            for sequence in result.sequences:
                sequence.advantage = advantage
            sequences += result.sequences
            exact += result.exact_tokens
            rerendered += result.rerendered_tokens
    for line in skipped[:_LOGGED_SKIPS]:
        log.warning("training %s skips %s", state.name, line)
    if len(skipped) > _LOGGED_SKIPS:
        log.warning("training %s skips %d more trajectories", state.name, len(skipped) - _LOGGED_SKIPS)
    metrics = {"reward": sum(rewards) / len(rewards), "reward_std_dev": sum(group_stds) / len(group_stds),
               "num_groups": float(len(body.groups)),
               "num_trajectories": float(len(rewards)), "num_groups_skipped": float(groups_skipped),
               "num_trajectories_skipped": float(len(skipped)), "trained_tokens_exact": float(exact),
               "trained_tokens_rerendered": float(rerendered)}
    metrics |= {key: sum(values) / len(values) for key, values in metric_values.items() if key not in metrics}
    return Prepared(sequences, metrics, skipped)
