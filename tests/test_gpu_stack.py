"""The tested GPU stack: one pinned set that resolves for Linux x86_64 on Python 3.11 and 3.12; the server reports
its engine's and trainer's versions and refuses vLLM's GPU build or Unsloth at any other (faked here: a `vllm`
distribution of another version, and a transformers of the tested one, put first on the path)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from gpu_stack import LOCK, PYTHONS, lock_lines, resolve_all

from art_sky.cluster.node.stack import untested
from art_sky.cluster.server import create_app
from art_sky.errors import ConfigError
from art_sky.gpu_stack import CHECKED, canonical, constraint_lines
from art_sky.gpu_stack import tested_versions as pins
from art_sky.settings import Settings

ROOT = Path(__file__).resolve().parent.parent

KEY_HEADER = {"authorization": "Bearer key"}  # /health says what runs only to the key holder


def test_the_gpu_extra_pins_what_the_constraints_file_pins():
    gpu = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    pinned = dict(requirement.split("==") for requirement in gpu if "==" in requirement)
    assert {"vllm", "unsloth", "torch", "transformers"} <= set(pinned)
    for python in PYTHONS:
        tested = pins(python)
        assert {canonical(name): version for name, version in pinned.items()} == {
            canonical(name): tested[canonical(name)] for name in pinned
        }
        assert all(canonical(name) in tested for names in CHECKED.values() for name in names)


def test_versions_differing_between_pythons_carry_markers():
    lines = lock_lines(
        {
            "3.11": {"torch": "2.13.0", "networkx": "3.6.1"},
            "3.12": {"torch": "2.13.0", "networkx": "3.7", "six": "1.17.0"},
        }
    )
    assert lines == [
        "networkx==3.6.1 ; python_version == '3.11'",
        "networkx==3.7 ; python_version == '3.12'",
        "six==1.17.0 ; python_version == '3.12'",
        "torch==2.13.0",
    ]


@pytest.mark.slow
def test_the_tested_stack_still_resolves_from_pypi():
    """uv resolves art-sky[gpu] under the constraints file, wheels only, for each Python: every package it picks is
    pinned there at that version (a yanked or deleted release, or a new unpinned dependency, fails here)."""
    resolutions = resolve_all(constraints=LOCK)
    for python, resolved in resolutions.items():
        assert resolved == pins(python), f"Python {python}: the lock and the resolution differ"
    assert len(constraint_lines()) >= len(resolutions["3.12"])


def test_untested_names_each_differing_package():
    tested = pins("3.12")
    good = {name: tested[name] for name in CHECKED["unsloth"]}
    assert untested("unsloth", good, tested) == []
    assert untested("unsloth", good | {"torch": f"{tested['torch']}+cu130"}, tested) == []  # a CUDA build tag
    found = good | {"trl": "0.99.0"}
    del found["unsloth-zoo"]
    assert untested("unsloth", found, tested) == [
        f"unsloth-zoo missing (tested: {tested['unsloth-zoo']})",
        f"trl 0.99.0 (tested: {tested['trl']})",
    ]


def fake_distributions(folder: Path, **versions: str) -> Path:
    """Importable packages with dist-info of these versions (vllm="0.0.1"); only their metadata is real."""
    for name, version in versions.items():
        if name == "vllm":
            (folder / name).mkdir(parents=True)
            (folder / name / "__init__.py").write_text(f"__version__ = {version!r}\n")
        info = folder / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return folder


def test_server_refuses_to_start_vllm_outside_the_tested_stack(tmp_path):
    fakes = fake_distributions(tmp_path / "site", vllm="0.0.1")
    env = os.environ | {
        "PYTHONPATH": str(fakes),
        "ART_SKY_API_KEY": "key",
        "ART_SKY_ENGINE": "vllm",
        "ART_SKY_TRAINER": "peft",
        "ART_SKY_ALLOW_UNTESTED_STACK": "false",
    }
    result = subprocess.run(
        [sys.executable, "-m", "art_sky.cluster", "--port", "0", "--art-path", str(tmp_path / "art")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode != 0
    tested = pins()
    assert f"vllm 0.0.1 (tested: {tested['vllm']})" in result.stderr
    assert "ART_SKY_ALLOW_UNTESTED_STACK=true" in result.stderr
    assert "Traceback" not in result.stderr


def test_health_reports_the_stack_and_the_override_runs_it(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(fake_distributions(tmp_path / "site", vllm="0.0.1")))
    settings = Settings(engine="vllm", trainer="peft")
    with pytest.raises(ConfigError, match=r"vllm 0\.0\.1 \(tested: "):
        create_app(tmp_path / "art", "key", settings)
    with TestClient(
        create_app(tmp_path / "art", "key", settings.model_copy(update={"allow_untested_stack": True})),
        headers=KEY_HEADER,
    ) as client:
        health = client.get("/health").json()
    assert (health["engine"], health["stack"], health["versions"]["vllm"]) == ("vllm", "untested", "0.0.1")
    import torch
    import transformers

    assert health["versions"]["torch"] == torch.__version__
    assert health["versions"]["transformers"] == transformers.__version__


def test_the_tested_versions_start_and_report_tested(tmp_path, monkeypatch):
    tested = pins()
    import torch

    if torch.__version__.split("+")[0] != tested["torch"]:
        pytest.skip(f"this venv's torch {torch.__version__} is not the tested {tested['torch']}")
    monkeypatch.syspath_prepend(
        str(fake_distributions(tmp_path / "site", vllm=tested["vllm"], transformers=tested["transformers"]))
    )
    app = create_app(tmp_path / "art", "key", Settings(engine="vllm", trainer="peft"))
    with TestClient(app, headers=KEY_HEADER) as client:
        health = client.get("/health").json()
    assert health["stack"] == "tested"
    assert health["versions"]["vllm"] == tested["vllm"]


def test_portable_engine_and_peft_are_not_checked(tmp_path):
    app = create_app(tmp_path / "art", "key", Settings(engine="portable", trainer="peft"))
    with TestClient(app, headers=KEY_HEADER) as client:
        health = client.get("/health").json()
    assert health["stack"] == "unchecked"
    assert {"torch", "transformers", "peft"} <= set(health["versions"])
