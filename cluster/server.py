"""The cluster server: art-sky's control API and an OpenAI-compatible endpoint, one FastAPI app.

Binds 127.0.0.1 (reached through an SSH tunnel from the laptop); every route but /health needs the API key (the OpenAPI
document too: /openapi.json; there are no /docs pages). The OpenAI surface (/v1) is cluster/inference/openai_api.py,
with the inference fleet behind it (cluster/inference/fleet.py: this node's engine and the worker nodes' replicas). The
device gate (cluster/inference/gate.py) keeps inference and adapter swaps apart: a completion is sampled by the step it
names; while a model trains, completions go on with its previous step where the engine serves while training, and wait
otherwise (ART's semantics). A training step is a transaction (cluster/steps.py). Request bodies are size-limited per
route and parsed off the event loop (cluster/bodies.py), and registering a model loads it without the device gate, so
one request never stalls the others.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import statistics
import time
from collections import Counter
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials

import art_sky
from art_sky.checkpoints import CheckpointDir, history_entry, steps_to_keep
from art_sky.disk_full import disk_full
from art_sky.errors import ArtSkyError, ErrorCode, LimitError, TokenizationError, problems
from art_sky.redact import redact
from art_sky.settings import Settings
from art_sky.store import CheckpointStore
from art_sky.wire import (
    ChatCompletionRequest,
    CheckpointInfo,
    DeleteCheckpointsRequest,
    ErrorResponse,
    HealthResponse,
    Lease,
    LeaseRequest,
    LogRequest,
    ModelInfo,
    RegisterRequest,
    SFTRequest,
    SyncStatus,
    TrainRequest,
)

from . import bodies, rollouts, runs
from .activity import ModelActivity, StepTimer
from .auth import api_key_auth
from .http_status import error_response
from .inference import openai_api
from .inference.fleet import Fleet
from .inference.fleet import install as fleet_routes
from .inference.gate import DeviceGate
from .lineage import Lineages
from .model_state import ModelState, create_model_state, device, restore_from_store
from .node.gpu_sharing import sharing_of
from .node.placement import Placement, place
from .node.selection import select_engine, select_trainer, vllm_serves
from .node.stack import installed_versions, stack_status
from .preflight import check_registration
from .steps import StepPlan, Steps
from .sync import CheckpointSync
from .training.grpo import group_advantages
from .training.peft_trainer import PeftTrainer, Progress
from .training.rank_group import ShardedTrainer
from .training.sequences import Built, Sequence, build_sequences, sft_sequences

log = logging.getLogger("art_sky.cluster")
_LOGGED_SKIPS = 100  # skipped trajectories named one by one in the log and the step's result


class Arrival:
    """Stamp each request with when it reached the server, before its body is read: a step's upload time."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrived"] = time.monotonic()
        await self.app(scope, receive, send)


def create_app(
    art_path: Path,
    api_key: str,
    settings: Settings | None = None,
    placement: Placement | None = None,
    server_files: str | None = None,
) -> FastAPI:
    """The server's app; `server_files`: its run directory, which the owner records of its lineages name."""
    settings = settings or Settings()
    placement = placement or place(settings, vllm_serves(settings))  # python -m art_sky.cluster chose it earlier
    engine = select_engine(settings, art_path, api_key, placement)
    trainer = select_trainer(settings, placement, engine)
    versions, stack = installed_versions(), stack_status(engine.name, trainer.name)
    store = CheckpointStore.from_settings(settings)
    lineages = Lineages(art_path, settings, store, server_files or str(art_path))  # one writer per lineage
    sync = CheckpointSync(store, settings.checkpoint_strict, lineages.refused) if store else None
    states: dict[str, ModelState] = {}
    gate = DeviceGate()
    activities: dict[str, ModelActivity] = {}  # what the server is doing with each model (cluster/activity.py)
    registering: dict[str, asyncio.Task[ModelState]] = {}
    registration = asyncio.Lock()  # one model loads at a time; inference goes on meanwhile
    bearer, has_key, authorized = api_key_auth(api_key)
    fleet = Fleet(
        engine, api_key, settings.nodes
    )  # what /v1 and the steps see: this node's engine and the joined replicas
    if isinstance(trainer, ShardedTrainer):  # a rank lost with a node: the fleet says which node
        trainer.group.lost_nodes = fleet.lost

    def committed(state: ModelState) -> None:
        record = state.record(state.step)  # on disk or being written
        if sync and (record is None or record.saved):  # a step trained with save_checkpoint=False is not uploaded
            sync.submit(state.checkpoints, state.step, written=state.writer.written)  # once on disk, while the
            # next rollouts run

    def write_checkpoints() -> None:
        """Every model's newest step on disk (a failed write tried again; raises if it fails again)."""
        for state in list(states.values()):
            state.writer.flush()

    steps = Steps(fleet, gate, committed)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            for state in list(states.values()):  # the steps train() reported, on disk before the server stops
                await asyncio.to_thread(state.writer.close)
            await fleet.aclose()  # connections made on this event loop
            await asyncio.to_thread(fleet.close)  # a child engine (vLLM) stops with the server
            await asyncio.to_thread(trainer.close)  # so do the trainer's ranks
            await lineages.close()  # the next cluster on the store need not wait for this one's records to go stale

    app = FastAPI(
        title="art-sky cluster server",
        version=art_sky.__version__,
        lifespan=lifespan,
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.add_middleware(
        bodies.BodyLimits, training=settings.max_request_bytes, other=settings.max_completion_request_bytes
    )
    app.add_middleware(Arrival)
    guarded = [Depends(authorized)]

    @app.exception_handler(ArtSkyError)
    async def _art_sky_error(request: Request, exc: ArtSkyError) -> JSONResponse:
        status, body = error_response(exc)
        return JSONResponse(body.model_dump(), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        said = problems(exc, drop=1, empty="body")  # "body" is every path's first part
        body = ErrorResponse(detail=redact(f"invalid request: {said}"), code=ErrorCode.INVALID)
        return JSONResponse(body.model_dump(), status_code=422)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        """What no route expected: a full disk is still said as such (507); anything else, a sentence, not
        Starlette's bare "Internal Server Error"."""
        if full := disk_full(exc, art_path):
            status, body = error_response(full)
            return JSONResponse(body.model_dump(), status_code=status)
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        body = ErrorResponse(
            detail=redact(
                f"the server failed on {request.method} {request.url.path} ({type(exc).__name__}: {exc}); the "
                "traceback is in its log (`art-sky logs`): please report it"
            ),
            code=ErrorCode.INTERNAL,
        )
        return JSONResponse(body.model_dump(), status_code=500)

    def model(name: str) -> ModelState:
        """The run served as `name` (or a name's only run: cluster/runs.py)."""
        return runs.registered(states, name)

    @app.get("/openapi.json", dependencies=guarded, include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/health")
    async def health(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> HealthResponse:
        """Alive, and which version; with the API key also what runs and which models are registered."""
        if not has_key(credentials):
            return HealthResponse(version=art_sky.__version__)
        return HealthResponse(
            version=art_sky.__version__,
            engine=engine.name,
            trainer=trainer.name,
            trainer_ranks=trainer.ranks,
            device=str(device()),
            models=sorted(states),
            engine_port=engine.engine_port,
            versions=versions,
            stack=stack,
            gpu_sharing=sharing_of(engine),
            serves_while_training=engine.serves_while_training,
            placement=getattr(engine, "placement", placement).describe(),  # vLLM's: sized
            fleet=fleet.describe(),
        )

    openai_api.install(app, fleet, states, gate, api_key, guarded, activities)
    fleet_routes(app, fleet, guarded, states, trainer.rendezvous)

    async def load(body: RegisterRequest) -> ModelState:
        await check_registration(body.base_model, store, settings.checkpoint_strict)  # before anything slow
        async with registration:
            fleet.check(body)  # before loading anything (or writing a step 0 checkpoint)
            await lineages.take(body)  # refused when another server writes this lineage
            checkpoints = CheckpointDir(art_path, body.project, body.run)
            downloaded = await restore_from_store(store, checkpoints, settings.checkpoint_strict) if store else None
            state = await asyncio.to_thread(
                create_model_state, body, art_path, settings, trainer.load_model, downloaded, trainer.load_weights
            )
            async with gate.exclusive():  # the engine starts serving it (vLLM loads its adapter)
                await asyncio.to_thread(fleet.attach, state)
                activities[body.served] = ModelActivity(gate, state.checkpoints.history())
                states[body.served] = state
        if sync:
            sync.submit(state.checkpoints, state.step)
        log.info("registered %s (%s) at step %d", body.served, body.base_model, state.step)
        return state

    def registered(body: RegisterRequest, task: asyncio.Task[ModelState]) -> None:
        registering.pop(body.served, None)
        if task.cancelled() or task.exception() is not None:
            lineages.release_name(body)

    @app.post("/art/models", dependencies=guarded)
    async def register(body: RegisterRequest) -> ModelInfo:
        """Load a run (its newest checkpoint, from the store on a fresh cluster), without stopping inference of
        the others; each run of a name is its own lineage, served as its own name (cluster/runs.py). Idempotent: a
        repeated registration (a retry) waits for the one loading and answers the same."""
        served = body.served
        if served not in states and served not in registering:
            lineages.claim_name(body)  # 409 when another name holds this lineage here
            task = registering[served] = asyncio.create_task(load(body))  # runs on if the client goes away
            task.add_done_callback(lambda done: registered(body, done))
        if served in registering:
            await asyncio.shield(registering[served])
        existing = states[served].request
        if (existing.project, existing.base_model) != (body.project, body.base_model):
            raise HTTPException(
                409,
                f"model {served!r} is already registered with project "
                f"{existing.project!r} and base model {existing.base_model!r}",
            )
        return states[served].info()

    @app.get("/art/models/{name}", dependencies=guarded)
    async def model_info(name: str) -> ModelInfo:
        """The model, with what the server is doing with it now (`art-sky status`)."""
        state = model(name)
        activity = activities[state.name]
        return state.info().model_copy(
            update={
                "activity": activity.activity(),
                "serving": activity.serving(f"{state.name}@{state.step}"),
                "last_step": activity.last_step,
                "sync": sync.model_sync(state.checkpoints.name) if sync else None,
            }
        )

    @app.get("/art/models/{name}/history", dependencies=guarded)
    async def history(name: str) -> list[dict]:
        """The model's history.jsonl: a line per step and per `model.log` (`art-sky plot`), the newest step's once
        it is on disk."""
        state = model(name)
        await asyncio.to_thread(state.writer.written, state.step)
        return state.checkpoints.history()

    async def stream_step(
        state: ModelState, body: TrainRequest | SFTRequest, request: Request, prepare: Callable[[], StepPlan]
    ) -> StreamingResponse:
        """Run (or follow, or replay) the step the body's request id asks for and stream its progress lines (at
        least every few seconds, with what the step is doing), then its result or its error."""
        if sync and (problem := sync.blocking_error()):
            raise HTTPException(502, problem)
        timer = StepTimer(activities[state.name], getattr(request.state, "arrived", time.monotonic()))
        events = await steps.submit(state, body.request_id, prepare, timer, body.clock)

        async def lines():
            async for event in events:
                yield event.model_dump_json(exclude_defaults=True) + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post("/art/models/{name}/train", dependencies=guarded, openapi_extra=bodies.request_body(TrainRequest))
    async def train(name: str, request: Request) -> StreamingResponse:
        """One GRPO step on the groups: progress lines, then the result (newline-delimited JSON)."""
        state = model(name)
        body = await bodies.parse(request, TrainRequest)
        return await stream_step(state, body, request, lambda: _prepare_train(state, body, trainer))

    @app.post("/art/models/{name}/sft", dependencies=guarded, openapi_extra=bodies.request_body(SFTRequest))
    async def sft(name: str, request: Request) -> StreamingResponse:
        """ART's `_train_sft`: one optimizer step per batch, one checkpoint (one step) for the request."""
        state = model(name)
        body = await bodies.parse(request, SFTRequest)
        return await stream_step(state, body, request, lambda: _prepare_sft(state, body, trainer))

    @app.post("/art/models/{name}/log", dependencies=guarded)
    async def log_metrics(name: str, body: LogRequest) -> dict:
        state = model(name)
        if body.step is not None and body.step > state.step + 1:
            raise HTTPException(
                400,
                f"step {body.step} of {name} is past its bound: {name} is at step {state.step}, so metrics "
                f"belong to a step up to {state.step + 1} (the one being trained); leave `step` out for the "
                "current one",
            )
        entry = history_entry(state.step if body.step is None else body.step, body.split, body.metrics)
        try:
            state.checkpoints.append_history(entry)
        except OSError as exc:
            if full := disk_full(
                exc,
                state.checkpoints.model_dir,
                "Free space there (`await model.delete_checkpoints()` deletes old checkpoints) and log again.",
            ):
                raise full from exc
            raise HTTPException(
                500,
                f"the history of {name} could not be written to "
                f"{state.checkpoints.model_dir} ({exc.strerror or exc}): fix the directory "
                "and log again",
            ) from exc
        return entry

    @app.get("/art/models/{name}/checkpoints", dependencies=guarded)
    async def checkpoints(name: str) -> list[CheckpointInfo]:
        state = model(name)
        await asyncio.to_thread(state.writer.written, state.step)  # the newest step, once it is on disk
        return _checkpoint_infos(state.checkpoints)

    @app.post("/art/models/{name}/checkpoints/delete", dependencies=guarded)
    async def delete_checkpoints(name: str, body: DeleteCheckpointsRequest) -> list[CheckpointInfo]:
        state = model(name)
        await asyncio.to_thread(state.writer.written, state.step)  # the newest step listed once on disk
        async with steps.training, gate.exclusive():  # never during a step: its checkpoint is saved before served
            existing = state.checkpoints.steps()
            keep = (
                set(body.keep_steps)
                if body.keep_steps is not None
                else steps_to_keep(existing, state.checkpoints.history(), body.best_checkpoint_metric, body.keep_last)
            )
            keep.add(state.step)  # the adapter being served and trained stays
            keep |= set(state.leases.values())  # and those a client holds a lease on
            await asyncio.to_thread(state.checkpoints.delete, [s for s in existing if s not in keep])
        if sync:
            sync.submit_retention(
                state.checkpoints, body.best_checkpoint_metric, body.keep_last, state.step, body.keep_steps
            )
        return _checkpoint_infos(state.checkpoints)

    @app.post("/art/models/{name}/leases", dependencies=guarded)
    async def lease(name: str, body: LeaseRequest) -> Lease:
        """ART's adapter lease: `name@step` keeps being served by exactly that step, and its checkpoint is kept, until
        the lease is released (or the server restarts)."""
        state = model(name)
        if body.step != state.step and state.checkpoints.manifest(body.step) is None:
            raise HTTPException(
                404,
                f"step {body.step} of {name} has no checkpoint (steps: "
                f"{state.checkpoints.steps()}): lease a step that exists",
            )
        if len(state.leases) >= settings.max_leases_per_model:
            held = Counter(state.leases.values())
            raise LimitError(
                f"{name} holds {len(state.leases)} adapter leases, the most ART_SKY_MAX_LEASES_PER_MODEL allows ("
                + ", ".join(f"{count} on step {step}" for step, count in sorted(held.items()))
                + "): release leases (leave `backend.adapter_lease(...)`'s block) before taking more, or raise the "
                "setting on the server"
            )
        lease_id = secrets.token_hex(8)
        state.leases[lease_id] = body.step
        return Lease(id=lease_id, step=body.step)

    @app.delete("/art/models/{name}/leases/{lease_id}", dependencies=guarded)
    async def release(name: str, lease_id: str) -> dict:
        """Release a lease (releasing one already released is not an error: a retry)."""
        return {"released": model(name).leases.pop(lease_id, None) is not None}

    @app.get("/art/checkpoints/sync", dependencies=guarded)
    async def sync_status() -> SyncStatus:
        return sync.status() if sync else SyncStatus()

    @app.post("/art/checkpoints/flush", dependencies=guarded)
    async def flush_checkpoints() -> SyncStatus:
        """Wait until every checkpoint so far is on disk and in the store (failed writes and uploads are retried
        once)."""
        await asyncio.to_thread(write_checkpoints)
        return await sync.flush() if sync else SyncStatus()

    bodies.document(app, [TrainRequest, SFTRequest, ChatCompletionRequest], openai_api.PATHS)
    return app


def _checkpoint_infos(checkpoints: CheckpointDir) -> list[CheckpointInfo]:
    infos = []
    for step in checkpoints.steps():
        manifest = checkpoints.manifest(step)
        if manifest is not None:  # not deleted meanwhile
            infos.append(
                CheckpointInfo(
                    step=step, size_bytes=manifest.size_bytes, created_at=manifest.created_at, metrics=manifest.metrics
                )
            )
    return infos


def _prepare_train(state: ModelState, body: TrainRequest, trainer: PeftTrainer | ShardedTrainer) -> StepPlan:
    """A GRPO step's plan: the request's sequences (built here, in a worker thread), trained in one optimizer step."""
    outcomes = rollouts.Outcomes()
    prepared = _prepare(state, body, outcomes)

    def train(progress: Progress) -> tuple[dict[str, float], list[dict[str, float]]]:
        if not prepared.sequences:  # nothing to learn
            return {"trained_tokens": 0.0, "sequences": 0.0} | prepared.metrics, []
        chunks = _optimizer_steps(prepared.sequences, body.config.grad_accumulation_sequences)

        def part(i: int) -> Progress:  # optimizer step i's progress, as a share of the whole request's
            return lambda done, total: progress(i * total + done, len(chunks) * total)

        per_step = [trainer.train(state, chunk, body.config, part(i)) for i, chunk in enumerate(chunks)]
        return _combined(per_step) | prepared.metrics, []

    named = prepared.skipped[:_LOGGED_SKIPS]
    if len(prepared.skipped) > _LOGGED_SKIPS:
        named.append(f"... and {len(prepared.skipped) - _LOGGED_SKIPS} more")
    line = partial(rollouts.step_line, body, outcomes)  # built by the rollouts writer, after the step
    return StepPlan("train", train, named, saved=body.save_checkpoint, rollouts=line)


def _optimizer_steps(sequences: list[Sequence], per_step: int | None) -> list[list[Sequence]]:
    """The step's sequences split into optimizer steps (ART's grad_accumulation_sequences), in order; one without."""
    if per_step is None:
        return [sequences]
    return [sequences[start : start + per_step] for start in range(0, len(sequences), per_step)]


def _combined(per_step: list[dict[str, float]]) -> dict[str, float]:
    """Several optimizer steps' metrics as one step's: counts summed, per-token figures weighted by trained tokens,
    the rest (gradient norm, learning rate) averaged, as ART averages its gradient steps."""
    if len(per_step) == 1:
        return per_step[0]
    tokens = sum(m["trained_tokens"] for m in per_step)
    combined = {}
    for key in per_step[0]:
        values = [m[key] for m in per_step]
        if key in ("trained_tokens", "sequences"):
            combined[key] = sum(values)
        elif key in ("loss", "policy_loss", "kl", "entropy", "clip_fraction"):
            combined[key] = sum(v * m["trained_tokens"] for v, m in zip(values, per_step, strict=False)) / tokens
        else:
            combined[key] = sum(values) / len(values)
    return combined | {"num_gradient_steps": float(len(per_step))}


def _prepare_sft(state: ModelState, body: SFTRequest, trainer: PeftTrainer | ShardedTrainer) -> StepPlan:
    """An SFT step's plan: batches of the list given, each at its learning rate, as ART. A trajectory that cannot be
    rendered is skipped and reported (as ART drops it from its batch); none left is a 422."""
    size, count = body.batch_size, len(body.trajectories)
    rates = body.learning_rates * -(-count // size) if len(body.learning_rates) == 1 else body.learning_rates
    batches, batch_rates, dropped = [], [], []
    for start, rate in zip(range(0, count, size), rates, strict=False):
        batch = []
        for index in range(start, min(start + size, count)):
            try:
                batch += sft_sequences(
                    state.tokenizer, body.trajectories[index], state.request.config.max_seq_length, body.assistant_turns
                )
            except TokenizationError as exc:
                dropped.append(f"trajectory {index}: {exc}")
        if batch:
            batches.append(batch)
            batch_rates.append(rate)
    if not batches:
        raise TokenizationError("no trajectory can be trained: " + "; ".join(dropped[:3]))
    for problem in dropped:
        log.warning("SFT of %s skips %s", state.name, problem)

    def train(progress: Progress) -> tuple[dict[str, float], list[dict[str, float]]]:
        per_batch = trainer.sft(state, batches, batch_rates, body.max_grad_norm, progress)
        tokens = sum(b["trained_tokens"] for b in per_batch)
        return {
            "loss": sum(b["loss"] * b["trained_tokens"] for b in per_batch) / tokens,
            "trained_tokens": tokens,
            "num_trajectories": float(count - len(dropped)),
            "num_dropped_trajectories": float(len(dropped)),
            "num_batches": float(len(batches)),
        }, per_batch

    return StepPlan("sft", train)


@dataclass
class Prepared:
    """A train request turned into sequences, with what was left out and why."""

    sequences: list[Sequence]
    metrics: dict[str, float]
    skipped: list[str]  # "group G, trajectory T: reason", one per trajectory that could not be built


def _prepare(state: ModelState, body: TrainRequest, outcomes: rollouts.Outcomes) -> Prepared:
    """Build every trajectory's sequences; one that cannot be built is skipped and reported, never fails the batch.
    `outcomes` gets each trajectory's advantage or skip reason (the step's rollouts line).

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
        built: list[tuple[int, float, Built]] = []
        group_stds.append(statistics.pstdev(t.reward for t in group.trajectories))
        for t, trajectory in enumerate(group.trajectories):
            rewards.append(trajectory.reward)
            for key, value in trajectory.metrics.items():
                metric_values.setdefault(key, []).append(value)
            try:
                built.append(
                    (
                        t,
                        trajectory.reward,
                        build_sequences(
                            tokenizer,
                            trajectory,
                            max_length,
                            vocab_size,
                            state.eos_token_ids,
                            dict_turns=body.config.allow_training_without_logprobs,
                        ),
                    )
                )
            except TokenizationError as exc:
                skipped.append(f"group {g}, trajectory {t}: {exc}")
                outcomes.skipped[g, t] = str(exc)
            except Exception as exc:  # a bug here must not cost the batch either; the log has the traceback
                log.exception("building group %d trajectory %d failed", g, t)
                skipped.append(f"group {g}, trajectory {t}: could not be built ({exc!r}); see the server log")
                outcomes.skipped[g, t] = f"could not be built ({exc!r}); see the server log"
        advantages = (
            group_advantages([reward for _, reward, _ in built], body.config.scale_rewards) if len(built) >= 2 else None
        )
        if advantages is None:
            groups_skipped += 1
            outcomes.groups_skipped[g] = (
                "its rewards are all equal: nothing to learn" if len(built) >= 2 else "fewer than 2 trajectories built"
            )
            continue
        for (t, _, result), advantage in zip(built, advantages, strict=False):
            outcomes.advantages[g, t] = advantage
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
    metrics = {
        "reward": sum(rewards) / len(rewards),
        "reward_std_dev": sum(group_stds) / len(group_stds),
        "num_groups": float(len(body.groups)),
        "num_trajectories": float(len(rewards)),
        "num_groups_skipped": float(groups_skipped),
        "num_trajectories_skipped": float(len(skipped)),
        "trained_tokens_exact": float(exact),
        "trained_tokens_rerendered": float(rerendered),
    }
    metrics |= {key: sum(values) / len(values) for key, values in metric_values.items() if key not in metrics}
    return Prepared(sequences, metrics, skipped)
