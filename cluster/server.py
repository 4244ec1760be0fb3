"""The cluster server: art-sky's control API and an OpenAI-compatible endpoint, one FastAPI app.

Binds 127.0.0.1 (reached through an SSH tunnel from the laptop); every route but /health needs the API key.
One lock serialises the device between inference and training, ART's semantics: while a model trains,
completions wait.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from jinja2 import TemplateError

import art_sky
from art_sky.checkpoints import CheckpointDir, history_entry, steps_to_keep
from art_sky.errors import (
    ArtSkyError,
    CheckpointStoreError,
    ConfigError,
    EngineError,
    EngineRequestError,
    TokenizationError,
)
from art_sky.settings import Settings
from art_sky.store import CheckpointStore
from art_sky.wire import (
    ChatCompletionRequest,
    CheckpointInfo,
    DeleteCheckpointsRequest,
    HealthResponse,
    LogRequest,
    ModelInfo,
    RegisterRequest,
    SFTRequest,
    SyncStatus,
    TrainProgress,
    TrainRequest,
)

from .engine import Engine, Job
from .grpo import group_advantages
from .model_state import ModelState, create_model_state, device, restore_from_store
from .peft_trainer import Progress
from .selection import select_engine, select_trainer
from .sequences import Sequence, sft_sequence, tokenize_trajectory
from .sync import CheckpointSync

log = logging.getLogger("art_sky.cluster")


class InferenceQueue:
    """Collects completion requests that arrive together so the engine samples them as one batch.

    Requests wait while a model trains (the device lock); when training ends they go out in one batch.
    """

    def __init__(self, engine: Engine, lock: asyncio.Lock, max_rows: int):
        self.engine, self.lock, self.max_rows = engine, lock, max_rows
        self.pending: list[tuple[Job, asyncio.Future]] = []
        self.wake = asyncio.Event()
        self.worker: asyncio.Task | None = None

    async def submit(self, job: Job):
        future = asyncio.get_running_loop().create_future()
        self.pending.append((job, future))
        if self.worker is None or self.worker.done():
            self.worker = asyncio.create_task(self._work())
        self.wake.set()
        return await future

    async def _work(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            while self.pending:
                async with self.lock:
                    await asyncio.sleep(0.005)  # let requests sent together join this batch
                    batch = self._take()
                    try:
                        results = await asyncio.to_thread(self.engine.run, [job for job, _ in batch])
                    except Exception as exc:  # one bad batch fails its requests, not the server
                        log.exception("inference failed")
                        results = [exc] * len(batch)
                for (_, future), result in zip(batch, results):
                    if not future.done():
                        (future.set_exception if isinstance(result, Exception) else future.set_result)(result)

    def _take(self) -> list[tuple[Job, asyncio.Future]]:
        """The oldest request and those after it for the same model, up to max_rows sampled rows."""
        state = self.pending[0][0].state
        batch, rest, rows = [], [], 0
        for job, future in self.pending:
            if future.done():
                continue
            if job.state is state and (not batch or rows + job.request.n <= self.max_rows):
                batch.append((job, future))
                rows += job.request.n
            else:
                rest.append((job, future))
        self.pending = rest
        return batch


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


def create_app(art_path: Path, api_key: str, settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    engine, trainer = select_engine(settings, art_path, api_key), select_trainer(settings)
    store = CheckpointStore.from_settings(settings)
    sync = CheckpointSync(store, settings.checkpoint_strict) if store else None
    states: dict[str, ModelState] = {}
    lock = asyncio.Lock()
    inference = InferenceQueue(engine, lock, settings.max_batch_rows)
    background: set[asyncio.Task] = set()
    bearer = HTTPBearer(auto_error=False)

    def authorized(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if credentials is None or not secrets.compare_digest(credentials.credentials.encode(), api_key.encode()):
            raise HTTPException(401, "missing or wrong API key: send the server's key as a bearer token "
                                     "(model.openai_client() and the backends do this for you)")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            await asyncio.to_thread(engine.close)  # a child engine (vLLM) stops with the server

    app = FastAPI(title="art-sky cluster server", version=art_sky.__version__, lifespan=lifespan)
    app.add_middleware(BodySizeLimit, limit=settings.max_request_bytes)
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
                              inference_port=engine.inference_port)

    @app.get("/v1/models", dependencies=guarded)
    async def list_models() -> dict:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "art-sky"} for name in sorted(states)]}

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(body: ChatCompletionRequest) -> dict:
        if body.stream:
            raise HTTPException(400, "stream=True is not supported by the portable engine: request without "
                                     "streaming")
        try:
            job = engine.prepare(model(body.model), body)
        except (ValueError, TemplateError) as exc:
            raise HTTPException(400, str(exc)) from exc
        return (await inference.submit(job)).model_dump(exclude_none=True)

    @app.post("/art/models", dependencies=guarded)
    async def register(body: RegisterRequest) -> ModelInfo:
        async with lock:
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
            states[body.name] = state
        if sync:
            sync.submit(states[body.name].checkpoints, states[body.name].step)
        log.info("registered %s (%s) at step %d", body.name, body.base_model, states[body.name].step)
        return states[body.name].info()

    @app.get("/art/models/{name}", dependencies=guarded)
    async def model_info(name: str) -> ModelInfo:
        return model(name).info()

    def stream_step(name: str, state: ModelState, work: Callable[[Progress], dict[str, float]],
                    batches: Callable[[], list[dict[str, float]]] = list) -> StreamingResponse:
        """Run one training step (`work(progress)` returns its metrics) with inference paused, commit it as the next
        checkpoint, and stream progress lines then the result (or the error)."""
        if sync and (problem := sync.blocking_error()):
            raise HTTPException(502, problem)
        queue: asyncio.Queue[TrainProgress] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def progress(done: int, total: int) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, TrainProgress(type="progress", done=done, total=total))

        def step() -> dict[str, float]:
            engine.pause()  # inference waits while training (a vLLM engine also frees its GPU memory)
            trained = False
            try:
                metrics = work(progress)
                state.step += 1
                state.save_checkpoint(metrics)
                trained = True
            finally:
                engine.resume(state, trained)  # serves the new step before inference resumes
            state.checkpoints.append_history(history_entry(state.step, "train", metrics))
            return metrics

        async def run() -> None:
            async with lock:
                try:
                    metrics = await asyncio.to_thread(step)
                except Exception as exc:  # reported to the client; the server keeps serving
                    log.exception("training %s failed", name)
                    await queue.put(TrainProgress(type="error", message=f"training failed: {exc}"))
                    return
            if sync:
                sync.submit(state.checkpoints, state.step)  # uploads while the next rollouts run
            await queue.put(TrainProgress(type="result", step=state.step, metrics=metrics, batches=batches()))

        task = asyncio.create_task(run())  # runs to the end even if the client goes away
        background.add(task)
        task.add_done_callback(background.discard)

        async def lines():
            while True:
                item = await queue.get()
                yield item.model_dump_json(exclude_defaults=True) + "\n"
                if item.type != "progress":
                    return

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post("/art/models/{name}/train", dependencies=guarded)
    async def train(name: str, body: TrainRequest) -> StreamingResponse:
        state = model(name)
        try:
            sequences, skipped, summary = _prepare(state, body)
        except TokenizationError as exc:
            raise HTTPException(422, f"invalid trajectory: {exc}") from exc

        def work(progress: Progress) -> dict[str, float]:
            metrics = (trainer.train(state, sequences, body.config, progress) if sequences else
                       {"trained_tokens": 0.0, "sequences": 0.0})  # every group equal: nothing to learn
            return metrics | summary | {"num_groups_skipped": float(skipped)}

        return stream_step(name, state, work)

    @app.post("/art/models/{name}/sft", dependencies=guarded)
    async def sft(name: str, body: SFTRequest) -> StreamingResponse:
        """ART's `_train_sft`: one optimizer step per batch, one checkpoint (one step) for the request."""
        state = model(name)
        size, count = body.batch_size, len(body.trajectories)
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
        for problem in dropped:
            log.warning("SFT of %s skips %s", name, problem)
        per_batch: list[dict[str, float]] = []

        def work(progress: Progress) -> dict[str, float]:
            per_batch.extend(trainer.sft(state, batches, batch_rates, body.max_grad_norm, progress))
            tokens = sum(b["trained_tokens"] for b in per_batch)
            return {"loss": sum(b["loss"] * b["trained_tokens"] for b in per_batch) / tokens,
                    "trained_tokens": tokens, "num_trajectories": float(count - len(dropped)),
                    "num_dropped_trajectories": float(len(dropped)), "num_batches": float(len(batches))}

        return stream_step(name, state, work, lambda: per_batch)

    @app.post("/art/models/{name}/log", dependencies=guarded)
    async def log_metrics(name: str, body: LogRequest) -> dict:
        state = model(name)
        entry = history_entry(state.step, body.split, body.metrics)
        state.checkpoints.append_history(entry)
        return entry

    @app.get("/art/models/{name}/checkpoints", dependencies=guarded)
    async def checkpoints(name: str) -> list[CheckpointInfo]:
        store = model(name).checkpoints
        return [_checkpoint_info(store, step) for step in store.steps()]

    @app.post("/art/models/{name}/checkpoints/delete", dependencies=guarded)
    async def delete_checkpoints(name: str, body: DeleteCheckpointsRequest) -> list[CheckpointInfo]:
        state = model(name)
        async with lock:
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
    if isinstance(exc, EngineRequestError):
        return exc.status_code
    for kind, status in ((ConfigError, 422), (TokenizationError, 422), (CheckpointStoreError, 502),
                         (EngineError, 503)):
        if isinstance(exc, kind):
            return status
    return 500


def _checkpoint_info(store, step: int) -> CheckpointInfo:
    manifest = store.manifest(step)
    return CheckpointInfo(step=step, size_bytes=manifest.size_bytes, created_at=manifest.created_at,
                          metrics=manifest.metrics)


def _prepare(state: ModelState, body: TrainRequest) -> tuple[list[Sequence], int, dict[str, float]]:
    """Tokenize every trajectory (so bad input fails before training), keep those with an advantage."""
    sequences, skipped, rewards = [], 0, []
    metric_sums: dict[str, list[float]] = {}
    for g, group in enumerate(body.groups):
        group_rewards = [t.reward for t in group.trajectories]
        rewards += group_rewards
        advantages = group_advantages(group_rewards, body.config.scale_rewards)
        skipped += advantages is None
        for t, (trajectory, advantage) in enumerate(zip(group.trajectories, advantages or [0.0] * len(group_rewards))):
            for key, value in trajectory.metrics.items():
                metric_sums.setdefault(key, []).append(value)
            # ART's additional_histories: further sequences of the same rollout, with its advantage
            for h, history in enumerate([trajectory, *trajectory.additional_histories]):
                try:
                    sequence = tokenize_trajectory(state.tokenizer, history, advantage,
                                                   state.request.config.max_seq_length)
                except TokenizationError as exc:
                    where = f"group {g}, trajectory {t}" + (f", additional_histories[{h - 1}]" if h else "")
                    raise TokenizationError(f"{where}: {exc}") from exc
                if advantage != 0.0:
                    sequences.append(sequence)
    summary = {"reward": sum(rewards) / len(rewards), "num_groups": float(len(body.groups)),
               "num_trajectories": float(len(rewards))}
    summary |= {key: sum(values) / len(values) for key, values in metric_sums.items() if key not in summary}
    return sequences, skipped, summary
