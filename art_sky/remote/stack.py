"""Which stack a machine gets: a look at its GPU (`nvidia-smi`: the GPUs, the driver, the newest CUDA the driver
runs) decides between the tested GPU stack (vLLM, Unsloth, CUDA torch: templates/gpu-constraints.txt) and the CPU
stack (art-sky[cluster] with the CPU build of torch, the portable engine), unless the user named an extra.

Why look: PyPI's torch for Linux is the CUDA build (about 6 GB installed), of no use on a box without a GPU, and a
driver older than the CUDA the GPU stack is built for fails only once the server starts the engine, minutes in.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from art_sky.errors import ConfigError
from art_sky.gpu_stack import tested_versions

from .runner import CommandRunner

CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"  # PyTorch's index of CPU-only wheels (torch==X+cpu)
# The oldest Linux driver each CUDA release runs on (NVIDIA's CUDA release notes, table 3): the refusal names it.
MIN_DRIVER = {"13.0": "580.65", "12.9": "575.51", "12.8": "570.26", "12.6": "560.28", "12.4": "550.54"}

_PROBE = r"""command -v nvidia-smi >/dev/null 2>&1 || { echo none; exit 0; }
gpus=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1) || { echo failed; echo "$gpus"; exit 0; }
echo gpus
echo "$gpus"
echo cuda
nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9.]*\).*/\1/p' | head -n 1
"""

Extras = Literal["auto", "cluster", "gpu"]


class Gpus(BaseModel):
    """What `nvidia-smi` says about a machine: its GPUs' names, the driver, the newest CUDA that driver runs."""

    names: list[str] = []
    driver: str | None = None
    cuda: str | None = None
    problem: str | None = None  # why there is no usable GPU: no nvidia-smi, or its error


class Stack(BaseModel):
    """What the venv gets: an extra, pip constraints, extra indexes, and why (the phase line says it)."""

    extras: Literal["cluster", "gpu"]
    constraints: list[str] = []
    index_urls: list[str] = []
    reason: str
    cpu: bool = False  # the CPU build of torch

    @property
    def label(self) -> str:
        return f"art-sky[{self.extras}]" + (" with the CPU build of torch" if self.cpu else "")


def probe(runner: CommandRunner) -> Gpus:
    """Ask the machine's `nvidia-smi` (none on PATH: no GPU)."""
    lines = runner.run(_PROBE, timeout=60).stdout.splitlines()
    if not lines or lines[0] == "none":
        return Gpus(problem="no nvidia-smi on its PATH")
    if lines[0] == "failed":
        return Gpus(problem=f"nvidia-smi failed: {(lines[1:] or ['(no output)'])[0].strip()}")
    gpus = lines[1 : lines.index("cuda")] if "cuda" in lines else lines[1:]
    cuda = lines[lines.index("cuda") + 1 :] if "cuda" in lines else []
    rows = [[part.strip() for part in row.split(",")] for row in gpus if row.strip()]
    if not rows:
        return Gpus(problem="nvidia-smi lists no GPU")
    return Gpus(names=[row[0] for row in rows], driver=rows[0][-1], cuda=cuda[0] if cuda and cuda[0] else None)


def choose(
    gpus: Gpus, asked: Extras, *, where: str, python: str, cpu_index: str | None, constraints: list[str]
) -> Stack:
    """The stack for a machine with `gpus`: `asked` unless "auto"; a driver too old for the GPU stack's CUDA is
    refused (ConfigError) when that stack would be installed. `python` ("3.12") picks the pinned torch."""
    pins = tested_versions(python)
    needs = ".".join(pins["cuda-toolkit"].split(".")[:2])  # the CUDA the GPU stack's torch is built for
    if gpus.names and (asked == "gpu" or asked == "auto"):
        _check_driver(gpus, needs, where, pins["torch"])
    found = f"{len(gpus.names)} x {gpus.names[0]}, driver {gpus.driver}" if gpus.names else gpus.problem
    if asked == "gpu":
        return Stack(extras="gpu", reason=f"--extras gpu as asked ({found})")
    if asked == "cluster":
        return Stack(extras="cluster", reason=f"--extras cluster as asked ({found})")
    if gpus.names:
        return Stack(extras="gpu", reason=f"{found}, CUDA {gpus.cuda or 'unknown'}: the tested GPU stack")
    torch = [] if any(_names(line, "torch") for line in constraints) else [f"torch=={pins['torch']}"]
    return Stack(
        extras="cluster",
        constraints=torch,
        index_urls=[cpu_index] if cpu_index else [],
        cpu=True,
        reason=f"no GPU ({found}): the CPU stack, the portable engine",
    )


def _check_driver(gpus: Gpus, needs: str, where: str, torch: str) -> None:
    minimum = MIN_DRIVER.get(needs)
    too_old = (
        _version(gpus.cuda) < _version(needs)
        if gpus.cuda
        else bool(minimum and gpus.driver and _version(gpus.driver) < _version(minimum))
    )
    if too_old:
        runs = f" (CUDA {gpus.cuda} at most)" if gpus.cuda else ""
        raise ConfigError(
            f"the NVIDIA driver on {where} is {gpus.driver}{runs}; art-sky's GPU stack (torch {torch}) is built for "
            f"CUDA {needs}, which needs driver {minimum or 'a newer one'} or newer: update the driver (your "
            "distribution's NVIDIA packages, or an image that has it), or install the CPU stack with --extras cluster"
        )


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".") if part.isdigit())


def _names(line: str, name: str) -> bool:
    """Does a requirement line constrain `name`?"""
    head = line.strip().split(";")[0]
    for sep in "=<>!~[ ":
        head = head.split(sep)[0]
    return head.lower() == name
