"""The formatter, the linter and the type checker, as CI runs them: each over the whole tree from the repo root, with
the settings in pyproject.toml ([tool.ruff], [tool.mypy]) and the test venv's own tools (the `dev` extra). A
failure shows the tool's own report: what to fix, file and line. docs/development.md says how to run them by hand.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*tool: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *tool], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )


def _report(result: subprocess.CompletedProcess[str]) -> str:
    return f"`{' '.join(result.args[2:])}` exited {result.returncode}:\n{result.stdout}{result.stderr}"


def test_the_tree_is_formatted_as_ruff_format_writes_it():
    result = _run("ruff", "format", "--check", ".", timeout=120)
    assert result.returncode == 0, _report(result) + "\n(`ruff format .` rewrites the files it names)"


def test_ruff_check_finds_nothing():
    result = _run("ruff", "check", ".", timeout=120)
    assert result.returncode == 0, _report(result)


@pytest.mark.slow
def test_mypy_finds_no_type_error():
    result = _run("mypy", timeout=600)
    assert result.returncode == 0, _report(result)
    assert "Success: no issues found" in result.stdout, _report(result)  # and it checked something
