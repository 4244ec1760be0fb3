"""`art-sky dashboard` in a real browser (Playwright driving Debian's chromium, tests/setup/60-chromium.sh): the real
server app trains the tiny model in this process while the page watches its files; the reward chart gains each
step's point within seconds, the page needs its token and is bound to 127.0.0.1, no API key reaches it, a run
reopened after its server is gone shows the same numbers, and bad run files are said on the page.

With DASHBOARD_SCREENSHOTS=docs/assets/dashboard the page's screenshots are written there (docs/guides/watching.md
shows them); otherwise to the test's temporary folder."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import API_KEY, app_client, train_lines
from loop import trajectory

from art_sky.cluster import rollouts
from art_sky.dashboard import Dashboard, open_dashboard
from art_sky.errors import ConfigError
from art_sky.settings import Settings

MODEL = {"name": "tiny", "project": "watch", "base_model": "art-sky/tiny"}
SHOWN_S = 5.0  # a step's point is on the page this soon after its line is written (the page's watch is 0.5 s)


class Training:
    """The real server app on a checkpoint root, one step per `step()` (two groups of sampled replies)."""

    def __init__(self, root: Path):
        self.root, self.stack, self.steps = root, contextlib.AsyncExitStack(), 0

    async def start(self) -> Training:
        self.client = await self.stack.enter_async_context(app_client(self.root, Settings(), MODEL))
        return self

    async def step(self) -> None:
        groups = []
        for seed in (1, 2):
            response = await self.client.post(
                "/v1/chat/completions",
                json={
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 6,
                    "n": 4,
                    "logprobs": True,
                    "return_tokens_as_token_ids": True,
                    "seed": seed,
                },
            )
            choices = response.json()["choices"]
            rewards = [0.1 * self.steps + 0.2 * seed + 0.3 * (i % 2) for i in range(len(choices))]  # a climb
            groups.append({"trajectories": [trajectory(c, r) for c, r in zip(choices, rewards, strict=True)]})
        groups.append({"trajectories": [trajectory(c, 0.5) for c in choices[:2]]})  # equal rewards: left out
        status, lines = await train_lines(self.client, "tiny", {"groups": groups})
        assert status == 200 and lines[-1]["type"] == "result", lines
        self.steps += 1
        rollouts.flush()  # its rollouts line, written after the step by the server's background writer

    async def stop(self) -> None:
        await self.stack.aclose()


@pytest.fixture(scope="module")
async def training(tmp_path_factory):
    run = await Training(tmp_path_factory.mktemp("watch") / ".art").start()
    await run.step()
    yield run
    await run.stop()


@pytest.fixture(scope="module")
def dashboard(training):
    served = Dashboard(training.root).start()
    yield served
    served.close()


@pytest.fixture(scope="module")
async def browser():
    if shutil.which("chromium") is None:
        pytest.skip("Debian's chromium is not installed (tests/setup/60-chromium.sh installs it)")
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        chromium = await playwright.chromium.launch(executable_path=shutil.which("chromium"))
        yield chromium
        await chromium.close()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("DASHBOARD_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


async def points(page, chart: str) -> int:
    return int(await page.get_attribute(f"#chart-{chart}", "data-points"))


@pytest.mark.slow
async def test_the_reward_chart_gains_each_steps_point_as_the_step_ends(training, dashboard, browser, screenshots):
    page = await browser.new_page(viewport={"width": 1100, "height": 900})
    await page.goto(dashboard.url)
    await page.wait_for_selector("#status[data-state=live]")
    assert [await points(page, chart) for chart in ("reward", "loss", "wall")] == [1, 1, 1]
    for expected in (2, 3):
        await training.step()
        ended = time.monotonic()
        await page.wait_for_function(
            f"document.querySelector('#chart-reward').dataset.points === '{expected}'", timeout=SHOWN_S * 1000
        )
        assert time.monotonic() - ended < SHOWN_S
    row = await page.inner_text("#latest tr[data-run='watch/tiny']")
    assert row.split()[:2] == ["watch/tiny", "3"]
    assert await page.locator("#chart-reward canvas").count() == 1  # uPlot drew it
    assert await page.is_hidden("#error") and await page.is_hidden("#problems")
    await page.screenshot(path=str(screenshots / "overview.png"), full_page=True)
    await page.close()


@pytest.mark.slow
async def test_a_steps_rollouts_show_its_groups_and_a_trajectorys_conversation(
    training, dashboard, browser, screenshots
):
    lines = [json.loads(line) for line in (training.root / "watch/models/tiny/rollouts.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    first, _, equal = lines[1]["groups"]
    assert equal["skipped"] == "its rewards are all equal: nothing to learn"
    assert [t["advantage"] for t in equal["trajectories"]] == [None, None]
    assert [t["advantage"] > 0 for t in first["trajectories"]] == [t["reward"] > 0.41 for t in first["trajectories"]]
    assert first["trajectories"][0]["messages"][0] == {"role": "user", "content": "hi"}
    assert first["trajectories"][0]["messages"][1]["role"] == "assistant"
    page = await browser.new_page(viewport={"width": 1100, "height": 900})
    await page.goto(dashboard.url)
    await page.click("#steps a[data-step='2']")
    await page.wait_for_selector("#step-view .group")
    assert await page.locator("#step-view .group").count() == 3
    assert "left out: its rewards are all equal" in await page.inner_text("#step-view .group[data-group='2'] h3")
    best = page.locator("#step-view .group[data-group='0'] details").first  # sorted by reward, best first
    assert "advantage 1.000" in await best.inner_text()  # (r - mean) / std: +1 for the better half
    await best.locator("summary").click()
    turns = best.locator(".turn")
    assert await turns.count() == 2 and (await turns.nth(0).inner_text()).split() == ["user", "hi"]
    assert "step=2" in page.url  # the view is a link
    await page.screenshot(path=str(screenshots / "step.png"), full_page=True)
    await page.goto(dashboard.url + "#run=watch/tiny&step=99")
    await page.wait_for_selector("#step-error")
    assert "has no line for step 99" in await page.inner_text("#step-error")
    await page.close()


def test_the_page_needs_its_token_binds_127_0_0_1_and_never_shows_the_api_key(dashboard):
    base = f"http://127.0.0.1:{dashboard.port}"
    for path in ("/", "/api/runs", "/api/events", "/static/dashboard.js", "/?token=wrong"):
        status, body = get(base + path)
        assert status == 403 and b"token" in body, path
    assert dashboard.httpd.server_address[0] == "127.0.0.1"
    outward = _outward_address()
    if outward:
        with pytest.raises(OSError), socket.create_connection((outward, dashboard.port), timeout=2):
            pass
    token = f"token={dashboard.token}"
    bodies = [get(f"{base}{path}?{token}")[1] for path in ("/", "/api/runs", "/static/dashboard.js")]
    with urllib.request.urlopen(f"{base}/api/events?{token}", timeout=10) as events:
        bodies.append(events.readline() + events.readline())
    assert bodies[1].startswith(b'{"root"') and bodies[3].startswith(b"event: runs\ndata: {")
    assert not any(API_KEY.encode() in body for body in bodies)


def _outward_address() -> str | None:
    """This machine's address on its network (where another machine would reach it), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent, only a route chosen
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


@pytest.mark.slow
async def test_a_run_reopened_after_its_server_is_gone_shows_the_same_numbers(training, dashboard, browser):
    live = await browser.new_page()
    await live.goto(dashboard.url)
    await live.wait_for_selector("#latest tr[data-run]")
    before = await live.inner_text("#latest"), await points(live, "reward"), await points(live, "wall")
    await live.close()
    await training.stop()
    again = Dashboard(training.root).start()
    try:
        page = await browser.new_page()
        await page.goto(again.url + "#runs=watch/tiny")
        await page.wait_for_selector("#latest tr[data-run]")
        assert (await page.inner_text("#latest"), await points(page, "reward"), await points(page, "wall")) == before
        await page.close()
    finally:
        again.close()


async def test_a_folder_that_is_no_run_and_a_cut_last_line_are_said_on_the_page(tmp_path, browser, screenshots):
    (tmp_path / "notes").mkdir()
    empty = Dashboard(tmp_path).start()
    history = tmp_path / "crashed" / "p" / "models" / "m" / "history.jsonl"
    history.parent.mkdir(parents=True)
    history.write_text(
        '{"step": 1, "train/reward": 0.5, "train/loss": 0.1}\n{"step": 2, "train/reward": 0.7, "train/loss": 0.05}\n'
        '{"step": 3, "train/rew'
    )
    crashed = Dashboard(tmp_path / "crashed").start()
    try:
        page = await browser.new_page(viewport={"width": 1100, "height": 700})
        await page.goto(empty.url)
        await page.wait_for_selector("#error:not([hidden])")
        assert "is not a run folder" in await page.inner_text("#error")
        await page.goto(crashed.url)
        await page.wait_for_selector("#problems:not([hidden])")
        assert "last line of" in await page.inner_text("#problems") and "cut" in await page.inner_text("#problems")
        assert await points(page, "reward") == 2
        await page.screenshot(path=str(screenshots / "cut-history.png"), full_page=True)
        await page.close()
    finally:
        empty.close()
        crashed.close()


def test_the_cli_prints_its_url_and_serves_it(tmp_path):
    command = [sys.executable, "-m", "art_sky.cli", "dashboard", "--path", str(tmp_path), "--no-browser"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as cli:
        try:
            line = cli.stdout.readline()
            url = line.split(": ", 1)[1].strip()
            assert url.startswith("http://127.0.0.1:") and "?token=" in url, line
            assert get(url)[0] == 200
            assert "is not a run folder" in cli.stdout.readline()  # an empty folder: said here and on the page
        finally:
            cli.terminate()


def test_a_port_taken_is_said_with_what_to_do(dashboard, tmp_path):
    with pytest.raises(ConfigError, match=f"could not listen on 127.0.0.1:{dashboard.port} .*--port"):
        open_dashboard(tmp_path, port=dashboard.port)


def test_a_steps_rollouts_cut_by_a_crash_and_a_huge_message_are_said_and_cut(tmp_path):
    from art_sky.dashboard.rollouts import SHOWN_CHARS, read_rollouts

    folder = tmp_path / "p" / "models" / "m"
    folder.mkdir(parents=True)
    huge = "x" * (SHOWN_CHARS + 10)
    line = {
        "step": 1,
        "groups": [
            {
                "skipped": None,
                "trajectories": [
                    {"reward": 1.0, "advantage": 1.0, "messages": [{"role": "assistant", "content": huge}]},
                    "not a trajectory",
                ],
            }
        ],
    }
    (folder / "rollouts.jsonl").write_text(json.dumps(line) + '\n{"step": 2, "groups": [{"traj')
    shown = read_rollouts(tmp_path, "p/m", 1)
    [message] = shown["groups"][0]["trajectories"][0]["messages"]
    assert len(message["content"]) == SHOWN_CHARS and message["cut"] == SHOWN_CHARS + 10
    assert len(shown["groups"][0]["trajectories"]) == 1  # the malformed one left out, not a crash
    assert (
        read_rollouts(tmp_path, "p/m", 1, full=True)["groups"][0]["trajectories"][0]["messages"][0]["content"] == huge
    )
    cut = read_rollouts(tmp_path, "p/m", 2)
    assert cut["groups"] == [] and "the last line of" in cut["error"] and "is cut" in cut["error"]
    assert "no run" in read_rollouts(tmp_path, "../etc", 1)["error"]


def test_a_rollouts_line_that_cannot_be_written_is_a_warning_not_a_failed_step(tmp_path, caplog):
    rollouts.append_later(tmp_path / "gone", 7, lambda: {"groups": []})
    rollouts.flush()
    assert "rollouts of step 7 not written" in caplog.text


def test_the_events_send_what_was_appended_all_of_a_rewritten_run_and_which_runs_are_gone():
    from art_sky.dashboard.server import _changes

    def root(*runs: tuple[str, list[int]]) -> dict:
        entries = {name: [{"step": s, "train/reward": s / 10} for s in steps] for name, steps in runs}
        return {
            "root": "r",
            "error": None,
            "runs": [{"id": n, "entries": e, "problems": []} for n, e in entries.items()],
        }

    seen: dict = {}
    first = _changes(root(("p/a", [1, 2]), ("p/b", [1])), seen)
    assert [(r["id"], r["start"], len(r["entries"])) for r in first["runs"]] == [("p/a", 0, 2), ("p/b", 0, 1)]
    appended = _changes(root(("p/a", [1, 2, 3]), ("p/b", [1])), seen)
    assert [(r["id"], r["start"], [e["step"] for e in r["entries"]]) for r in appended["runs"]] == [("p/a", 2, [3])]
    rewritten = _changes(root(("p/a", [1]), ("p/b", [1])), seen)  # steps set aside by a resume
    assert [(r["id"], r["start"], len(r["entries"])) for r in rewritten["runs"]] == [("p/a", 0, 1)]
    gone = _changes(root(("p/a", [1])), seen)
    assert gone["runs"] == [] and gone["ids"] == ["p/a"]
    back = _changes(root(("p/a", [1]), ("p/b", [1])), seen)
    assert [(r["id"], r["start"]) for r in back["runs"]] == [("p/b", 0)]
