"""Several runs under one model name: each run (ART's `run_name`, its own lineage) is registered, served and
addressed by its served name (`wire.served_name`: `name`, or `name:run`), so two runs of one name never answer for
each other. The bare name stays a way to reach a name's only run (a program that sends `model.name`, the CLI);
where a name has several runs it is refused, naming them, never answered by one of them.
"""

from __future__ import annotations

from collections.abc import Mapping

from art_sky.errors import ConflictError, NotRegisteredError

from .model_state import ModelState


def find(states: Mapping[str, ModelState], key: str) -> ModelState | None:
    """The run served as `key`, else the only run whose model name is `key` (None: none)."""
    if key in states:
        return states[key]
    runs = sorted(served for served, state in states.items() if state.request.name == key)
    if len(runs) > 1:
        raise ConflictError(
            f"model {key!r} has {len(runs)} runs on this server ({', '.join(runs)}): name the run, as "
            f"`model.get_inference_name()` does (e.g. {runs[0]!r}, or {runs[0] + '@0'!r} for its step 0)"
        )
    return states[runs[0]] if runs else None


def registered(states: Mapping[str, ModelState], key: str) -> ModelState:
    """`find`, or NotRegisteredError naming what is registered."""
    state = find(states, key)
    if state is None:
        raise NotRegisteredError(
            f"model {key!r} is not registered on this server (registered: {sorted(states) or 'none'}): call "
            "`await model.register(backend)` first"
        )
    return state
