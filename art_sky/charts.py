"""A run's curves from its history (history.jsonl, ART's flat keys): reward, loss and KL per training step, drawn to
a PNG. `art-sky plot` and `art-sky demo` draw with it. matplotlib is imported only when a chart is drawn, so the
laptop side runs without it."""

from __future__ import annotations

import math
from pathlib import Path

from art_sky.errors import ConfigError

KL_NOT_MEASURED = (
    "KL to the base model is measured when a step uses it\n(TrainConfig beta > 0, or ART's kl_penalty_coef > 0)"
)


def training_steps(history: list[dict]) -> list[dict]:
    """The history's training lines, one per step (a step trained twice, e.g. after a resume, keeps its last line),
    in step order."""
    steps: dict[int, dict] = {}
    for entry in history:
        if isinstance(entry.get("step"), int) and any(key.startswith("train/") for key in entry):
            steps[entry["step"]] = entry
    return [steps[step] for step in sorted(steps)]


def draw(history: list[dict], path: Path, title: str) -> Path:
    """Draw reward (with its within-group spread, and validation rewards where logged), loss and KL against the
    step to `path` (PNG). ConfigError when the history has no training step or matplotlib is missing."""
    rows = training_steps(history)
    if not rows:
        raise ConfigError(
            f"nothing to plot for {title}: its history has no training step yet (train first, or check "
            "the model's name and project)"
        )
    try:
        import matplotlib
    except ImportError as exc:
        raise ConfigError("plotting needs matplotlib: pip install matplotlib (it comes with art-sky[cluster])") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    def series(key: str, entries: list[dict] = rows) -> tuple[list[int], list[float]]:
        points = [
            (e["step"], float(e[key])) for e in entries if isinstance(e.get(key), int | float) and math.isfinite(e[key])
        ]
        return [s for s, _ in points], [v for _, v in points]

    fig, (reward_ax, loss_ax, kl_ax) = plt.subplots(3, 1, figsize=(7, 7.5), sharex=True)
    steps, reward = series("train/reward")
    reward_ax.plot(steps, reward, marker="o", markersize=3, label="train reward (mean)")
    spread_steps, spread = series("train/reward_std_dev")
    if spread_steps == steps:
        reward_ax.fill_between(
            steps,
            [r - s for r, s in zip(reward, spread, strict=False)],
            [r + s for r, s in zip(reward, spread, strict=False)],
            alpha=0.2,
            label="± within-group std",
        )
    val_steps, val = series("val/reward", [e for e in history if isinstance(e.get("step"), int)])
    if val_steps:
        reward_ax.plot(val_steps, val, marker="s", markersize=4, linestyle="--", label="val reward")
    reward_ax.set(ylabel="reward", title=title)
    reward_ax.legend(loc="best", fontsize=8)
    steps, loss = series("train/loss")
    loss_ax.plot(steps, loss, marker="o", markersize=3, color="tab:red")
    loss_ax.set(ylabel="loss")
    steps, kl = series("train/kl")
    if steps:
        kl_ax.plot(steps, kl, marker="o", markersize=3, color="tab:green")
    else:
        kl_ax.text(
            0.5, 0.5, KL_NOT_MEASURED, ha="center", va="center", transform=kl_ax.transAxes, fontsize=9, color="gray"
        )
    kl_ax.set(ylabel="KL (policy vs base)", xlabel="training step")
    kl_ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    for ax in (reward_ax, loss_ax, kl_ax):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
