"""The documentation site builds with `mkdocs build --strict` (a broken link, a missing page or anchor fails it), and
its reference pages come from the code: every setting, CLI command, route, message and public name reaches the
built site, so none can go undocumented. Every Python block of the docs and the README says whether it runs
(tests/test_docs_examples.py) or why not."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from html import unescape

import pytest
from doc_blocks import MARKER, ROOT, all_blocks, documents

sys.path.insert(0, str(ROOT / "docs"))
import reference_pages

from art_sky.settings import NOT_SETTINGS  # ART_SKY_* names art-sky uses that are not settings


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site as CI builds it: `mkdocs build --strict` into a temporary directory."""
    out = tmp_path_factory.mktemp("site")
    quiet = {"DISABLE_MKDOCS_2_WARNING": "true", "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | quiet,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return out


def text(site, page: str) -> str:
    """A built page's text, tags stripped."""
    return unescape(re.sub(r"<[^>]+>", "", (site / page).read_text()))


@pytest.mark.slow
def test_the_site_builds_with_the_readme_and_architecture_included(site):
    home = text(site, "index.html")
    assert 'pip install "torch==2.13.0" -e ".[cluster]" && art-sky demo' in home, "the README's quickstart"
    assert "ART ServerlessBackend" in home, "the README's feature table"
    assert "Data flows one way" in text(site, "architecture.html"), "ARCHITECTURE.md"
    assert (site / "files" / "bench" / "results" / "trainer-qwen2-0.5b.json").is_file(), "raw benchmark results"


@pytest.mark.slow
def test_every_setting_is_on_the_settings_page(site):
    from art_sky.settings import Settings

    html = (site / "reference" / "settings.html").read_text()
    rows = {
        tuple(re.findall(r"<code>(.*?)</code>", first)): unescape(re.sub(r"<[^>]+>", "", rest))
        for first, rest in re.findall(r"<tr>\s*<td>(.*?)</td>(.*?)</tr>", html, re.S)
    }
    for name, field in Settings.model_fields.items():
        variables = tuple(reference_pages.setting_names(name, field))
        assert variables in rows, f"{variables} has no row on the settings page"
        assert " ".join(field.description.split()) in " ".join(rows[variables].split()), f"{name}'s description"


@pytest.mark.slow
def test_every_command_is_on_the_cli_page(site):
    headings = re.findall(r"<h[2-6][^>]*>(.*?)</h[2-6]>", (site / "reference" / "cli.html").read_text())
    titles = {unescape(re.sub(r"<[^>]+>", "", h)).rstrip("¶").strip() for h in headings}
    commands = reference_pages.cli_commands()
    assert "art-sky checkpoints ls" in commands and "art-sky ci run" in commands
    missing = [c for c in commands[1:] if c not in titles]
    assert not missing, f"commands without a section on the CLI page: {missing}"


@pytest.mark.slow
def test_every_route_and_message_is_on_the_http_api_page(site):
    document = reference_pages.openapi_document()
    page = text(site, "reference/http-api.html")
    for path, operations in document["paths"].items():
        for method in operations:
            assert f"{method.upper()} {path}" in page, f"{method.upper()} {path} is not on the HTTP API page"
    for model in document["components"]["schemas"]:
        assert re.search(rf"^{model}¶?$", page, re.M), f"the message {model} is not on the HTTP API page"


@pytest.mark.slow
def test_every_public_name_is_on_the_python_api_page(site):
    page = (site / "reference" / "python-api.html").read_text()
    for name in reference_pages.public_names():
        assert f'id="art_sky.{name}"' in page, f"art_sky.{name} is not on the Python API page"


def test_every_python_block_runs_or_says_why():
    unmarked = [b.where for b in all_blocks() if not MARKER.fullmatch(b.marker.strip())]
    assert not unmarked, (
        "a ```python block needs `<!-- docs: run -->` or `<!-- docs: illustration: REASON -->` on "
        f"the line above it (docs/development.md): {unmarked}"
    )
    assert any(b.runs for b in all_blocks())


def test_every_art_sky_variable_the_docs_name_is_a_setting():
    from art_sky.settings import Settings

    settings = {v for n, f in Settings.model_fields.items() for v in reference_pages.setting_names(n, f)}
    named = {
        v
        for path in [*documents(), ROOT / "ARCHITECTURE.md"]
        for v in re.findall(r"ART_SKY_[A-Z_]+\b", path.read_text())
    }
    unknown = sorted(named - settings - NOT_SETTINGS)
    assert not unknown, f"the docs name settings that art_sky/settings.py does not have: {unknown}"
