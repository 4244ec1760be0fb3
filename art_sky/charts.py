"""A run's curves from its history (history.jsonl, ART's flat keys): reward, loss and KL per training step, drawn to
a PNG. `art-sky plot` and `art-sky demo` draw with it. matplotlib is imported only when a chart is drawn, so the
laptop side runs without it."""

from __future__ import annotations

import math
from pathlib import Path

from art_sky.errors import ConfigError

KL_NOT_MEASURED = (
    "KL to the base model is not shown: it is measured when a step uses it (TrainConfig beta > 0, or ART's "
    "kl_penalty_coef > 0)"
)


def training_steps(history: list[dict]) -> list[dict]:
    """The history's training lines, one per step (a step trained twice, e.g. after a resume, keeps its last line),
    in step order."""
    steps: dict[int, dict] = {}
    for entry in history:
        if isinstance(entry.get("step"), int) and any(key.startswith("train/") for key in entry):
            steps[entry["step"]] = entry
    return [steps[step] for step in sorted(steps)]


def _series(key: str, entries: list[dict]) -> tuple[list[int], list[float]]:
    points = [
        (e["step"], float(e[key])) for e in entries if isinstance(e.get(key), int | float) and math.isfinite(e[key])
    ]
    return [s for s, _ in points], [v for _, v in points]


def panels(history: list[dict]) -> list[str]:
    """The panels a chart of `history` has: one per curve it holds (reward, loss, KL), never an empty one."""
    rows = training_steps(history)
    return [key for key in ("reward", "loss", "kl") if _series(f"train/{key}", rows)[0]]


def draw(history: list[dict], path: Path, title: str) -> Path:
    """Draw reward (with its within-group spread, and validation rewards where logged), loss and KL against the
    step to `path` (PNG), a panel for each that the history holds (KL's absence said below the chart). ConfigError
    when the history has no training step or matplotlib is missing."""
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

    shown = panels(history) or ["reward"]
    fig, axes = plt.subplots(len(shown), 1, figsize=(7, 2.5 * len(shown) + 0.5), sharex=True, squeeze=False)
    ax = dict(zip(shown, axes[:, 0], strict=True))
    if "reward" in ax:
        steps, reward = _series("train/reward", rows)
        ax["reward"].plot(steps, reward, marker="o", markersize=3, label="train reward (mean)")
        spread_steps, spread = _series("train/reward_std_dev", rows)
        if spread_steps == steps:
            ax["reward"].fill_between(
                steps,
                [r - s for r, s in zip(reward, spread, strict=False)],
                [r + s for r, s in zip(reward, spread, strict=False)],
                alpha=0.2,
                label="± within-group std",
            )
        val_steps, val = _series("val/reward", [e for e in history if isinstance(e.get("step"), int)])
        if val_steps:
            ax["reward"].plot(val_steps, val, marker="s", markersize=4, linestyle="--", label="val reward")
        ax["reward"].set(ylabel="reward")
        ax["reward"].legend(loc="best", fontsize=8)
    if "loss" in ax:
        ax["loss"].plot(*_series("train/loss", rows), marker="o", markersize=3, color="tab:red")
        ax["loss"].set(ylabel="loss")
    if "kl" in ax:
        ax["kl"].plot(*_series("train/kl", rows), marker="o", markersize=3, color="tab:green")
        ax["kl"].set(ylabel="KL (policy vs base)")
    axes[0, 0].set(title=title)
    axes[-1, 0].set(xlabel="training step")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    for each in axes[:, 0]:
        each.grid(alpha=0.3)
    fig.tight_layout()
    if "kl" not in ax:
        fig.subplots_adjust(bottom=fig.subplotpars.bottom + 0.25 / fig.get_figheight())
        fig.text(0.5, 0.01, KL_NOT_MEASURED, ha="center", va="bottom", fontsize=8, color="gray")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
