"""What `art-sky status` shows of each model, as it happens: its step and the adapter served, what the server is doing
with it (serving, or a step's phase and progress), the newest step's reward, inference and training tokens/s, its
checkpoints in the object store and what its steps cost so far. Rendered from the server's `ModelInfo`."""

from __future__ import annotations

import time

from art_sky.wire import ModelInfo

HEADERS = ("MODEL", "STEP", "SERVING", "NOW", "REWARD", "TOK/S INFER, TRAIN", "CHECKPOINTS", "COST SO FAR")
SHRINK = (6, 7, 5, 2, 4, 3)  # a narrow terminal cuts checkpoints, cost, tok/s, serving, reward, now; never model, step


def row(cluster: str, model: ModelInfo, now: float | None = None) -> list[str]:
    """One model's line: every cell a short phrase, "-" where the server does not know."""
    last = model.last_step
    serving = model.serving
    return [
        f"{cluster}/{model.served or model.name}",  # each run of a name on its own line
        str(model.step),
        f"{serving.adapter} ({serving.in_flight} in flight)" if serving else "-",
        doing(model, now or time.time()),
        _number(last.get("train/reward"), "{:.3f}"),
        f"{_number(serving.tokens_per_s if serving else None, '{:.0f}')}, "
        f"{_number(last.get('throughput/train_tok_per_s'), '{:.0f}')}",
        checkpoints(model),
        _number(last.get("costs/cum/gpu"), "${:.2f}"),
    ]


def doing(model: ModelInfo, now: float) -> str:
    """ "training 40% (micro-batch 4 of 10 done, 12s)", "serving (3 completion(s) in flight)", "idle"."""
    activity = model.activity
    if activity is None:
        return "-"
    took = f"{max(now - activity.since, 0):.0f}s"
    if activity.phase == "idle":
        return "idle"
    if activity.phase == "training" and activity.total:
        return f"training {100 * activity.done // activity.total}% ({activity.detail}, {took})"
    return f"{activity.phase} ({activity.detail}, {took})" if activity.detail else f"{activity.phase} ({took})"


def checkpoints(model: ModelInfo) -> str:
    sync = model.sync
    if sync is None or sync.state == "off":
        return "on the cluster only"
    stored = f"step {sync.step} in store" if sync.step is not None else "none in store yet"
    if sync.state == "uploading":
        return f"{stored}, uploading {sync.detail}"
    if sync.state == "failed":
        return f"{stored}, FAILED: {sync.detail}"
    return stored


def _number(value: float | None, form: str) -> str:
    return "-" if value is None else form.format(value)
