"""The CLI as people expect it (issue 17): a cluster's name is the first argument of every cluster command
(`--name` an alias), clusters of one host live side by side, errors are short and free of library log lines, a dead
server is downed at once, `status` never folds names and has `--json`, Ctrl-C ends `tunnel` and `logs -f`, and
`art-sky demo` climbs from a fresh model every time."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import httpx
import pytest
from processes import Lines, art_sky_cli, python_command
from sshd import art_sky_home, sshd  # noqa: F401 (fixtures)
from typer.testing import CliRunner

from art_sky import TrainableModel, attach, clusters
from art_sky.checkpoints import CheckpointDir
from art_sky.cli import app
from art_sky.cli.table import lines
from art_sky.errors import ServerError
from art_sky.layout import ServerLayout
from art_sky.remote.ssh import SSHTarget

BASE_PYTHON = sys.executable  # a prepared interpreter on the "host": the tests' own venv
NOISE = ("Secsh", "uvicorn", "HTTP Request:", "Traceback", "paramiko")
LONG = "team-a-qwen3-8b-grpo-experiment-7"  # with the other columns, wider than 80


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def assert_quiet(output: str) -> None:
    """No library's log line and no traceback: what a command prints is its own."""
    assert not [line for line in output.splitlines() if any(noise in line for noise in NOISE)], output


@pytest.fixture
def home(art_sky_home):
    """A private ART_SKY_HOME; servers a failed test left up are stopped."""
    yield art_sky_home
    for name in clusters.all_names(art_sky_home):
        cli("down", name, "--force")


def fake_record(home: Path, name: str) -> None:
    """A recorded SSH cluster on a host that does not exist: enough to see which name a command acted on."""
    clusters.save(
        home,
        clusters.ClusterRecord(
            name=name,
            kind="ssh",
            where="someone@host.invalid:22",
            target=SSHTarget(host="host.invalid", user="someone"),
            layout=ServerLayout.under("/nowhere"),
            port=1,
            pid=1,
            api_key="unused",
        ),
    )


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def statuses(*names: str) -> dict[str, dict]:
    result = cli("status", *names, "--json")
    assert result.exit_code == 0, result.output
    return {cluster["name"]: cluster for cluster in json.loads(result.output)}


# -- names -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["down", "logs", "tunnel", "ssh", "status"])
def test_the_name_is_the_first_argument_and_name_an_alias(command, home):
    spellings = [[command, "nothere"]] + ([[command, "--name", "nothere"]] if command != "status" else [])
    for args in spellings:
        result = cli(*args)
        assert result.exit_code == 1 and result.output.startswith("error: no cluster named 'nothere'"), result.output
        assert "`art-sky up nothere`" in result.output and len(result.output.splitlines()) == 1
    if command != "status":
        result = cli(command, "one", "--name", "other")
        assert result.exit_code == 1 and "two cluster names, 'one' and --name 'other'" in result.output


def test_usage_errors_are_typers_own(home):
    """A mistyped option or a command given without `--` is a usage error (exit 2, what to type), not a bug."""
    for args in (["down", "--nope"], ["ssh", "box", "ls", "-l"], ["checkpoints", "ls", "--nope"], ["ci", "run"]):
        result = cli(*args)
        assert result.exit_code == 2 and "Usage:" in result.output, (args, result.output)
        assert "unexpected" not in result.output and "bug" not in result.output, result.output


def test_up_takes_the_name_first(home):
    fake_record(home, "box")
    for args in (["up", "box", "--local"], ["up", "--name", "box", "--local"]):
        result = cli(*args)
        assert result.exit_code == 1, result.output
        assert "cluster 'box' runs on someone@host.invalid:22 (ssh): `art-sky down box` first" in result.output


def test_ssh_takes_the_command_after_dashes(home, tmp_path, monkeypatch):
    """`ssh NAME -- CMD` and `ssh -- CMD` (the default cluster, `art`), never the command taken for a name."""
    monkeypatch.chdir(tmp_path)
    assert "no cluster named 'art'" in cli("ssh", "--", "ls", "-l").output
    assert "no cluster named 'box'" in cli("ssh", "box", "--", "ls").output
    assert "no cluster named 'box'" in cli("ssh", "--name", "box", "--", "ls").output


def test_a_down_that_cannot_reach_its_host_says_what_to_do_and_force_forgets(home, monkeypatch):
    monkeypatch.setenv("ART_SKY_SSH_CONNECT_TIMEOUT", "3")
    fake_record(home, "gone")
    result = cli("down", "gone")
    assert result.exit_code == 1 and "cannot reach someone@host.invalid:22 to stop the server" in result.output
    assert "`art-sky down gone --force`" in result.output
    assert_quiet(result.output)
    result = cli("down", "gone", "--force")
    assert result.exit_code == 0 and "could not be reached" in result.output and "record removed" in result.output
    assert clusters.all_names(home) == []


def test_no_key_and_no_agent_is_said_as_such(sshd, home, tmp_path, monkeypatch):
    """Not "cannot reach ... within 20s": the host answered, and there was nothing to log in with."""
    monkeypatch.setenv("HOME", str(tmp_path / "no-keys"))  # no ~/.ssh/id_* for paramiko to find
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    target = f"{sshd.target().user}@127.0.0.1:{sshd.port}"
    result = cli("up", "box", "--host", target, "--python", BASE_PYTHON, "--remote-dir", str(tmp_path / "remote"))
    assert result.exit_code == 1 and "error" not in result.stdout, result.output
    connecting, error = result.stderr.splitlines(keepends=True)  # the phase that failed, then why
    assert re.fullmatch(
        rf"\[\d\d:\d\d:\d\d\] connecting to {re.escape(target)} \.\.\. failed after \d+\.\ds\n", connecting
    )
    assert error == (
        f"error: no SSH key to log in to {target} with: no key file given, none in an ssh-agent (SSH_AUTH_SOCK is "
        "not set) and none of ~/.ssh/id_ed25519, id_ecdsa, id_rsa exists: pass the private key whose public half "
        "is in the host's ~/.ssh/authorized_keys (`--key PATH`; key_path= in Python), or `ssh-add` it\n"
    )


# -- conventions (issue 37) ------------------------------------------------------------------------------------


def command_paths() -> list[list[str]]:
    """Every command and group, as the words after `art-sky` ([] for art-sky itself)."""
    import typer

    paths: list[list[str]] = []

    def walk(command, path: list[str]) -> None:
        paths.append(path)
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return paths


def helps(command) -> list[str]:
    """The help paragraphs a command's page shows, as one line each: its own, each option's and argument's, and
    the first paragraph of each command a group lists."""
    from art_sky.cli.conventions import unwrapped

    texts = [command.help or ""] + [p.help or "" for p in command.params if getattr(p, "help", None)]
    texts += [(sub.help or "").split("\n\n")[0] for sub in getattr(command, "commands", {}).values()]
    return [" ".join(p.split()) for text in texts for p in (unwrapped(text) or "").split("\n\n") if p.strip()]


def test_help_is_h_and_help_everywhere_wraps_to_the_terminal_and_shows_no_bool_type():
    """`-h` and `--help` on every command; lines fit 40, 80 and 200 columns; on a page wide enough for every text
    each is one line (no break from a docstring's layout); a flag shows no `<bool>` metavar."""
    import typer

    root = typer.main.get_command(app)
    for path in command_paths():
        command = root
        for name in path:
            command = command.commands[name]
        for width in (40, 80, 200, 1000):
            result = CliRunner().invoke(app, [*path, "-h"], env={"COLUMNS": str(width)}, prog_name="art-sky")
            assert result.exit_code == 0 and "Usage: art-sky" in result.stdout, (path, result.output)
            lines = result.stdout.splitlines()
            assert all(len(line) <= width for line in lines), (path, width, result.stdout)
            assert "<bool>" not in result.stdout, (path, result.stdout)
            if width == 1000:
                flat = [" ".join(line.split()) for line in lines]
                for text in helps(command):
                    assert any(text in line for line in flat), (path, text, result.stdout)
        assert CliRunner().invoke(app, [*path, "--help"]).stdout == CliRunner().invoke(app, [*path, "-h"]).stdout


def test_version_and_errors_on_stderr(home):
    from art_sky import __version__

    result = CliRunner().invoke(app, ["--version"])
    assert (result.exit_code, result.stdout, result.stderr) == (0, f"art-sky {__version__}\n", "")
    result = CliRunner().invoke(app, ["down", "nothere"])
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr == "error: no cluster named 'nothere' (known: none): start one with `art-sky up nothere`\n"
    result = CliRunner().invoke(app, ["up", "--local", "--port", "70000"])  # a usage error: typer's, on stderr
    assert result.exit_code == 2 and result.stdout == "" and "Invalid value for '--port'" in result.stderr
    assert "70000" in result.stderr or "65535" in result.stderr


def test_the_launch_plan_says_what_would_be_rented_from_skypilots_own_table():
    """What `art-sky up` shows before it asks (tests/test_skypilot.py asks it of the local Slurm): the ask, and
    SkyPilot's choice and price read from its optimizer table as SkyPilot printed it."""
    from art_sky.provisioners.sky_plan import LaunchPlan, chosen_row

    table = (
        "Considered resources (2 nodes):\n" + "-" * 80 + "\n"
        " INFRA              INSTANCE         vCPUs   Mem(GB)   GPUS     COST ($)   CHOSEN   \n" + "-" * 80 + "\n"
        " AWS (us-east-1)    p5.48xlarge      192     2048      H100:8   196.64        \x1b[32m   ✔\x1b[0m     \n"
        " GCP (us-central1)  a3-highgpu-8g    208     1872      H100:8   176.40                 \n"
    )
    chosen = chosen_row(table)
    assert chosen == {
        "INFRA": "AWS (us-east-1)",
        "INSTANCE": "p5.48xlarge",
        "vCPUs": "192",
        "Mem(GB)": "2048",
        "GPUS": "H100:8",
        "COST ($)": "196.64",
    }
    plan = LaunchPlan(
        cluster="rl", gpus=["H100:8", "A100-80GB:8"], nodes=2, spot=True, infra=None, autostop_minutes=60, chosen=chosen
    )
    assert plan.lines() == [
        "SkyPilot cluster 'rl' is not up: launching it rents",
        "  GPUs:     H100:8, then A100-80GB:8 per node",
        "  nodes:    2",
        "  spot:     yes (cheaper; can be preempted)",
        "  where:    AWS (us-east-1), instance p5.48xlarge",
        "  price:    $196.64/hour (SkyPilot's price)",
        "  autostop: torn down after 60 idle minutes",
    ]
    unknown = LaunchPlan(cluster="x", gpus=None, nodes=1, spot=False, infra="k8s", autostop_minutes=None)
    assert unknown.lines()[4:] == [
        "  where:    k8s",
        "  price:    unknown (SkyPilot shows none)",
        "  autostop: off: it runs, and bills, until `art-sky down x`",
    ]
    assert chosen_row("no table here") == {}


# -- tables ----------------------------------------------------------------------------------------------------


def test_a_table_cuts_other_columns_before_names():
    headers = ("NAME", "KIND", "SERVER", "MODELS (STEP)")
    rows = [(LONG, "ssh", "ok, portable on cpu", "agent (12), critic (3), planner (40)"), ("b", "local", "exited", "-")]
    fitted = lines(headers, rows, width=80, shrink=(3, 2))
    assert all(len(line) <= 80 for line in fitted) and len(fitted[1]) == 80, fitted
    assert fitted[1] == f"{LONG}  ssh    ok, portable on c…  agent (12), criti…"  # the widest cut first
    whole = lines(headers, rows, width=None, shrink=(3, 2))  # a pipe: nothing is cut
    assert "agent (12), critic (3), planner (40)" in whole[1] and "…" not in "".join(whole)
    narrow = lines(headers, rows, width=40, shrink=(3, 2))  # cut to "…": the name and kind are still whole
    assert narrow[1] == f"{LONG}  ssh    …  …", narrow


def in_terminal(*args: str, columns: int) -> str:
    """`art-sky ARGS` in a pseudo-terminal `columns` wide (what a user sees), its output."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")} | {"TERM": "dumb"}
    process = subprocess.Popen(
        [sys.executable, "-m", "art_sky.cli", *args],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env=env,
        close_fds=True,
    )
    os.close(follower)
    output = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: the process is done
            break
        if not chunk:
            break
        output += chunk
    os.close(leader)
    assert process.wait(60) == 0, output
    return output.decode().replace("\r\n", "\n")


# -- clusters of one host --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_clusters_on_one_host_up_status_and_down_independently(sshd, tmp_path, home):
    remote = tmp_path / "remote"
    host = [
        "--host",
        f"{sshd.target().user}@127.0.0.1:{sshd.port}",
        "--key",
        str(sshd.client_key),
        "--python",
        BASE_PYTHON,
        "--remote-dir",
        str(remote),
    ]
    for name in ("a", LONG):
        result = cli("up", name, *host)
        assert result.exit_code == 0 and f"cluster {name!r} up" in result.output, result.output
    a, long = clusters.load(home, "a"), clusters.load(home, LONG)
    # Each name has its own directory (its build, its run files); the checkpoint root is the host's, shared.
    assert a.layout.run_dir == f"{remote}/clusters/a/run" and long.layout.run_dir == f"{remote}/clusters/{LONG}/run"
    assert (remote / "clusters" / "a" / "lib" / "art_sky").is_dir()
    assert a.layout.art_path == long.layout.art_path == f"{remote}/art"
    assert a.pid != long.pid and a.port != long.port and alive(a.pid) and alive(long.pid)

    found = statuses()
    assert set(found) == {"a", LONG}
    for name, record in (("a", a), (LONG, long)):
        server = found[name]["server"]
        assert found[name]["kind"] == "ssh" and server["state"] == "ok" and server["engine"] == "portable"
        assert server["log"] == f"{record.layout.run_dir}/server.log" and found[name]["models"] == []
    assert set(statuses("a")) == {"a"}
    assert [c["name"] for c in json.loads(cli("status", "a", "a", "--json").output)] == ["a"]  # once each

    # The table: one line per cluster, the name whole, in a pipe and in an 80-column terminal.
    piped = subprocess.run(
        [sys.executable, "-m", "art_sky.cli", "status"],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "COLUMNS"},
    )
    assert piped.returncode == 0, piped.stderr
    (line,) = [line for line in piped.stdout.splitlines() if LONG in line]
    assert "ok, portable on cpu" in line and "ssh" in line
    shown = in_terminal("status", columns=80)
    assert all(len(line) <= 80 for line in shown.splitlines()), shown
    (line,) = [line for line in shown.splitlines() if LONG in line]
    assert line.startswith(f"{LONG}  ssh"), shown
    assert_quiet(piped.stdout + piped.stderr + shown)

    # One lineage, one writer: a model trained on both clusters would share the host's checkpoint folder, so the
    # second cluster's server refuses it (409), naming the first's; the first keeps it.
    async def one_model_on_both() -> None:
        first, second = attach("a"), attach(LONG)
        try:
            model = TrainableModel(name="shared", project="two-clusters", base_model="art-sky/tiny")
            await model.register(first)
            with pytest.raises(ServerError) as refused:
                await TrainableModel(name="shared", project="two-clusters", base_model="art-sky/tiny").register(second)
            said = str(refused.value)
            assert refused.value.status_code == 409 and f"pid {a.pid}" in said, said
            assert (await first.model_info(model)).step == 0
        finally:
            await first.close()
            await second.close()

    asyncio.run(one_model_on_both())

    result = cli("down", "a")
    assert result.exit_code == 0 and "server stopped" in result.output, result.output
    assert not alive(a.pid) and alive(long.pid)
    assert set(statuses()) == {LONG} and statuses()[LONG]["server"]["state"] == "ok"

    # A server that died is reported as such at once, and downed at once, saying so.
    os.killpg(long.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10  # the kill is sent at once; a large process takes a moment to be gone
    while (state := statuses()[LONG]["server"]["state"]) != "exited":
        assert state == "ok" and time.monotonic() < deadline, state
        time.sleep(0.1)
    started = time.monotonic()
    result = cli("down", LONG)
    took = time.monotonic() - started
    assert result.exit_code == 0 and "the server had already exited" in result.output, result.output
    assert took < 5, f"down of a dead server took {took:.1f}s"
    assert_quiet(result.output)
    assert clusters.all_names(home) == []


def test_the_tests_children_take_ctrl_c_even_when_the_run_ignores_it():
    """`nohup bash tests/run.sh &` starts the run with SIGINT ignored, which children inherit: the CLI processes the
    tests send Ctrl-C to start with it at its default (Python's KeyboardInterrupt)."""
    probe = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    ignoring = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); os.execv(sys.argv[1], sys.argv[1:])"
    )
    for command, expected in ((python_command("-c", probe), "True"), ([sys.executable, "-c", probe], "False")):
        result = subprocess.run([sys.executable, "-c", ignoring, *command], capture_output=True, text=True, timeout=60)
        assert result.stdout.strip() == expected, (command, result.stderr)


@pytest.mark.slow
def test_ctrl_c_ends_tunnel_and_logs_and_errors_stay_short(sshd, tmp_path, home):
    """Ctrl-C ends `tunnel` and `logs -f` promptly; a server that died behind a tunnel gives no library log lines
    (paramiko's "Secsh channel N open FAILED"), and its errors point to the log instead of pasting it."""
    up = cli(
        "up",
        "box",
        "--host",
        f"{sshd.target().user}@127.0.0.1:{sshd.port}",
        "--key",
        str(sshd.client_key),
        "--python",
        BASE_PYTHON,
        "--remote-dir",
        str(tmp_path / "remote"),
    )
    assert up.exit_code == 0, up.output
    record = clusters.load(home, "box")

    follow = art_sky_cli("logs", "box", "--lines", "200", "-f")
    tunnel = art_sky_cli("tunnel", "box")
    try:
        Lines(follow).containing("listening on 127.0.0.1", timeout=120)
        output = Lines(tunnel)
        printed = output.until("ART_SKY_API_KEY", timeout=120)
        assert httpx.get(f"{printed['ART_SKY_BASE_URL']}/health", timeout=30).status_code == 200
        os.killpg(record.pid, signal.SIGKILL)  # the server dies behind the tunnel
        for _ in range(3):
            with pytest.raises(httpx.TransportError):
                httpx.get(f"{printed['ART_SKY_BASE_URL']}/health", timeout=30)
        for process in (follow, tunnel):
            process.send_signal(signal.SIGINT)
        started = time.monotonic()
        assert tunnel.wait(15) == 0, output.rest()
        follow.wait(15)
        assert time.monotonic() - started < 15
        rest = output.rest()
        assert "tunnel closed" in rest and "cannot open a channel" in rest, rest
        assert_quiet(rest)
    finally:
        for process in (follow, tunnel):
            if process.poll() is None:
                process.kill()
                process.wait(10)

    # Its errors: one line saying what happened, what to do and where the log is; the log itself with --verbose.
    result = cli("tunnel", "box")
    assert result.exit_code == 1, result.output
    first, hint = result.output.splitlines()
    assert first.startswith("error: the cluster server on") and "exited before it was listening" in first
    assert "`art-sky logs box` shows why, `art-sky up box` starts it again" in first
    assert f"Its log: {record.layout.log_file}" in first
    assert "more lines of detail: `art-sky --verbose ...` shows them" in hint
    verbose = cli("--verbose", "tunnel", "box")
    assert verbose.exit_code == 1 and "Last lines of the log:" in verbose.output
    assert "listening on 127.0.0.1" in verbose.output
    assert_quiet(result.output)
    assert cli("status", "box").output.count("exited") == 1


# -- scripts ---------------------------------------------------------------------------------------------------


def test_checkpoints_ls_json(tmp_path, home):
    local = CheckpointDir(tmp_path / ".art", "proj", "agent")
    for step in (1, 2):
        local.save(
            step,
            lambda tmp: (tmp / "adapter_model.safetensors").write_bytes(b"x" * 1000),
            base_model="art-sky/tiny",
            metrics={"reward": step / 4},
        )
    uri = f"file://{tmp_path / 'store'}"
    assert cli("checkpoints", "push", "proj", "agent", "--path", str(tmp_path / ".art"), "--uri", uri).exit_code == 0
    result = cli("checkpoints", "ls", "--uri", uri, "--json")
    assert result.exit_code == 0, result.output
    steps = json.loads(result.output)
    assert [(s["project"], s["model"], s["step"], s["metrics"]) for s in steps] == [
        ("proj", "agent", 1, {"reward": 0.25}),
        ("proj", "agent", 2, {"reward": 0.5}),
    ]
    assert steps[1]["where"] == f"{uri}/proj/models/agent/checkpoints/0002" and steps[1]["size_bytes"] >= 1000
    assert json.loads(cli("checkpoints", "ls", "other", "--uri", uri, "--json").output) == []


def test_status_json_with_no_clusters(home):
    result = cli("status", "--json")
    assert result.exit_code == 0 and json.loads(result.output) == []


# -- the demo --------------------------------------------------------------------------------------------------


def demo(folder: Path, *args: str) -> tuple[str, list[float]]:
    result = subprocess.run(
        [sys.executable, "-m", "art_sky.cli", "demo", *args], capture_output=True, text=True, timeout=900, cwd=folder
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout, [
        float(line.split("reward")[1].split()[0]) for line in result.stdout.splitlines() if line.startswith("step")
    ]


@pytest.mark.slow
def test_the_demo_climbs_again_in_the_same_folder(tmp_path):
    """A second `art-sky demo` in the same folder trains a fresh model (and says so): the reward starts low
    again. `--resume` continues the model and says from which step."""
    _, first = demo(tmp_path, "--steps", "8")
    output, second = demo(tmp_path, "--steps", "8")
    assert "starting a fresh model: removed the previous demo run's digits-0" in output
    for rewards in (first, second):
        assert rewards[0] < 0.3 and max(rewards[-2:]) >= rewards[0] + 0.3, (first, second)
    output, resumed = demo(tmp_path, "--steps", "1", "--resume", "--plot", str(tmp_path / "resumed.png"))
    assert "resuming model digits-0 from step 8" in output and "step 9/9" in output
    assert resumed[0] >= second[0] + 0.3
