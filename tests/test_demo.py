"""`art-sky demo`, as the README's first command runs it: the mean reward rises clearly on a fixed seed."""

import json
import os
import re
import subprocess
import sys

import pytest
from wandb_runs import wandb_history


@pytest.mark.slow
def test_demo_reward_rises(tmp_path):
    """With a W&B key (here in W&B's offline mode), the demo's model also logs each step to its W&B run."""
    # Measured on 2 CPU cores, seed 0: first step 0.06, last three steps 0.99. A rise of 0.5 leaves room for
    # numeric differences between machines while still failing if GRPO stops learning.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "art_sky.cli",
            "demo",
            "--path",
            str(tmp_path / ".art"),
            "--plot",
            str(tmp_path / "reward.png"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env=os.environ | {"WANDB_MODE": "offline", "WANDB_API_KEY": "x" * 40, "WANDB_DIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rewards = [
        float(line.split("reward")[1].split()[0]) for line in result.stdout.splitlines() if line.startswith("step")
    ]
    assert len(rewards) == 15
    assert sum(rewards[-3:]) / 3 >= rewards[0] + 0.5, rewards
    assert (tmp_path / "reward.png").stat().st_size > 10_000
    run_dir = next((tmp_path / "wandb").glob("offline-run-*"))
    rows = [row for row in wandb_history(run_dir) if "train/reward" in row]
    assert [row["training_step"] for row in rows] == list(range(1, 16))
    assert [round(row["train/reward"], 3) for row in rows] == pytest.approx(rewards, abs=1e-3)


async def test_the_demo_says_step_i_of_n_its_time_and_shows_replies_safely(tmp_path):
    """A short run in this process: `step i/N` with its time, a reply shown as printable ASCII whatever bytes the
    random tiny model wrote (no U+FFFD from partial UTF-8, no control character), the unprintable byte explained
    once, and a plot with a panel for each curve the run has (no KL without beta: no empty KL panel)."""
    from art_sky import charts
    from art_sky.demo import run_demo

    lines: list[str] = []
    await run_demo(steps=3, groups=2, group_size=4, path=tmp_path / ".art", plot=tmp_path / "p.png", echo=lines.append)
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["1/3", "2/3", "3/3"], lines
    for line in steps:
        assert re.fullmatch(r'step \d/3  reward \d\.\d{3} [#.]{20}  skipped \d/2  \d+\.\ds  e\.g\. "[ -~·]*"', line), (
            line
        )
    assert all(line.isprintable() and "\ufffd" not in line for line in lines), lines
    explained = [line for line in lines if line.startswith("  (·")]
    assert len(explained) <= 1 and (explained or not any("·" in line for line in steps)), lines
    history = [
        json.loads(line)
        for line in (tmp_path / ".art" / "art-sky-demo" / "models" / "digits-0" / "history.jsonl")
        .read_text()
        .splitlines()
    ]
    assert charts.panels(history) == ["reward", "loss"]
    assert (tmp_path / "p.png").stat().st_size > 5_000


def test_a_skipped_group_and_an_unprintable_byte_are_explained_once():
    from art_sky.demo import StepReport, shown

    assert shown("s\ufffdh\x0e9\x1b[2J좺") == "s·h·9·[2J·"
    report = StepReport(total=15, groups=8, group_size=8)
    assert report.lines(1, 0.5, 0, 1.25, "42") == [
        'step  1/15  reward 0.500 ##########..........  skipped 0/8  1.2s  e.g. "42"'
    ]
    assert report.lines(2, 0.5, 3, 2.0, "4\ufffd") == [
        'step  2/15  reward 0.500 ##########..........  skipped 3/8  2.0s  e.g. "4·"',
        "  (skipped: a group whose 8 replies all earned the same reward; with no better or worse reply in it, GRPO "
        "has nothing to learn from it, so it is left out of the step)",
        "  (·: a byte that is no printable text; the untrained tiny model writes random bytes)",
    ]
    assert report.lines(3, 1.0, 8, 2.0, "\x00") == [
        'step  3/15  reward 1.000 ####################  skipped 8/8  2.0s  e.g. "·"'
    ]


def test_the_chart_has_a_panel_for_each_curve_and_none_empty(tmp_path):
    from art_sky import charts

    history = [{"step": s, "train/reward": s / 4, "train/loss": 1 - s / 4} for s in (1, 2, 3)]
    assert charts.panels(history) == ["reward", "loss"]
    assert charts.panels([dict(e, **{"train/kl": 0.01}) for e in history]) == ["reward", "loss", "kl"]
    assert charts.draw(history, tmp_path / "c.png", "t").stat().st_size > 5_000
