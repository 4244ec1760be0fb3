"""SkyPilot's own environment: a venv art-sky makes (once) and drives, so SkyPilot's pins stay out of the user's.

SkyPilot 0.14.1 requires click < 8.2, wandb and huggingface-hub click >= 8.2: in one environment they are a broken
install (`pip check`). So art-sky never imports SkyPilot: it runs sky_driver.py and SkyPilot's CLI with the
interpreter of this venv (ART_SKY_SKYPILOT_PYTHON names another one that has SkyPilot), which talk to SkyPilot's API
server as SkyPilot's own client does. `python -m art_sky.provisioners.sky_env` makes it ahead of time.
"""

from __future__ import annotations

import fcntl
import functools
import shlex
import subprocess
import sys
from pathlib import Path

from art_sky.errors import ConfigError
from art_sky.remote.progress import PipOutput, Progress
from art_sky.remote.reasons import reason
from art_sky.remote.runner import LocalRunner
from art_sky.settings import Settings

_TIMEOUT = 1800.0  # seconds for each step of making the environment (SkyPilot's install measured 382 s)

SKYPILOT = "skypilot[slurm]==0.14.1"  # the release art-sky is tested with (its Slurm infra runs the tests)
INSTALLED = "installed.txt"  # what the venv holds: a change of SKYPILOT makes a new one


def sky_python(settings: Settings | None = None, progress: Progress | None = None) -> Path:
    """The interpreter that runs SkyPilot: ART_SKY_SKYPILOT_PYTHON, or the venv under the cache dir (made now if
    missing: a few minutes, once, each phase shown on `progress`: default stderr)."""
    settings = settings or Settings()
    if settings.skypilot_python is not None:
        return _has_skypilot(settings.skypilot_python)
    venv = settings.cache_dir / "skypilot"
    python = venv / "bin" / "python"
    marker = venv / INSTALLED
    if marker.is_file() and marker.read_text().strip() == SKYPILOT:
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / "skypilot.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one install at a time; the others then find it made
        if not (marker.is_file() and marker.read_text().strip() == SKYPILOT):
            _install(venv, progress or Progress())
            marker.write_text(SKYPILOT + "\n")
    return python


@functools.cache
def _has_skypilot(python: Path) -> Path:
    """ART_SKY_SKYPILOT_PYTHON as given, once it is seen to run and import SkyPilot; else a ConfigError with the
    fix (a mistyped path is the user's to correct, not a bug)."""
    fix = f"point ART_SKY_SKYPILOT_PYTHON at a Python that has {SKYPILOT}, or unset it for art-sky's own"
    try:
        result = subprocess.run([str(python), "-c", "import sky"], capture_output=True, text=True, timeout=120)
    except OSError as exc:  # no such file, not executable, not a program
        raise ConfigError(f"ART_SKY_SKYPILOT_PYTHON={python} cannot run ({exc.strerror}): {fix}") from exc
    except subprocess.TimeoutExpired as exc:
        raise ConfigError(f"ART_SKY_SKYPILOT_PYTHON={python} did not import SkyPilot within 120s: {fix}") from exc
    if result.returncode != 0:
        why = reason(result.stderr) or f"exit code {result.returncode}"
        raise ConfigError(f"ART_SKY_SKYPILOT_PYTHON={python} cannot import SkyPilot ({why}): {fix}")
    return python


def sky_cli(settings: Settings | None = None) -> str:
    """How to run SkyPilot's CLI (`sky`) from a shell, for the messages that say what to run."""
    return str(sky_python(settings).parent / "sky")


def _install(venv: Path, progress: Progress) -> None:
    """Make the venv and install SkyPilot into it, each a phase (pip's largest downloads said after)."""
    progress.note(f"SkyPilot's own environment {venv} is made once (a few minutes): {SKYPILOT}")
    pip = PipOutput()
    for title, command in (
        (f"creating the venv {venv}", [sys.executable, "-m", "venv", "--clear", str(venv)]),
        (
            f"installing {SKYPILOT}",
            [str(venv / "bin" / "python"), "-m", "pip", "install", "--progress-bar", "off", SKYPILOT],
        ),
    ):
        with progress.phase(title) as phase:
            result = LocalRunner().run(
                shlex.join(command), timeout=_TIMEOUT, check=False, output=phase.output(pip.line)
            )
        if result.exit_code != 0:
            raise ConfigError(
                f"making SkyPilot's environment {venv} failed (`{' '.join(command)}` exited "
                f"{result.exit_code}: {reason(result.stderr) or 'no error'}). Fix that (network, disk, "
                f"Python's venv module), or point ART_SKY_SKYPILOT_PYTHON at a Python that has {SKYPILOT}\n"
                f"{result.stderr.strip()[-1500:]}"
            )
    if summary := pip.summary():
        progress.note(summary)


if __name__ == "__main__":
    print(sky_python())
