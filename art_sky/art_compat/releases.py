"""The ART releases art-sky supports, and the check an ART model gets when it registers.

Two release lines, the two ends of the range tested in CI: 0.5.18, the last release for Python 3.11, and the
0.5.20 line (Python >= 3.12), whose newest tested release is 0.5.23. The `[art]` extra installs the newest release
of the range the interpreter can run and never replaces one already installed within it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import sys
import types
from typing import Any

from art_sky.errors import ConfigError

log = logging.getLogger("art_sky")

OLDEST, NEWEST = "0.5.18", "0.5.23"

# What each release line brought that art-sky takes (the docs' per-line tables follow this).
LINES = {
    "0.5.18": "the Backend protocol (register, _prepare_backend_for_training, _get_step, train, _train_sft, "
    "_delete_checkpoint_files), backend.train's keywords, _internal_config.peft_args",
    "0.5.20": "run_name lineages, lora_config, exact_adapter_lease and adapter_lease, PipelineTrainer, "
    "backend.train's kl_penalty_source, optimizer_save_interval, final_training_step and "
    "grad_accumulation_sequences, TrainSFTConfig.assistant_turns and metric_logging, capture-style "
    "trajectories (art.trajectory), the client's extra_body (return_token_ids, "
    "return_tokens_as_token_ids, chat_template_kwargs with preserve_thinking)",
    "0.5.21": "nvext in the client's extra_body",
}


def installed() -> str | None:
    """The installed openpipe-art's version, or None."""
    try:
        return importlib.metadata.version("openpipe-art")
    except importlib.metadata.PackageNotFoundError:
        return None


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(part) if part.isdigit() else 0 for part in version.split(".")[:3])


def in_range(version: str) -> bool:
    return _key(OLDEST) <= _key(version) <= _key(NEWEST)


def is_art_object(obj: Any) -> bool:
    """An object of openpipe-art's own (an `art.TrainableModel`, `art.Trajectory`), not art-sky's."""
    return type(obj).__module__.split(".")[0] == "art"


def check(backend: Any, model: Any) -> None:
    """At `register()`: an ART release outside the supported range is named with the range, a warning while the
    protocol still matches; a release whose Backend protocol asks for a method art-sky lacks is refused."""
    if not is_art_object(model):
        return
    version = installed() or "unknown"
    missing = sorted(name for name in _protocol_methods() if not hasattr(backend, name))
    if missing:
        raise ConfigError(
            f"openpipe-art {version}'s Backend protocol asks for {', '.join(missing)}, which art-sky "
            f"does not implement: art-sky supports ART {OLDEST} to {NEWEST} (pip install "
            f'"openpipe-art>={OLDEST},<={NEWEST}"), or upgrade art-sky'
        )
    _stand_in_for_arts_local_backend()
    if version == "unknown" or not in_range(version):
        log.warning(
            "openpipe-art %s is outside the range art-sky is tested with (%s to %s): its Backend protocol "
            "matches, so it runs, but pin openpipe-art>=%s,<=%s for a tested combination",
            version,
            OLDEST,
            NEWEST,
            OLDEST,
            NEWEST,
        )


def _protocol_methods() -> set[str]:
    """The members of the installed ART's Backend protocol (`art.backend.Backend`)."""
    try:
        from art.backend import Backend
    except ImportError:
        return set()
    return {
        name
        for name, value in vars(Backend).items()
        if not name.startswith("__") and (callable(value) or isinstance(value, property))
    }


def _stand_in_for_arts_local_backend() -> None:
    """ART's PipelineTrainer imports ART's own LocalBackend (`art.local.backend`, which imports torch and ART's GPU
    stack) only to check whether it runs on one. On a laptop without torch (art-sky's client needs none) that import
    fails; this puts a stand-in under the name, a LocalBackend no backend is an instance of, so the check answers
    "no" as it would with torch installed. Where torch is installed, ART's own module is left to load."""
    if "art.local.backend" in sys.modules or importlib.util.find_spec("torch") is not None:
        return
    module = types.ModuleType("art.local.backend", "art-sky's stand-in for ART's LocalBackend (no torch here)")

    class LocalBackend:
        """ART's own LocalBackend, which needs torch and ART's GPU stack (pip install "openpipe-art[backend]")."""

        def __init__(self, *args: Any, **kwargs: Any):
            raise ConfigError(
                "ART's own LocalBackend needs torch and ART's GPU stack (pip install "
                '"openpipe-art[backend]"); art-sky\'s backends (art_sky.LocalBackend, SSHBackend, '
                "SkyPilotBackend) need neither on this machine"
            )

    module.LocalBackend = LocalBackend  # type: ignore[attr-defined]  # a module made here: nothing declares it
    sys.modules["art.local.backend"] = module
