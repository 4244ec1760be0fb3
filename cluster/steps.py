"""A training step is a transaction, and a request id trains at most one step.

`run_step` is the one place a step happens. It snapshots the live LoRA and its optimizer, trains (the random
generators seeded from the step number), stages the step's checkpoint (the LoRA, the optimizer's state and the
step's record: its request id, its result, its history line, copied to host memory, once the previous step is on
disk) and only then commits: the model's step advances and the engine serves the new adapter, while the checkpoint
is written in the background (cluster/checkpoint_writer.py; history.jsonl gets the line once it is on disk). The
step's answer waits for that write: a step the client was answered is on disk, so a server killed at any time after
never brings back less than it (the next step may train meanwhile: its commit waits for the write). Any
failure before the commit (the trainer, the previous step's write failing again, a disk without room for this one)
puts the LoRA and the optimizer back as they were, and the error says why. A server killed mid-step, or before a
step's write ended, never renamed that step into place: its next start resumes at the last step on disk and removes
what the write left (`CheckpointDir.remove_stale_temps`).

`Steps` runs the server's training requests: one step at a time on the device, each request id once. A repeated id
(the client retrying across a dropped connection or a server restart) follows the step in flight, or is answered
with the step it trained, from the committed records (so a restarted server knows too): the trainer's figures as the
step recorded them (the first answer also had the step's time split and cost, measured as it committed). A failed step
is not recorded: retrying its id trains it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from art_sky.checkpoints import StepRecord, history_entry
from art_sky.errors import ArtSkyError, EngineError
from art_sky.wire import StepClock, TrainProgress

from . import rollouts
from .activity import StepTimer, reset_peak_memory, step_metrics
from .http_status import classify
from .inference.engine import Engine
from .inference.gate import DeviceGate
from .model_state import ModelState
from .training.peft_trainer import Progress

log = logging.getLogger("art_sky.cluster")

RECENT_REQUESTS = 1000  # request ids each step's record remembers (a retry refers to a recent step)
HEARTBEAT = 5.0  # seconds between progress lines while a step runs: the client knows the server is alive and what
# the step is doing (a client whose step makes no progress names the phase)
STEP_SEED = 0


class StepError(ArtSkyError):
    """A step failed and was rolled back: the model is as it was before it."""


@dataclass
class StepPlan:
    """A prepared training request: `train(progress)` runs it (metrics, and per-batch metrics for SFT); `skipped`
    names the trajectories it leaves out and why."""

    kind: str  # train or sft
    train: Callable[[Progress], tuple[dict[str, float], list[dict[str, float]]]]
    skipped: list[str] = field(default_factory=list)
    saved: bool = True  # False (ART's save_checkpoint=False): served, not a resume point
    rollouts: Callable[[], dict] | None = None  # the step's rollouts.jsonl line (cluster/rollouts.py), built and
    # written by a background thread after the commit


def step_seed(step: int) -> int:
    """The seed of step `step`'s random draws (LoRA dropout): a function of the step alone, so a run resumed from a
    checkpoint draws what the straight run drew."""
    return STEP_SEED * 1_000_003 + step


@dataclass
class Trained:
    """A step trained and saved (committed on disk), not yet served: `publish` makes it the model's step."""

    result: TrainProgress  # with the trainer's metrics
    requests: dict[str, int]


def run_step(
    state: ModelState,
    engine: Engine,
    plan: StepPlan,
    request_id: str,
    progress: Progress,
    timer: StepTimer,
    clock: StepClock,
) -> TrainProgress:
    """A step on an engine that cannot serve while the trainer has the device: pause it, train and save, publish.
    Blocking: a worker thread, with the device gate held alone (inference waits for the whole step)."""
    timer.begin("swapping", "the engine hands the device to the trainer")
    engine.pause()  # inference waits while training (a vLLM engine on a shared GPU also frees its memory)
    try:
        trained = train_and_save(state, plan, request_id, progress, timer)
    except BaseException:
        timer.begin("swapping", "the engine resumes")
        _resume_after_failure(engine, state)
        timer.end()
        raise
    return publish(state, engine, trained, timer, clock)


def train_and_save(state: ModelState, plan: StepPlan, request_id: str, progress: Progress, timer: StepTimer) -> Trained:
    """Train the model's next step and stage its checkpoint (the commit point), or leave the LoRA and the
    optimizer exactly as they were and raise StepError. Blocking: a worker thread. Touches only the trainer's
    model: an engine that serves while training samples from its own copy of the adapter meanwhile."""
    step = state.step + 1
    before = state.weights.snapshot()  # the LoRA and AdamW, wherever the trainer keeps them
    reset_peak_memory()
    try:
        timer.begin("training")
        with _seeded(step_seed(step)):
            metrics, batches = plan.train(progress)
        result = TrainProgress(
            type="result",
            step=step,
            metrics=metrics,
            batches=batches,
            skipped=plan.skipped,
            checkpoint_path=str(state.checkpoints.step_dir(step)) if plan.saved else None,
        )
        requests = _recent(state.requests | {request_id: step})
        record = StepRecord(
            step=step,
            kind=plan.kind,
            request_id=request_id,
            seed=step_seed(step),
            result=result,
            requests=requests,
            history=history_entry(step, "train", metrics),
            saved=plan.saved,
        )
        timer.begin("saving", f"checkpoint of step {step}")
        try:
            state.commit_checkpoint(record, metrics)  # the commit point: staged (or written), the last step on disk
        except OSError as exc:  # a full disk is a DiskFullError already (art_sky/disk_full.py)
            raise StepError(
                f"the checkpoint of step {step} could not be written to {state.checkpoints.path} "
                f"({exc.strerror or exc}): fix the directory (its permissions, its mount) and train "
                "again"
            ) from exc
    except BaseException as exc:
        state.weights.restore(before)
        if isinstance(exc, Exception):
            raise StepError(
                f"training {state.name} step {step} failed and was rolled back: the model is as it "
                f"was at step {state.step}. {exc}"
            ) from exc
        raise
    return Trained(result, requests)


def publish(state: ModelState, engine: Engine, trained: Trained, timer: StepTimer, clock: StepClock) -> TrainProgress:
    """The saved step becomes the model's: its step advances and the engine serves the new adapter (then releases
    inference). Blocking: a worker thread, with the device gate held alone (no completion in flight, so none is
    sampled by one adapter and labelled with another's step). Returns the step's result (what the client gets, and
    a retry of its request id) with the step's time split, throughput and cost (`clock` is the client's)."""
    step = trained.result.step
    assert step is not None  # `train_and_save` made the result with its step
    state.step, state.requests = step, trained.requests
    timer.begin("swapping", "the engine loads the new adapter")
    try:
        engine.resume(state, True)  # serves the new step's adapter, then releases inference
    except Exception as exc:
        failed: Exception | None = exc
    else:
        failed = None
    timer.end()
    # The whole step's figures (its save and swap included) go to history.jsonl and the client; the record saved
    # with the checkpoint has the trainer's (it can only be written before the save ends).
    metrics, totals = step_metrics(timer, trained.result.metrics, clock.gather_s, clock.hourly_cost)
    entry = history_entry(step, "train", metrics | totals)
    try:
        state.writer.append_history(step, entry)
    except OSError as exc:  # the record has the line: the next start adds it (model_state._complete_history)
        log.warning("history of %s: step %d's line not written yet (%s)", state.name, step, exc)
    timer.activity.last_step = {key: value for key, value in entry.items() if key != "recorded_at"}
    if failed is not None:
        raise EngineError(
            f"step {step} of {state.name} was trained and saved, but the engine could not serve it: {failed}"
        ) from failed
    return trained.result.model_copy(update={"metrics": metrics, "totals": totals})


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """The step's own random state; the server's other draws (sampling seeds) are left alone."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _recent(requests: dict[str, int]) -> dict[str, int]:
    return dict(list(requests.items())[-RECENT_REQUESTS:])


def _resume_after_failure(engine: Engine, state: ModelState) -> None:
    try:
        engine.resume(state, False)  # the adapter it served before the step
    except Exception:  # the step's own error is the one to report
        log.exception("the engine did not resume after a failed step of %s", state.name)


class StepJob:
    """One training request's step, followed by every HTTP request that carries its id (the first, and retries)."""

    def __init__(self, request_id: str, timer: StepTimer):
        self.request_id, self.timer = request_id, timer
        self.prepared: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.latest = TrainProgress(type="progress")
        self.outcome: TrainProgress | None = None
        self._followers: list[asyncio.Queue[TrainProgress]] = []

    def report(self, event: TrainProgress) -> None:
        """A progress line, or the outcome (a result or an error). On the event loop."""
        if event.type == "progress":
            self.latest = event
        else:
            self.outcome = event
        for queue in self._followers:
            queue.put_nowait(event)

    def now(self) -> TrainProgress:
        """Where the step stands: its micro-batches and what it is doing (preparing, waiting, training, ...)."""
        activity = self.timer.activity
        return self.latest.model_copy(update={"activity": activity.activity()})

    async def follow(self, heartbeat: float = HEARTBEAT) -> AsyncIterator[TrainProgress]:
        """Where the step stands now, each progress line (the latest again every `heartbeat` seconds when there is
        none), then its outcome."""
        if self.outcome is not None:
            yield self.outcome
            return
        queue: asyncio.Queue[TrainProgress] = asyncio.Queue()
        self._followers.append(queue)
        try:
            yield self.now()
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), heartbeat)
                except TimeoutError:
                    event = self.now()
                yield event
                if event.type != "progress":
                    return
        finally:
            self._followers.remove(queue)


class Steps:
    """The server's training steps: prepared off the event loop, trained one at a time, published with the device
    gate held alone; `on_commit(state)` follows each commit (the checkpoint's upload).

    An engine that serves while training (`engine.serves_while_training`) keeps sampling from the previous step's
    adapter during the step: the gate closes only for the swap to the new one. Otherwise the gate is held for the
    whole step (`run_step`). Either way the step's `time/step_inference_paused_s` says how long inference waited."""

    def __init__(self, engine: Engine, gate: DeviceGate, on_commit: Callable[[ModelState], None]):
        self.engine, self.gate, self.on_commit = engine, gate, on_commit
        self.training = asyncio.Lock()  # held by the step on the device (one at a time), and by what must not
        # happen during a step although inference goes on (deleting checkpoints: the step's own is on disk early)
        self._jobs: dict[tuple[str, str], StepJob] = {}
        self._tasks: set[asyncio.Task] = set()

    async def submit(
        self,
        state: ModelState,
        request_id: str | None,
        prepare: Callable[[], StepPlan],
        timer: StepTimer,
        clock: StepClock,
    ) -> AsyncIterator[TrainProgress]:
        """The progress of the step `request_id` asks for: started now (`prepare()` runs in a worker thread and may
        raise the request's 4xx, raised here), already running (a retry follows it), or committed (its result).
        `timer` times a new step's phases; `clock` is the client's (its gather time, the machine's price)."""
        request_id = request_id or uuid.uuid4().hex
        replayed = self.replay(state, request_id)
        if replayed is not None:
            assert replayed.step is not None
            await asyncio.to_thread(state.writer.durable, replayed.step)  # a retry during the write waits for it
            log.info(
                "%s: request %s trained step %d already: answered with its result",
                state.name,
                request_id,
                replayed.step,
            )
            return _once(replayed)
        key = (state.name, request_id)
        job = self._jobs.get(key)
        if job is None:
            job = self._jobs[key] = StepJob(request_id, timer)
            task = asyncio.create_task(self._run(key, state, job, prepare, clock))  # runs on if the client goes away
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            log.info("%s: request %s is training: this retry follows it", state.name, request_id)
        await asyncio.shield(job.prepared)
        return job.follow()

    def replay(self, state: ModelState, request_id: str) -> TrainProgress | None:
        """The result of the committed step `request_id` trained, or None."""
        step = state.requests.get(request_id)
        if step is None:
            return None
        record = state.record(step)
        result = (
            record.result
            if record is not None and record.result is not None
            else TrainProgress(type="result", step=step)
        )
        return result.model_copy(update={"replayed": True})

    async def _run(
        self, key: tuple[str, str], state: ModelState, job: StepJob, prepare: Callable[[], StepPlan], clock: StepClock
    ) -> None:
        timer = job.timer
        try:
            timer.begin("preparing", "building the step's sequences")
            try:
                plan = await asyncio.to_thread(prepare)  # templates and tokenizers: off the event loop
            except Exception as exc:
                timer.end()
                job.prepared.set_exception(exc)
                return
            job.prepared.set_result(None)
            loop = asyncio.get_running_loop()

            def progress(done: int, total: int) -> None:
                timer.activity.trained(done, total)
                loop.call_soon_threadsafe(
                    job.report,
                    TrainProgress(type="progress", done=done, total=total, activity=timer.activity.activity()),
                )

            timer.begin("waiting")
            async with self.training:
                start = state.step
                log.info("training %s step %d (request %s)", state.name, start + 1, job.request_id)
                try:
                    result = await self._step(state, plan, job.request_id, progress, timer, clock)
                except Exception as exc:  # reported to the client; the server keeps serving
                    log.exception("training %s failed", state.name)
                    if state.step != start:  # committed, then the engine failed: the checkpoint still uploads
                        self.on_commit(state)
                    status, code = classify(exc)
                    job.report(TrainProgress(type="error", message=str(exc), status=status, code=code))
                    return
            log.info("committed step %d of %s", result.step, state.name)
            self.on_commit(state)
            if plan.rollouts is not None and result.step is not None:
                rollouts.append_later(state.checkpoints.model_dir, result.step, plan.rollouts)
            try:
                await asyncio.to_thread(state.writer.durable, state.step)  # answered once on disk
            except Exception as exc:  # trained and served, not on disk: the answer says why; a retry writes again
                log.exception("the checkpoint of step %d of %s was not written", result.step, state.name)
                status, code = classify(exc)
                job.report(TrainProgress(type="error", message=str(exc), status=status, code=code))
                return
            trained_nothing = plan.kind == "train" and not result.metrics.get("trained_tokens")
            if trained_nothing and plan.saved and result.step is not None:
                await self._fold_unchanged(state, result.step)
            job.report(result)
        finally:
            timer.end()
            del self._jobs[key]

    async def _fold_unchanged(self, state: ModelState, step: int) -> None:
        """A step that trained nothing (every group's rewards were equal) holds its predecessor's weights. As ART's
        layout has it (its test_step_skipping: 0001 becomes 0002), the predecessor's checkpoint is dropped once the
        new one is on disk, so the folder keeps those weights once, under the newer step. Step 0 (the lineage's
        start) and a leased step stay; the object store keeps its copy (its retention is `delete_checkpoints`')."""
        previous = step - 1
        if previous < 1 or previous in state.leases.values() or state.checkpoints.manifest(previous) is None:
            return
        if not await asyncio.to_thread(state.writer.written, step):
            return  # the new one is not on disk yet: the old one is the resume point meanwhile
        async with self.gate.exclusive():  # no completion is loading the old adapter from its folder meanwhile
            await asyncio.to_thread(state.checkpoints.delete, [previous])
        log.info(
            "%s: step %d trained nothing: its checkpoint holds step %d's weights, whose own is dropped",
            state.name,
            step,
            previous,
        )

    async def _step(
        self, state: ModelState, plan: StepPlan, request_id: str, progress: Progress, timer: StepTimer, clock: StepClock
    ) -> TrainProgress:
        engine = self.engine
        if not engine.serves_while_training:
            timer.inference_paused()
            async with self.gate.exclusive():
                return await asyncio.to_thread(run_step, state, engine, plan, request_id, progress, timer, clock)
        trained = await asyncio.to_thread(train_and_save, state, plan, request_id, progress, timer)
        timer.begin("waiting", "for the completions in flight to finish before the swap")
        timer.inference_paused()
        async with self.gate.exclusive():
            return await asyncio.to_thread(publish, state, engine, trained, timer, clock)


async def _once(event: TrainProgress) -> AsyncIterator[TrainProgress]:
    yield event
