"""Every Python block the docs and the README mark `<!-- docs: run -->` runs here (tests/doc_blocks.py finds them,
docs/development.md states the convention): a whole program (`asyncio.run(...)`) as a script in a directory of its
own (one marked `run with cluster NAME` against `art-sky up NAME --local`, as the page's dry run); a page's other
blocks in order, in one namespace per page, with top-level await and these names: `art` (art_sky), `asyncio`,
`backend` (a LocalBackend shared by the pages), `model` (a fresh TrainableModel on art-sky/tiny, registered) and
`rollout` (the README example's)."""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest
from doc_blocks import ROOT, Block, all_blocks

import art_sky as art

RUN = [block for block in all_blocks() if block.runs]
PROGRAMS = [block for block in RUN if block.is_program and block.cluster is None]
CLUSTER_PROGRAMS = [block for block in RUN if block.cluster is not None]
PAGES: dict[str, list[Block]] = defaultdict(list)
for _block in RUN:
    if not _block.is_program and _block.cluster is None:
        PAGES[str(_block.path.relative_to(ROOT))].append(_block)


def readme_rollout():
    """The README example's rollout function, for the pages that say they use it."""
    program = next(block for block in PROGRAMS if block.path.name == "README.md")
    namespace: dict = {}
    exec(compile(program.code.replace("asyncio.run(main())", ""), program.where, "exec"), namespace)
    return namespace["rollout"]


@pytest.mark.slow
@pytest.mark.parametrize("block", PROGRAMS, ids=lambda block: block.where)
def test_a_documented_program_runs(block, tmp_path):
    (tmp_path / "example.py").write_text(block.code)
    result = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{block.where} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("block", CLUSTER_PROGRAMS, ids=lambda block: block.where)
def test_a_documented_cluster_program_runs_on_a_local_cluster(block, tmp_path):
    """As the page's dry run: `art-sky up NAME --local`, the program with the tiny model for two steps, `down`."""
    env = os.environ | {"ART_SKY_HOME": str(tmp_path / "home"), "BASE_MODEL": "art-sky/tiny", "STEPS": "2"}
    env.pop("ART_SKY_API_KEY", None)
    (tmp_path / "program.py").write_text(block.code)

    def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "art_sky.cli", *args]
        return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)

    up = cli("up", block.cluster, "--local", "--path", str(tmp_path / ".art"))
    assert up.returncode == 0, f"art-sky up {block.cluster} --local failed:\n{up.stdout}\n{up.stderr[-3000:]}"
    try:
        run = subprocess.run(
            [sys.executable, "program.py", block.cluster],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, f"{block.where} failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
        status = cli("status", block.cluster, "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        steps = {model["name"]: model["step"] for model in json.loads(status.stdout)[0]["models"]}
        assert steps and min(steps.values()) == 2, f"the cluster's models after STEPS=2: {steps}"
    finally:
        down = cli("down", block.cluster, "--force")
    assert down.returncode == 0, down.stdout + down.stderr


@pytest.fixture(scope="module")
async def backend(tmp_path_factory):
    backend = art.LocalBackend(path=tmp_path_factory.mktemp("art"))
    yield backend
    await backend.close()


@pytest.mark.slow
@pytest.mark.parametrize("page", sorted(PAGES))
async def test_a_pages_examples_run_in_order(page, backend):
    model = art.TrainableModel(
        name=page.rsplit("/", 1)[-1].removesuffix(".md"), project="docs", base_model="art-sky/tiny"
    )
    await model.register(backend)
    namespace = {"art": art, "asyncio": asyncio, "backend": backend, "model": model, "rollout": readme_rollout()}
    for block in PAGES[page]:
        result = eval(compile(block.code, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT), namespace)
        if inspect.iscoroutine(result):
            await result
