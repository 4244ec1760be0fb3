"""openpipe-art programs run unchanged but for the backend line, on LocalBackend and SSHBackend, at both ends of the
supported range: ART 0.5.18 (this venv, Python 3.11) and the newest tested release (.venv-art: Python 3.12 with only
`pip install -e ".[art]"`, made by tests/setup/50-art-latest.sh).

The programs (tests/art_programs/) run in their own Python process, as a user's would: `import art` (the real
openpipe-art, installed by the `art` extra) loads litellm, weave and patches transformers, none of which belongs in
the test process. Each prints what it saw as JSON on its last line; the tests check that and the files the server
and ART's frontend wrote. The in-process tests below (and tests/test_art_compat.py) check the same features
deterministically on the real server.
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import train_lines
from sshd import art_sky_home, sshd  # noqa: F401 (fixtures)

import art_sky
from art_sky.art_compat import releases
from art_sky.art_compat.models import model_config, openai_server_config
from art_sky.art_compat.training import KEYWORDS, train_options
from art_sky.client.trajectories import History, wire_groups
from art_sky.errors import ConfigError
from art_sky.remote.install import BootstrapOptions
from art_sky.wire import ModelConfig, TrainConfig

PROGRAMS = Path(__file__).parent / "art_programs"
ROOT = Path(__file__).resolve().parent.parent
ART_LATEST = ROOT / ".venv-art" / "bin" / "python"  # the newest tested ART (tests/setup/50-art-latest.sh)
BACKEND_LINE = "backend = art_sky.LocalBackend()  # BACKEND"


def run_program(name: str, cwd: Path, backend_line: str | None = None, python: str | Path = sys.executable) -> dict:
    """Run an ART program (its BACKEND lines' backend replaced, if given) in `cwd` with `python` (this venv's by
    default)."""
    source = (PROGRAMS / f"{name}.py").read_text()
    if backend_line is not None:
        source = "\n".join(
            line[: line.index("backend = ")] + f"backend = {backend_line}"
            if line.strip().startswith(BACKEND_LINE)
            else line
            for line in source.splitlines()
        )
    program = cwd / f"{name}.py"
    program.write_text(source)
    env = os.environ | {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "WANDB_MODE": "disabled"}
    env.pop("WANDB_API_KEY", None)
    done = subprocess.run([str(python), str(program)], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def history(model_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (model_dir / "history.jsonl").read_text().splitlines() if line.strip()]


def check_multiply(seen: dict, server_dir: Path, frontend_dir: Path) -> None:
    assert seen["steps"] == [1, 2] and seen["get_step"] == 2
    assert sum(seen["trained_tokens"]) > 0  # ART's own client (just logprobs=True) gave trainable choices
    assert seen["inference_name"] == "multiply"
    # ART's delete_checkpoints kept the newest step (2, also the only one with val/reward); SFT added 3 and 4.
    assert sorted(p.name for p in (server_dir / "checkpoints").iterdir()) == ["0002", "0003", "0004"]
    assert seen["step_after_sft"] == 4
    lora = json.loads((server_dir / "checkpoints" / "0004" / "adapter_config.json").read_text())
    assert (lora["r"], lora["lora_alpha"]) == (4, 8)  # from ART's _internal_config, not the user's config
    sft_losses = [e["loss/train"] for e in history(frontend_dir) if "loss/train" in e]
    assert len(sft_losses) == 2 and sft_losses[1] < sft_losses[0]  # the second SFT call starts lower: it learned
    assert list((frontend_dir / "trajectories" / "train").glob("*.parquet"))  # ART's model.log wrote parquet


@pytest.mark.slow
def test_art_programs_on_local_backend(tmp_path):
    seen = run_program("multiply", tmp_path)
    model_dir = tmp_path / ".art" / "art-compat" / "models" / "multiply"  # ART's default and LocalBackend's
    check_multiply(seen, model_dir, model_dir)

    echo = run_program("echo", tmp_path)
    assert echo["get_step"] == 2
    assert "adam_params" in echo["refused"] and echo["refused"].startswith("ConfigError")
    # the seeded replies of step 1 (the untrained model's, the same every run) differ in length: it trains
    trained = [m for m in echo["metrics"] if m.get("trained_tokens", 0) > 0]
    assert echo["metrics"][0] in trained and all(m["kl"] >= 0 for m in trained)


@pytest.mark.slow
def test_art_program_on_ssh_backend(sshd, tmp_path, art_sky_home):
    remote = tmp_path / "remote"
    seen = run_program("multiply", tmp_path, _ssh_backend(sshd, remote))
    server_dir = remote / "art" / "art-compat" / "models" / "multiply"
    check_multiply(seen, server_dir, tmp_path / ".art" / "art-compat" / "models" / "multiply")


@pytest.mark.slow
def test_art_program_from_a_clean_venv_with_only_the_art_extra(tmp_path):
    """A user's laptop: a fresh venv with `pip install "art-sky[art]"` (no torch, no server) runs ART's `model.log`,
    `delete_checkpoints` and `train_sft`; the server its LocalBackend starts runs on another Python (this venv's), as
    it would on a cluster."""
    venv = tmp_path / "art-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", f"{ROOT}[art]"], capture_output=True, text=True, timeout=1800
    )
    assert install.returncode == 0, install.stderr[-5000:]
    check = "import importlib.util as u; print([m for m in ('torch', 'transformers', 'fastapi') if u.find_spec(m)])"
    assert (
        subprocess.run([python, "-c", check], capture_output=True, text=True, check=True, cwd=tmp_path).stdout.strip()
        == "[]"
    )  # the laptop side only: [art] pulls no server deps
    work = tmp_path / "work"
    work.mkdir()
    seen = run_program("multiply", work, f"art_sky.LocalBackend(python={sys.executable!r})", python=python)
    model_dir = work / ".art" / "art-compat" / "models" / "multiply"
    check_multiply(seen, model_dir, model_dir)


def _ssh_backend(sshd, remote: Path) -> str:
    """An SSHBackend line for a program: this machine's sshd, the server on this venv's Python (a prepared one)."""
    options = f"__import__({BootstrapOptions.__module__!r}, fromlist=['_']).BootstrapOptions"
    return (
        f"art_sky.SSHBackend('{sshd.target().user}@127.0.0.1:{sshd.port}', key_path='{sshd.client_key}', "
        f"options={options}(remote_dir='{remote}', python='{sys.executable}'))"
    )


# -- the newest end of the range: ART 0.5.20+ on Python 3.12 -------------------------------------------------------
def _python312() -> str | None:
    found = glob.glob(os.path.expanduser("~/.pyenv/versions/3.12.*/bin/python3.12"))
    pyenv = shutil.which("pyenv")
    if pyenv:
        root = subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip()
        found += glob.glob(f"{root}/versions/3.12.*/bin/python3.12")
    return (found or [shutil.which("python3.12")])[0]


@pytest.fixture(scope="module")
def art_latest() -> Path:
    """The Python of .venv-art (the newest tested ART, installed by the `art` extra alone)."""
    if _python312() is None:
        pytest.skip(
            "no Python 3.12 on this machine: ART 0.5.20+ needs it (pyenv install 3.12), so the newest end of "
            "the supported range is not tested here"
        )
    if not ART_LATEST.exists():
        pytest.fail(f"{ART_LATEST} is missing: run `bash tests/setup/50-art-latest.sh` (tests/run.sh does)")
    return ART_LATEST


def _art_version(python: Path | str) -> str:
    return subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('openpipe-art'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def test_the_art_extra_installs_the_newest_tested_release_on_python_312_and_keeps_any_in_the_range(art_latest):
    """.venv-art has only `pip install -e ".[art]"`: the newest release of the range, no server stack; an ART
    already installed within the range resolves with the extra as it is (pip keeps it)."""
    assert _art_version(art_latest) == releases.NEWEST
    assert _art_version(sys.executable) == releases.OLDEST  # Python 3.11: the last release for it
    check = "import importlib.util as u; print([m for m in ('torch', 'transformers', 'fastapi') if u.find_spec(m)])"
    assert (
        subprocess.run([str(art_latest), "-c", check], capture_output=True, text=True, check=True).stdout.strip()
        == "[]"
    )
    for version in ("0.5.20", releases.NEWEST):
        report = subprocess.run(
            [
                str(art_latest),
                "-m",
                "pip",
                "install",
                "--dry-run",
                "--quiet",
                "--report",
                "-",
                f"openpipe-art=={version}",
                "-e",
                f"{ROOT}[art]",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert report.returncode == 0, report.stderr[-3000:]
        chosen = {
            item["metadata"]["name"]: item["metadata"]["version"] for item in json.loads(report.stdout)["install"]
        }
        assert chosen.get("openpipe-art", _art_version(art_latest)) == version


def test_every_keyword_of_arts_backend_train_is_known_at_both_ends(art_latest):
    """The real LocalBackend.train signatures (read from each release's source: importing them needs ART's GPU
    stack): every keyword art-sky does not take is a TypeError today, so each must be in art-sky's table."""
    probe = (
        "import ast, importlib.util, json; tree = ast.parse(open(importlib.util.find_spec('art').submodule_search_"
        "locations[0] + '/local/backend.py').read()); print(json.dumps([a.arg for n in ast.walk(tree) if isinstance(n,"
        " ast.AsyncFunctionDef) and n.name == 'train' for a in n.args.kwonlyargs]))"
    )
    for python in (sys.executable, art_latest):
        keywords = set(
            json.loads(subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True).stdout)
        ) - {"verbose"}
        assert keywords <= set(KEYWORDS), f"ART {_art_version(python)}: {sorted(keywords - set(KEYWORDS))}"
        version = _art_version(python)
        assert all(releases._key(KEYWORDS[k].since) <= releases._key(version) for k in keywords)
    assert set(KEYWORDS) - {"verbose"} <= keywords  # nothing in the table that the newest release lacks


def check_latest(seen: dict, server_root: Path, frontend_root: Path) -> None:
    """What the ART 0.5.20+ program saw and left (multiply_art_0520.py), on any backend."""
    assert seen["steps"] == [1, 2, 3] and seen["result_is_art"] and seen["checkpoint_on_disk"]
    assert seen["litellm"][1] > 0  # litellm_completion_params(): ART's extra_body accepted, the ids came back
    assert seen["trained_tokens"][0] > 0  # ART's own client's rollouts trained on the engine's ids
    sequences, gradient_steps = seen["gradient_steps"]
    assert sequences > 0 and gradient_steps == math.ceil(sequences / 4)  # grad_accumulation_sequences=4
    assert seen["captured_exchanges"] == 2 and seen["captured_exact_tokens"] > 0  # art.trajectory(...) trained
    assert seen["leased"] == ["multiply:run-a@1", "multiply:run-a@1"]  # the lease pinned the run, step 1 served it
    assert seen["kept_while_leased"] == [1, 3] and seen["kept_after_lease"] == [3]
    assert seen["step_after_sft"] == 4
    assert seen["unsaved"] == [5, None] and seen["get_step"] == 5  # trained and served, no checkpoint
    assert seen["second_run"] == ["multiply:run-b", 0]  # a new run_name of the name: a new lineage, served apart
    assert seen["runs_apart"] == [1, 5, "multiply:run-a", "multiply:run-b@1"]  # each run trained and sampled alone
    assert seen["second_run_step"] == 1  # a restart resumes each run
    assert seen["pipeline_step"] == 3  # PipelineTrainer's max_steps
    evals = seen["pipeline_eval_models"]  # its eval, each under an exact lease of the step it evaluates
    assert evals and len(set(evals)) == len(evals) and all(m in ("piped:piped-1@2", "piped:piped-1@3") for m in evals)
    run_a = server_root / "art-latest" / "models" / "run-a"
    assert sorted(p.name for p in (run_a / "checkpoints").iterdir()) == ["0003", "0004", "0005"]
    assert not list((run_a / "checkpoints" / "0005" / "training_state").glob("optimizer.*"))  # no resume point
    lora = json.loads((run_a / "checkpoints" / "0004" / "adapter_config.json").read_text())
    assert (lora["r"], lora["lora_alpha"]) == (4, 8)  # ART's lora_config
    assert sorted(p.name for p in (server_root / "art-latest" / "models" / "run-b" / "checkpoints").iterdir()) == [
        "0000",
        "0001",
    ]
    assert not (server_root / "art-latest" / "models" / "multiply").exists()  # keyed by run_name, as ART keys it
    frontend = frontend_root / "art-latest" / "models" / "run-a"
    assert any("val/reward" in e for e in history(frontend))  # ART's model.log, read by its delete_checkpoints
    assert list((frontend / "trajectories" / "train").glob("*.parquet"))


@pytest.mark.slow
def test_art_latest_program_on_local_backend(art_latest, tmp_path):
    seen = run_program(
        "multiply_art_0520", tmp_path, f"art_sky.LocalBackend(python={sys.executable!r})", python=art_latest
    )
    check_latest(seen, tmp_path / ".art", tmp_path / ".art")


@pytest.mark.slow
def test_art_latest_program_on_ssh_backend(art_latest, sshd, tmp_path, art_sky_home):
    remote = tmp_path / "remote"
    seen = run_program("multiply_art_0520", tmp_path, _ssh_backend(sshd, remote), python=art_latest)
    check_latest(seen, remote / "art", tmp_path / ".art")


@pytest.mark.slow
def test_art_sft_helpers_train_every_schedule_into_the_backends_path(art_latest, tmp_path):
    """ART's train_sft_from_file (linear), create_sft_dataset_iterator (cosine, constant): their last rate is 0.0,
    a batch that counts and changes nothing, as in ART; a negative rate is refused by batch and value, nothing
    trained. ART's own files land under LocalBackend(path=...), as ART's LocalBackend puts them."""
    from safetensors.torch import load_file

    seen = run_program(
        "sft_helpers", tmp_path, f"art_sky.LocalBackend(path='elsewhere', python={sys.executable!r})", python=art_latest
    )
    root = tmp_path / "elsewhere"
    assert seen["base_path"] == str(root)
    assert seen["after_file"] == 1 and seen["after_iterator"] == 5
    assert seen["chunk_rates"] == [[1e-3], [0.0], [1e-3], [1e-3]]
    assert seen["negative"] == (
        "ConfigError: train_sft: batch 2's learning rate is -0.0001: give a rate from 0 to 1 (0 trains nothing but "
        "counts the batch, as ART's schedules end)"
    )
    assert seen["after_negative"] == 5
    [model_dir] = (root / "art-sft" / "models").iterdir()
    weights = [load_file(model_dir / "checkpoints" / f"{step:04d}" / "adapter_model.safetensors") for step in (1, 2, 3)]
    assert any(not weights[0][k].equal(weights[1][k]) for k in weights[0])  # 1e-3 trained
    assert weights[1].keys() == weights[2].keys() and all(weights[1][k].equal(weights[2][k]) for k in weights[1])
    rates = [e["loss/learning_rate"] for e in history(model_dir) if "loss/learning_rate" in e]
    assert rates == [5e-4, 1e-3, 0.0, 1e-3, 1e-3]  # ART's metrics (a call's mean), in its history by the checkpoints
    assert not (tmp_path / ".art").exists()


def test_local_backend_in_a_venv_with_only_the_art_extra_says_what_to_install(art_latest, tmp_path):
    """The documented ART install (`[art]` alone, as .venv-art is made) has no server packages: the guide's
    LocalBackend() says in one line what to install for this Python, before starting a server that would fail."""
    program = (
        "import asyncio, json, sys, art, art_sky\n"
        "from art_sky.errors import ConfigError\n"
        "async def main():\n"
        "    said = {}\n"
        "    for python in sys.argv[1:]:\n"
        "        model = art.TrainableModel(name='m', run_name='r', project='p', base_model='art-sky/tiny')\n"
        "        try:\n"
        "            await model.register(art_sky.LocalBackend(python=python))\n"
        "        except ConfigError as exc:\n"
        "            said[python] = str(exc)\n"
        "    print(json.dumps(said))\n"
        "asyncio.run(main())\n"
    )
    done = subprocess.run(
        [str(art_latest), "-c", program, str(art_latest), str(tmp_path / "no-python")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    checkout = Path(art_sky.__file__).resolve().parent.parent
    assert said[str(art_latest)].startswith(
        f"LocalBackend runs the cluster server with {art_latest}, which lacks its packages (fastapi, uvicorn, torch"
    )
    assert said[str(art_latest)].endswith(
        f'install them with `{art_latest} -m pip install -e "{checkout}[cluster]"`, or pass '
        "LocalBackend(python=...) a Python that has them"
    )
    assert said[str(tmp_path / "no-python")] == (
        f"LocalBackend(python={str(tmp_path / 'no-python')!r}): no such Python: give the path of one"
    )
    assert not (tmp_path / ".art" / "run").exists() or not list((tmp_path / ".art" / "run").iterdir())  # no server


# -- ART's keywords, internal config and trajectories, translated ----------------------------------------------
def train_config(config, kwargs):
    return train_options(config, kwargs)[0]


def test_art_train_keywords_map_to_train_config():
    assert train_config(None, {}) == TrainConfig(loss_fn="cispo", epsilon=1.0, epsilon_high=4.0)  # ART's defaults
    config = train_config(
        None,
        {
            "learning_rate": 1e-4,
            "loss_fn": "ppo",
            "kl_penalty_coef": 0.1,
            "epsilon_high": 0.3,
            "normalize_advantages": False,
            "advantage_balance": 0.0,
        },
    )
    assert config == TrainConfig(
        learning_rate=1e-4, loss_fn="ppo", kl_penalty_coef=0.1, epsilon_high=0.3, scale_rewards=False
    )
    assert train_config(TrainConfig(beta=0.1), {"learning_rate": 1e-3}) == TrainConfig(beta=0.1, learning_rate=1e-3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"adam_params": {"beta1": 0.8}}, "adam_params"),
        ({"importance_sampling_level": "tokens"}, "importance_sampling_level"),
        ({"save_checkpoint": "no"}, "save_checkpoint"),
        ({"kl_penalty_reference_step": 3}, "kl_penalty_reference_step"),
        ({"loss_fn": "dro"}, "loss_fn"),
        ({"learning_rate": -1.0}, "learning_rate"),
    ],
)
def test_art_train_keywords_the_trainer_cannot_honour_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        train_config(None, kwargs)


def test_unknown_train_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="'learning_rte'"):
        train_config(None, {"learning_rte": 1e-5})


class _ArtLikeModel:
    """Only the fields art-sky reads from an `art.TrainableModel`."""

    def __init__(self, config=None, internal=None):
        self.config, self._internal_config = config, internal


def test_art_openai_client_config_is_accepted_and_named_never_silently(caplog):
    """ART's own tests register with `_openai_client_config={"engine_args": {...}}` (its vLLM server's settings):
    accepted, each setting named as ignored; a key ART's OpenAIServerConfig lacks is refused by name."""
    with caplog.at_level("WARNING", logger="art_sky"):
        openai_server_config({"engine_args": {"enforce_eager": True}, "log_file": "x.log"})
        openai_server_config(None)
    assert caplog.messages == [
        "art-sky ignores these settings of ART's own vLLM server (the cluster server's engine has its own, "
        "ART_SKY_* variables): _openai_client_config engine_args.enforce_eager, log_file"
    ]
    with pytest.raises(ConfigError, match=r"has \['engine_arg'\], which ART's OpenAIServerConfig does not define"):
        openai_server_config({"engine_arg": {}})


def test_lora_settings_come_from_art_internal_config_never_the_user_config():
    assert model_config(_ArtLikeModel(config={"lora_rank": 64})) == ModelConfig()  # the user's own config
    internal = {
        "peft_args": {"r": 16, "lora_alpha": 32, "bias": "none"},
        "init_args": {"max_seq_length": 4096},
        "engine_args": {"gpu_memory_utilization": 0.7},
    }
    assert model_config(_ArtLikeModel(internal=internal)) == ModelConfig(
        lora_rank=16, lora_alpha=32, max_seq_length=4096
    )
    assert model_config(_ArtLikeModel(config=ModelConfig(lora_rank=2))).lora_rank == 2  # art-sky's own option
    with pytest.raises(ConfigError, match="'peft_args'.*'use_rslora'"):
        model_config(_ArtLikeModel(internal={"peft_args": {"use_rslora": True}}))
    with pytest.raises(ConfigError, match="'chat_template'"):
        model_config(_ArtLikeModel(internal={"chat_template": "{{ messages }}"}))


def _group(*trajectories):
    return art_sky.TrajectoryGroup(list(trajectories))


def _trajectory(reward=1.0, items=None, **fields):
    items = items if items is not None else [{"role": "user", "content": "hi"}]
    return art_sky.Trajectory(messages_and_choices=items, reward=reward, **fields)


@pytest.mark.parametrize(
    "bad, match",
    [
        (_trajectory(reward=math.nan), r"group 1, trajectory 1: reward is nan"),
        (_trajectory(items=[]), r"group 1, trajectory 1: messages_and_choices is empty"),
        (
            _trajectory(items=[{"role": "user", "content": "x"}, {"content": "no role"}]),
            r"group 1, trajectory 1, messages_and_choices\[1\]\): role: Field required",
        ),
        (_trajectory(metrics={"score": math.inf}), r"group 1, trajectory 1: metrics\['score'\] is inf"),
        (
            _trajectory(additional_histories=[History(messages_and_choices=[{"role": "wizard", "content": "x"}])]),
            r"group 1, trajectory 1, additional_histories\[0\], messages_and_choices\[0\]\): role",
        ),
    ],
)
def test_malformed_trajectory_names_its_group_index_and_field(bad, match):
    with pytest.raises(ConfigError, match=match):
        wire_groups([_group(_trajectory(), _trajectory(0.0)), _group(_trajectory(), bad)])


def test_art_fields_on_art_sky_trajectories():
    history = History(messages_and_choices=[{"role": "user", "content": "aside"}])
    trajectory = _trajectory(additional_histories=[history], metadata={"scenario": "s1"}).finish()
    assert trajectory.metrics["duration"] >= 0 and history.messages() == [{"role": "user", "content": "aside"}]
    group = art_sky.TrajectoryGroup([trajectory], metrics={"judge_cost": 0.1}, metadata={"split": "a"})
    group.log("scored")
    assert (group.metrics, group.metadata, group.logs) == ({"judge_cost": 0.1}, {"split": "a"}, ["scored"])
    with pytest.raises(ConfigError, match="group 0 is empty"):
        wire_groups([art_sky.TrajectoryGroup([])])


# -- the server side: additional histories, SFT and ART's checkpoint deletion, on the real in-process server ----
async def _sampled(server, content: str) -> dict:
    response = await server.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4, "logprobs": True},
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"])  # ids come with plain logprobs=True
    return {
        "kind": "choice",
        "content": choice["message"]["content"],
        "token_ids": choice["token_ids"],
        "logprobs": [t["logprob"] for t in choice["logprobs"]["content"]],
    }


async def test_additional_histories_train_as_further_sequences(server):
    async def trajectory(reward: float, histories: int) -> dict:
        return {
            "items": [{"role": "user", "content": "a"}, await _sampled(server, "a")],
            "reward": reward,
            "additional_histories": [
                {"items": [{"role": "user", "content": "b"}, await _sampled(server, "b")]} for _ in range(histories)
            ],
        }

    status, lines = await train_lines(
        server, "tiny", {"groups": [{"trajectories": [await trajectory(1.0, 2), await trajectory(0.0, 1)]}]}
    )
    assert status == 200, lines
    assert lines[-1]["metrics"]["sequences"] == 5.0  # 1 + 2 and 1 + 1

    bad = await trajectory(1.0, 0)
    bad["additional_histories"] = [
        {"items": [{"role": "user", "content": "b"}, {"kind": "choice", "token_ids": [10**6]}]}
    ]
    status, lines = await train_lines(
        server, "tiny", {"groups": [{"trajectories": [await trajectory(0.0, 0), bad, await trajectory(0.5, 0)]}]}
    )
    assert status == 200, lines  # skipped and reported; the rest trains
    assert lines[-1]["skipped"][0].startswith("group 0, trajectory 1: additional_histories[0], messages_and_choices[1]")
    assert lines[-1]["metrics"]["num_trajectories_skipped"] == 1 and lines[-1]["metrics"]["sequences"] == 2.0


async def test_sft_is_one_step_with_one_optimizer_step_per_batch(server):
    step = (await server.get("/art/models/tiny")).json()["step"]
    chat = [{"role": "user", "content": "2 * 3?"}, {"role": "assistant", "content": "6"}]
    body = {
        "trajectories": [{"items": chat, "reward": 0.0}] * 3 + [{"items": chat[:1], "reward": 0.0}],
        "batch_size": 2,
        "learning_rates": [1e-2, 1e-3],
    }
    response = await server.post("/art/models/tiny/sft", json=body)
    lines = [json.loads(line) for line in response.text.splitlines()]
    result = lines[-1]
    assert result["type"] == "result" and result["step"] == step + 1
    assert [b["learning_rate"] for b in result["batches"]] == [1e-2, 1e-3]  # 2 batches of the 4, each its rate
    assert [b["sequences"] for b in result["batches"]] == [2.0, 1.0]
    assert result["metrics"]["num_dropped_trajectories"] == 1.0  # no assistant turn: skipped and reported
    assert all(b["trained_tokens"] > 0 and math.isfinite(b["loss"]) for b in result["batches"])

    response = await server.post("/art/models/tiny/sft", json=body | {"learning_rates": [1e-3] * 3})
    assert response.status_code == 422 and "give one per batch" in response.json()["detail"]


async def test_art_delete_checkpoint_files_keeps_exactly_the_given_steps(server):
    for _ in range(2):
        await server.post(
            "/art/models/tiny/sft",
            json={
                "trajectories": [
                    {"items": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "reward": 0.0}
                ],
                "learning_rates": [1e-4],
            },
        )
    steps = [c["step"] for c in (await server.get("/art/models/tiny/checkpoints")).json()]
    current = steps[-1]
    response = await server.post("/art/models/tiny/checkpoints/delete", json={"keep_steps": [steps[0]]})
    assert [c["step"] for c in response.json()] == [steps[0], current]  # the current step always stays
