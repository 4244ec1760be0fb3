"""What the server is doing with each model, as it happens, and what each training step cost.

A model's `ModelActivity` holds its phase (serving, or a step's preparing / waiting / training / saving / swapping),
its completions in flight and the tokens they sampled over the last minute, its newest step's history line and its
running cost. `art-sky status` reads it (GET /art/models/{name}); a train() stream sends it as progress, so a client
whose step makes no progress can say what the server waits on. A `StepTimer` times one step's phases; `step_metrics`
turns them into the step's time split, throughput, peak memory and cost.

The event loop and the training thread both write here; each field is assigned whole, so a reader sees a picture
that is at most a moment old, never a broken one.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from art_sky.wire import Activity, Phase, Serving

from .inference.gate import DeviceGate

WINDOW = 60.0  # seconds of completions the rates are measured over
# A step's phases and the metric each one's seconds go to (ART's names where ART has one).
PHASE_METRICS = {
    "preparing": "time/step_prepare_s",
    "waiting": "time/step_wait_s",
    "training": "time/step_trainer_s",
    "saving": "time/step_checkpoint_s",
    "swapping": "time/step_swap_s",
}


class ModelActivity:
    """One model's phase, inference rates and step bookkeeping."""

    def __init__(self, gate: DeviceGate, history: list[dict]):
        self.gate = gate
        self.phase: Phase = "idle"
        self.detail = ""
        self.since = time.time()
        self.done = self.total = 0
        self.in_flight = 0
        self._finished: deque[tuple[float, int]] = deque()  # (when, sampled tokens) of each completion, last WINDOW s
        self._started = time.monotonic()
        self.sampled_since_step = 0  # tokens sampled since the last step committed (or the model was registered)
        self.step_ended = time.monotonic()
        trained = [entry for entry in history if any(key.startswith("train/") for key in entry)]
        self.last_step: dict[str, float] = _numbers(trained[-1]) if trained else {}
        self.cost_total: float | None = next(
            (
                entry["costs/cum/gpu"]
                for entry in reversed(history)
                if isinstance(entry.get("costs/cum/gpu"), int | float)
            ),
            None,
        )

    # -- inference -------------------------------------------------------------------------------------------------

    def completion_started(self) -> None:
        self.in_flight += 1

    def completion_finished(self, tokens: int) -> None:
        self.in_flight -= 1
        self._finished.append((time.monotonic(), tokens))
        self.sampled_since_step += tokens

    def serving(self, adapter: str) -> Serving:
        now = time.monotonic()
        while self._finished and self._finished[0][0] < now - WINDOW:
            self._finished.popleft()
        span = max(min(WINDOW, now - self._started), 1e-3)
        return Serving(
            adapter=adapter,
            in_flight=self.in_flight,
            completions_per_s=len(self._finished) / span,
            tokens_per_s=sum(tokens for _, tokens in self._finished) / span,
        )

    # -- phases ----------------------------------------------------------------------------------------------------

    def set(self, phase: Phase, detail: str = "", done: int = 0, total: int = 0) -> None:
        self.phase, self.detail, self.done, self.total, self.since = phase, detail, done, total, time.time()

    def trained(self, done: int, total: int) -> None:
        """The trainer finished micro-batch `done` of `total`."""
        self.done, self.total, self.detail = done, total, f"micro-batch {done} of {total} done"

    def activity(self) -> Activity:
        phase, detail = self.phase, self.detail
        if phase == "idle" and self.in_flight:
            phase, detail = "serving", f"{self.in_flight} completion(s) in flight"
        elif phase == "waiting":
            detail = (
                f"for {self.gate.in_flight} completion(s) in flight to finish (the engine)"
                if self.gate.in_flight
                else "for another step to finish"
            )
        return Activity(phase=phase, detail=detail, since=self.since, done=self.done, total=self.total)


class StepTimer:
    """One training step's phases: each sets the model's activity and adds its seconds to the step's time split
    (a phase may come twice: swapping is the engine's pause before training and its resume after).
    `arrived`: when the request reached the server (monotonic), before its body was read."""

    def __init__(self, activity: ModelActivity, arrived: float):
        self.activity, self.arrived = activity, arrived
        self.seconds: dict[str, float] = {"time/step_upload_s": time.monotonic() - arrived}
        self.gap = arrived - activity.step_ended  # since the previous step: the rollouts, as the server saw them
        self.sampled = activity.sampled_since_step
        self.paused_at: float | None = None  # when the step closed the device gate to new completions
        self._current: tuple[str, float] | None = None

    def inference_paused(self) -> None:
        """From now on new completions wait for this step (until its adapter swap ends)."""
        self.paused_at = time.monotonic()

    def begin(self, phase: Phase, detail: str = "") -> None:
        """Enter `phase` (ending the one before)."""
        self.end()
        self.activity.set(phase, detail)
        self._current = (PHASE_METRICS[phase], time.monotonic())

    def end(self) -> None:
        """Leave the current phase: the model is idle (or serving) again."""
        if self._current is not None:
            key, began = self._current
            self.seconds[key] = self.seconds.get(key, 0.0) + time.monotonic() - began
            self._current = None
            self.activity.set("idle")


def reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def step_metrics(
    timer: StepTimer, metrics: dict[str, float], gather_s: float | None, hourly_cost: float | None
) -> tuple[dict[str, float], dict[str, float]]:
    """The step's timing, throughput, peak memory and cost, added to the trainer's `metrics`; and the run's totals.
    Called when the step has committed.

    Wall time = gather (the client's: since its previous step returned; else the server's gap since the previous
    commit) + the request's time on the server (upload, prepare, wait, train, checkpoint, swap). The cost is the
    machine's price over that wall time; ART's key, `costs/gpu`. `time/step_inference_paused_s` overlaps the
    phases: how long new completions waited for this step (its swap, or the whole step on an engine that pauses)."""
    activity = timer.activity
    on_server = time.monotonic() - timer.arrived
    gather = gather_s if gather_s is not None else max(timer.gap, 0.0)
    out = dict(metrics) | timer.seconds | {"time/step_actor_s": gather, "time/step_wall_s": gather + on_server}
    if timer.paused_at is not None:  # the whole step on a pausing engine; the swap alone on one serving meanwhile
        out["time/step_inference_paused_s"] = time.monotonic() - timer.paused_at
    trainer_s = timer.seconds.get("time/step_trainer_s", 0.0)
    if metrics.get("trained_tokens") and trainer_s > 0:
        out["throughput/train_tok_per_s"] = metrics["trained_tokens"] / trainer_s
    out["data/step_actor_tokens"] = float(timer.sampled)
    if timer.gap > 0:
        out["throughput/inference_tok_per_s"] = timer.sampled / timer.gap
    if torch.cuda.is_available():
        out["peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    totals: dict[str, float] = {}
    if hourly_cost is not None:
        out["costs/gpu"] = hourly_cost * out["time/step_wall_s"] / 3600
        activity.cost_total = (activity.cost_total or 0.0) + out["costs/gpu"]
    if activity.cost_total is not None:
        totals["costs/cum/gpu"] = activity.cost_total
    activity.sampled_since_step -= timer.sampled
    activity.step_ended = time.monotonic()
    return out, totals


def _numbers(entry: dict) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in entry.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }
