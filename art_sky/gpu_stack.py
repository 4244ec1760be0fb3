"""The tested GPU stack: templates/gpu-constraints.txt, shared by the bootstrap (installs it) and the cluster server
(refuses to run vLLM or Unsloth at other versions of the packages named here).

Only these packages are checked: the engines and trainers themselves and what they patch or compile against. The
rest of the file still pins what a fresh install gets, so that two clusters started a month apart run one set.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

LOCK_NAME = "gpu-constraints.txt"
# What must match the tested set when each component runs (distribution names, as in the constraints file).
CHECKED = {
    "vllm": ("vllm", "torch", "transformers"),
    "unsloth": ("unsloth", "unsloth-zoo", "torch", "transformers", "trl", "peft"),
}


def lock_path() -> Path:
    """Where the constraints file lies in this installation (a path pip's and uv's `-c` accept)."""
    return Path(str(resources.files("art_sky.templates") / LOCK_NAME))


def constraint_lines() -> list[str]:
    """The requirement lines of the constraints file, comments left out."""
    lines = lock_path().read_text().splitlines()
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def tested_versions(python: str | None = None) -> dict[str, str]:
    """{distribution: version} the constraints file pins for this Python ("3.12"; default: the running one)."""
    from packaging.requirements import Requirement

    python = python or f"{sys.version_info.major}.{sys.version_info.minor}"
    pins = {}
    for line in constraint_lines():
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"python_version": python}):
            (spec,) = requirement.specifier
            pins[canonical(requirement.name)] = spec.version
    return pins


def canonical(name: str) -> str:
    """PEP 503 name: unsloth_zoo and Unsloth-Zoo are unsloth-zoo."""
    return name.lower().replace("_", "-").replace(".", "-")
