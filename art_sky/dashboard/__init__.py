"""A local web dashboard of a checkpoint root's runs (`art-sky dashboard`): charts drawn with uPlot (vendored in
static/), data from the runs' files, updates pushed to the page as Server-Sent Events."""

from __future__ import annotations

from pathlib import Path

from art_sky.errors import ConfigError

from .server import Dashboard


def open_dashboard(root: Path, port: int = 0) -> Dashboard:
    """A dashboard of `root` bound on 127.0.0.1 (not yet serving: `.start()` in a thread, or `.serve_forever()`);
    ConfigError when `port` is taken."""
    try:
        return Dashboard(Path(root), port=port)
    except OSError as exc:
        raise ConfigError(
            f"the dashboard could not listen on 127.0.0.1:{port} ({exc.strerror or exc}): pick another --port, "
            "or leave it out for a free one"
        ) from exc


__all__ = ["Dashboard", "open_dashboard"]
