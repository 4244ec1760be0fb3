"""The dashboard's web server: the page, its static files, the runs as JSON and their updates as Server-Sent Events.

It reads the run's files and nothing else (no request reaches a GPU server), so it can never slow or stop training:
each open page has one thread that looks at the history files' sizes twice a second and sends what was appended.
It binds 127.0.0.1 only and answers 403 to any request without the random token its URL carries (as Jupyter
does), so other users of the machine cannot read it. The standard library's server is enough for one user's
browser, and it keeps the laptop install free of a web framework.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from . import rollouts, runs

log = logging.getLogger("art_sky.dashboard")

HOST = "127.0.0.1"
WATCH_S = 0.5  # how often an open page's thread looks at the history files (a stat per file: no read unless changed)
KEEPALIVE_S = 15.0  # an SSE comment this often, so a closed page's thread ends
STATIC = {  # the files the page loads: name -> content type
    "uPlot.iife.min.js": "text/javascript",
    "uPlot.min.css": "text/css",
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
}


class Dashboard:
    """A dashboard of the checkpoint root `root` on 127.0.0.1:`port` (0: a free port); `url` has the token."""

    def __init__(self, root: Path, port: int = 0, token: str | None = None):
        self.root = Path(root)
        self.token = token or secrets.token_urlsafe(24)
        self.stopping = threading.Event()
        self.httpd = ThreadingHTTPServer((HOST, port), _handler(self))
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/?token={self.token}"

    def start(self) -> Dashboard:
        """Serve in a background thread (tests, `art_sky.dashboard` from a program)."""
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="art-sky-dashboard", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def _handler(dashboard: Dashboard) -> Callable[..., BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "art-sky-dashboard"

        def log_message(self, format: str, *args: object) -> None:
            log.debug("%s %s", self.command, self.path.split("?")[0])  # never the token

        def do_GET(self) -> None:
            try:
                self._get()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the page went away
            except Exception as exc:  # a bug: the page says so in one line, the traceback goes to the log
                log.exception("the dashboard failed answering %s", self.path.split("?")[0])
                message = f"500: the dashboard failed ({type(exc).__name__}: {exc}); art-sky --verbose shows why\n"
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR, "text/plain", message.encode())

        def _get(self) -> None:
            url = urlsplit(self.path)
            token = parse_qs(url.query).get("token", [""])[0]
            if not hmac.compare_digest(token.encode(), dashboard.token.encode()):
                self._send(
                    HTTPStatus.FORBIDDEN,
                    "text/plain",
                    b"403: this dashboard needs the token its URL has (art-sky dashboard prints the URL)\n",
                )
            elif url.path == "/":
                self._send(HTTPStatus.OK, "text/html", _page(dashboard.token))
            elif url.path == "/api/runs":
                self._send(HTTPStatus.OK, "application/json", json.dumps(runs.read_root(dashboard.root)).encode())
            elif url.path == "/api/rollouts":
                self._rollouts(parse_qs(url.query))
            elif url.path == "/api/events":
                self._events()
            elif url.path.startswith("/static/") and url.path.removeprefix("/static/") in STATIC:
                name = url.path.removeprefix("/static/")
                self._send(HTTPStatus.OK, STATIC[name], _static(name), cache=True)
            else:
                self._send(HTTPStatus.NOT_FOUND, "text/plain", b"404: no such page\n")

        def _send(self, status: HTTPStatus, kind: str, body: bytes, cache: bool = False) -> None:
            self.send_response(status)
            self.send_header("Content-Type", f"{kind}; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "max-age=3600" if cache else "no-store")
            self.send_header("Referrer-Policy", "no-referrer")  # the token stays out of other sites' logs
            self.end_headers()
            self.wfile.write(body)

        def _rollouts(self, query: dict[str, list[str]]) -> None:
            run, step = query.get("run", [""])[0], query.get("step", [""])[0]
            if not step.isdigit():
                body = {"groups": [], "error": f"step must be a whole number, not {step!r}"}
            else:
                body = rollouts.read_rollouts(dashboard.root, run, int(step), full="full" in query)
            self._send(HTTPStatus.OK, "application/json", json.dumps(body).encode())

        def _events(self) -> None:
            """Each change of the runs' files as one `runs` event: per run, the lines from `start` on (the
            whole run again when its file was rewritten, e.g. steps set aside by a resume)."""
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            seen: dict[str, dict] = {}
            mark: tuple | None = None
            quiet = 0.0
            try:
                while not dashboard.stopping.is_set():
                    now = runs.signature(dashboard.root)
                    if now != mark:
                        mark, quiet = now, 0.0
                        self._write("runs", _changes(runs.read_root(dashboard.root), seen))
                    elif quiet >= KEEPALIVE_S:
                        self.wfile.write(b": keepalive\n\n")
                        self.wfile.flush()
                        quiet = 0.0
                    dashboard.stopping.wait(WATCH_S)
                    quiet += WATCH_S
            except (BrokenPipeError, ConnectionResetError):
                pass  # the page was closed

        def _write(self, event: str, data: dict) -> None:
            self.wfile.write(f"event: {event}\ndata: {json.dumps(data)}\n\n".encode())
            self.wfile.flush()

    return Handler


def _changes(root: dict, seen: dict[str, dict]) -> dict:
    """What a page that has `seen` (updated here) lacks of `root`: each changed run with its new lines from
    `start` (0: all of them, for a run new to the page or whose file was rewritten), and every run's id (a run
    not among them is gone)."""
    changed = []
    for run in root["runs"]:
        before = seen.get(run["id"])
        entries = run["entries"]
        start = len(before["entries"]) if before and entries[: len(before["entries"])] == before["entries"] else 0
        if before != run:
            changed.append(run | {"entries": entries[start:], "start": start})
        seen[run["id"]] = run
    ids = [run["id"] for run in root["runs"]]
    for gone in set(seen) - set(ids):  # its folder removed (a fresh demo run)
        del seen[gone]
    return {"root": root["root"], "error": root["error"], "runs": changed, "ids": ids}


def _static(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


def _page(token: str) -> bytes:
    """The page, with the token its scripts send (a URL-safe string, nothing to escape)."""
    return _static("index.html").replace(b"{{token}}", token.encode())
