"""Every Python block the docs and the README mark `<!-- docs: run -->` runs here (tests/doc_blocks.py finds them,
docs/development.md states the convention): a whole program (`asyncio.run(...)`) as a script in a directory of its
own; a page's other blocks in order, in one namespace per page, with top-level await and these names: `art`
(art_sky), `asyncio`, `backend` (a LocalBackend shared by the pages), `model` (a fresh TrainableModel on
art-sky/tiny, registered) and `rollout` (the README example's)."""

from __future__ import annotations

import ast
import asyncio
import inspect
import subprocess
import sys
from collections import defaultdict

import pytest
from doc_blocks import ROOT, Block, all_blocks

import art_sky as art

RUN = [block for block in all_blocks() if block.runs]
PROGRAMS = [block for block in RUN if block.is_program]
PAGES: dict[str, list[Block]] = defaultdict(list)
for _block in RUN:
    if not _block.is_program:
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
