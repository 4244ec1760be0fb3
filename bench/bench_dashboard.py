"""What an open dashboard costs a training run: the step time with `art-sky dashboard` open and updating against
closed, in one run. The real server app trains the tiny model in this process (fixed trajectories, so every step
trains the same work); `art-sky dashboard` runs as its own process on the same checkpoint root, as a user runs it.
Blocks of steps alternate closed / open (the order flipped each round, so drift falls on both); "open" is `--pages`
pages following the Server-Sent Events (threads reading `/api/events`, as a browser's EventSource does).

Prints each mode's median train() time, their ratio, the dashboard process's CPU while open (share of one core),
and how long after a step's train() returned its event reached the pages.

    python bench/bench_dashboard.py [--rounds 4] [--steps 5] [--pages 2] [--groups 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import httpx

from art_sky.settings import Settings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_steps import group  # beside this file

KEY = "bench-key"
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


class Page(threading.Thread):
    """One open page: reads the event stream, noting when each `runs` event arrived."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.arrivals = url, []
        self.stream = urllib.request.urlopen(url, timeout=600)

    def run(self) -> None:
        try:
            for line in self.stream:
                if line.startswith(b"event: runs"):
                    self.arrivals.append(time.perf_counter())
        except (OSError, ValueError):
            pass  # closed

    def close(self) -> None:
        self.stream.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="steps per block")
    parser.add_argument("--pages", type=int, default=2, help="pages open in an open block")
    parser.add_argument("--groups", type=int, default=4, help="groups of 4 trajectories per step")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from art_sky.cluster.server import create_app

    with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as work:
        root = Path(work)
        app = create_app(root, KEY, Settings(engine="portable", trainer="peft"))
        dashboard = subprocess.Popen(
            [sys.executable, "-m", "art_sky.cli", "dashboard", "--path", str(root), "--no-browser"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert dashboard.stdout is not None
        url = dashboard.stdout.readline().split(": ", 1)[1].strip()
        events = url.replace("/?", "/api/events?")
        times: dict[str, list[float]] = {"closed": [], "open": []}
        delays: list[float] = []
        open_cpu = open_wall = 0.0
        step = 0
        try:
            async with (
                app.router.lifespan_context(app),
                httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app),
                    base_url="http://server",
                    timeout=3600,
                    headers={"authorization": f"Bearer {KEY}"},
                ) as client,
            ):
                body = {"name": "bench", "project": "bench", "base_model": "art-sky/tiny"}
                assert (await client.post("/art/models", json=body)).status_code == 200

                async def train() -> tuple[float, float]:
                    nonlocal step
                    step += 1
                    started = time.perf_counter()
                    response = await client.post(
                        "/art/models/bench/train",
                        json={"groups": [group(step, 4, 8)] * args.groups, "config": {"learning_rate": 1e-4}},
                    )
                    assert json.loads(response.text.splitlines()[-1])["type"] == "result", response.text
                    return started, time.perf_counter()

                await train()  # warm-up
                for round_ in range(args.rounds):
                    for mode in ("closed", "open") if round_ % 2 == 0 else ("open", "closed"):
                        pages = [Page(events) for _ in range(args.pages if mode == "open" else 0)]
                        for page in pages:
                            page.start()
                        await asyncio.sleep(1.0)  # the pages' first event (the whole runs) is in
                        cpu_before, wall_before = cpu_s(dashboard.pid), time.perf_counter()
                        for _ in range(args.steps):
                            seen = [len(page.arrivals) for page in pages]
                            started, returned = await train()
                            times[mode].append(returned - started)
                            for page, before in zip(pages, seen, strict=True):
                                deadline = time.perf_counter() + 5
                                while len(page.arrivals) == before and time.perf_counter() < deadline:
                                    await asyncio.sleep(0.01)
                                if len(page.arrivals) > before:
                                    delays.append(page.arrivals[before] - returned)
                        if mode == "open":
                            open_cpu += cpu_s(dashboard.pid) - cpu_before
                            open_wall += time.perf_counter() - wall_before
                        for page in pages:
                            page.close()
        finally:
            dashboard.terminate()
            dashboard.wait(30)
    closed, opened = statistics.median(times["closed"]), statistics.median(times["open"])
    results = {
        "steps_per_mode": len(times["closed"]),
        "pages": args.pages,
        "median_train_s": {"closed": closed, "open": opened},
        "train_s": times,
        "open_over_closed": opened / closed,
        "dashboard_cpu_share_of_one_core": open_cpu / open_wall if open_wall else None,
        "event_after_return_s": {"median": statistics.median(delays), "max": max(delays)} if delays else None,
        "load_average": os.getloadavg(),
    }
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
