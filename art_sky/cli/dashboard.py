"""`art-sky dashboard`: a run's charts in the browser, live while it trains, from its files (art_sky/dashboard)."""

from __future__ import annotations

import webbrowser
from pathlib import Path

import typer

from art_sky.dashboard import Dashboard, open_dashboard
from art_sky.dashboard.runs import read_root

from .errors import console


def dashboard(
    path: Path = typer.Option(Path(".art"), help="the checkpoint root to show (ART's .art; what `art-sky demo` uses)"),
    port: int = typer.Option(0, min=0, max=65535, help="the port on 127.0.0.1 (default: a free one)"),
    browser: bool = typer.Option(True, "--browser/--no-browser", help="open the page in this machine's browser"),
) -> None:
    """Serve a page with every run under --path: reward (mean with its within-group spread), loss and step wall
    time per step, updated as steps end. Only this machine can reach it (127.0.0.1), and only with the token in
    its URL. It reads the run's files, so a finished or crashed run shows as it was left. Ctrl-C stops it."""
    served: Dashboard = open_dashboard(path, port=port)
    console.print(f"dashboard of {path.resolve()}: {served.url}", markup=False, highlight=False, soft_wrap=True)
    problem = read_root(path)["error"]  # the page says it too, and updates once a run's first step ends
    if problem:
        console.print(f"note: {problem}", markup=False, highlight=False, soft_wrap=True)
    if browser and not webbrowser.open(served.url):
        console.print("(no browser found here: open the URL above)", markup=False, highlight=False)
    try:
        served.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        served.close()
