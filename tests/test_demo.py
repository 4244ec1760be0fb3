"""`art-sky demo`, as the README's first command runs it: the mean reward rises clearly on a fixed seed."""

import os
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
