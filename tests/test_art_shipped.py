"""openpipe-art's own shipped backend tests (in its wheel: `art/test/`), run unchanged against art-sky on the newest
tested ART, with only the backend swapped (tests/art_programs/shipped_runner.py). Their base model is a Hugging Face
hub id; this machine has no Hub, so a stand-in of that id (the tiny model, built from code) sits in a Hugging Face
cache of the test's own that the server reads offline."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_openpipe_art import PROGRAMS, art_latest  # noqa: F401 (fixture)

from art_sky.cluster.tiny_model import tiny_model_path

SNAPSHOT = "0" * 40


def hub_stand_in(home: Path, repo_id: str, tmp: Path) -> Path:
    """A Hugging Face cache under `home` holding the tiny model as `repo_id` (as `hf download` leaves it)."""
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(tiny_model_path(tmp), repo / "snapshots" / SNAPSHOT)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SNAPSHOT)
    return home


def run_shipped(python: Path, name: str, tmp: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    shipped = subprocess.run(
        [str(python), "-c", "import art, pathlib; print(pathlib.Path(art.__file__).parent / 'test')"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return subprocess.run(
        [str(python), str(PROGRAMS / "shipped_runner.py"), f"{shipped}/{name}", sys.executable, json.dumps(env)],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow
def test_art_step_skipping_test_passes_unchanged(art_latest, tmp_path):
    """ART's test_step_skipping: register with `_openai_client_config`, a step with 3 of 5 groups trainable, one with
    none (the step advances; ART's layout: 0001 becomes 0002), one more; checkpoints 0000 0002 0003."""
    home = hub_stand_in(tmp_path / "hf", "Qwen/Qwen2.5-0.5B-Instruct", tmp_path)
    done = run_shipped(art_latest, "test_step_skipping.py", tmp_path, {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    assert "All tests passed!" in done.stdout and "Filesystem verification passed!" in done.stdout
