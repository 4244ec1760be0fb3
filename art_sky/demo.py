"""`art-sky demo`: the whole loop on this machine's CPU with the embedded tiny model, in about a minute.

The task: answer with digits. A randomly initialised model writes mostly noise bytes; each reply earns the share
of its characters that are digits, and GRPO turns that into a model that answers in numbers. The mean reward per
step is printed, and the run's reward, loss and KL are drawn to a PNG (art_sky/charts.py, as `art-sky plot`).

Each step prints `step i/N`, its mean reward, the groups skipped, its time and one reply; the first skipped group
and the first unprintable byte get a line that says what they are. Replies are shown as printable ASCII only: the
random tiny model writes bytes, often partial UTF-8 (which the server can only decode to U+FFFD) and terminal
control characters, which would garble the terminal.

Each run trains a fresh model (the previous run's checkpoints of the demo model are removed, and said so), so the
climb from ~0.06 shows every time; `resume=True` continues the previous run's model and says from which step. The
demo keeps its checkpoints on this machine only: a configured object store (ART_SKY_CHECKPOINT_URI) is not used.
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

import art_sky as art
from art_sky import charts
from art_sky.client.model import TrainableModel
from art_sky.errors import ConflictError
from art_sky.layout import LINEAGE_LOCK, OWNER_FILE, model_key
from art_sky.ownership import held_by_another, read_owner

PROMPTS = [
    "How many legs does a spider have?",
    "What year is it?",
    "Give me a number.",
    "Count to five.",
    "What is 12 times 12?",
    "How old is the universe?",
    "Pick a lottery number.",
    "What is your PIN?",
]


def digit_share(text: str | None) -> float:
    """The reward: the fraction of the reply's characters that are digits (0 for an empty reply)."""
    text = (text or "").strip()
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


async def rollout(model: TrainableModel, prompt: str, seed: int) -> art.Trajectory:
    messages = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": prompt}]
    completion = await model.openai_client().chat.completions.create(
        model=model.inference_model_name, messages=messages, max_tokens=8, temperature=1.0, seed=seed
    )
    choice = completion.choices[0]
    return art.Trajectory(
        messages_and_choices=[*messages, choice],
        reward=digit_share(choice.message.content),
        metrics={"length": len(choice.message.content or "")},
    )


async def run_demo(
    *,
    steps: int = 15,
    groups: int = 8,
    group_size: int = 8,
    learning_rate: float = 5e-3,
    seed: int = 0,
    path: Path = Path(".art"),
    plot: Path | None = Path("demo-reward.png"),
    resume: bool = False,
    echo=print,
) -> list[float]:
    """Train for `steps` steps and return the mean reward of each step's rollouts (before that step's update)."""
    rng = random.Random(seed)
    model = art.TrainableModel(name=f"digits-{seed}", project="art-sky-demo", base_model="art-sky/tiny")
    files = Path(path) / model_key(model.project, model.name)
    if held_by_another(files / LINEAGE_LOCK):  # before anything there is removed: the lock the server takes
        raise ConflictError(
            f"another art-sky demo is running in this folder, training {model.name} in {files}: "
            f"{read_owner(files / OWNER_FILE)}. Wait for it to finish (or stop it: kill its pid), or run this "
            "demo in another folder"
        )
    if files.exists() and not resume:
        shutil.rmtree(files)
        echo(
            f"starting a fresh model: removed the previous demo run's {model.name} in {files} "
            "(`art-sky demo --resume` continues it instead)"
        )
    backend = art.LocalBackend(path=path, env={"ART_SKY_CHECKPOINT_URI": ""})  # the demo's files stay here
    rewards: list[float] = []
    history: list[dict] = []
    try:
        echo("starting the local cluster server (builds the tiny model on first use)...")
        await model.register(backend)
        start = await model.get_step()
        device = (await backend.health()).device
        if start:
            echo(f"resuming model {model.name} from step {start} (its checkpoints in {files}) on {device}")
        else:
            echo(f"model {model.name} on {device}, step 0")
        report = StepReport(total=start + steps, groups=groups, group_size=group_size)
        for step in range(start, start + steps):
            began = time.monotonic()
            batch = await art.gather_trajectory_groups(
                (
                    art.TrajectoryGroup(
                        rollout(model, rng.choice(PROMPTS), rng.randrange(2**31)) for _ in range(group_size)
                    )
                    for _ in range(groups)
                ),
                pbar_desc=None,
            )
            mean = sum(t.reward for g in batch for t in g) / sum(len(g) for g in batch)
            rewards.append(mean)
            metrics = await model.train(batch, config=art.TrainConfig(learning_rate=learning_rate))
            sample = batch[0].trajectories[0].messages_and_choices[-1].message.content
            for line in report.lines(
                step + 1, mean, int(metrics["num_groups_skipped"]), time.monotonic() - began, sample
            ):
                echo(line)
        history = await backend.history(model.name)
    finally:
        await backend.close()
    if plot is not None and history:
        charts.draw(history, plot, f"art-sky demo: {model.name} learns to answer with digits")
        curves = charts.panels(history)
        echo(f"{' and '.join([', '.join(curves[:-1]), curves[-1]] if len(curves) > 1 else curves)} per step: {plot}")
    return rewards


UNPRINTABLE = "·"  # shown for each character of a reply that is not printable ASCII


def shown(text: str | None, limit: int = 32) -> str:
    """A reply as a terminal can show it whatever it holds: printable ASCII kept, anything else one `·`."""
    return "".join(c if " " <= c <= "~" else UNPRINTABLE for c in (text or "")[:limit])


class StepReport:
    """The demo's line per step, and the one-time lines that explain what a reader could not guess."""

    def __init__(self, total: int, groups: int, group_size: int):
        self.total, self.groups, self.group_size = total, groups, group_size
        self.explained: set[str] = set()

    def lines(self, step: int, mean: float, skipped: int, seconds: float, sample: str | None) -> list[str]:
        reply = shown(sample)
        lines = [
            f"step {step:>{len(str(self.total))}}/{self.total}  reward {mean:.3f} {_bar(mean)}  "
            f'skipped {skipped}/{self.groups}  {seconds:.1f}s  e.g. "{reply}"'
        ]
        if skipped and "skipped" not in self.explained:
            self.explained.add("skipped")
            lines.append(
                f"  (skipped: a group whose {self.group_size} replies all earned the same reward; with no better or "
                "worse reply in it, GRPO has nothing to learn from it, so it is left out of the step)"
            )
        if UNPRINTABLE in reply and "bytes" not in self.explained:
            self.explained.add("bytes")
            lines.append(
                f"  ({UNPRINTABLE}: a byte that is no printable text; the untrained tiny model writes random bytes)"
            )
        return lines


def _bar(value: float, width: int = 20) -> str:
    filled = round(max(0.0, min(1.0, value)) * width)
    return "#" * filled + "." * (width - filled)
