"""The documentation site builds with `mkdocs build --strict` (a broken link, a missing page or anchor fails it), and
its reference pages come from the code: every setting, CLI command, route, message and public name reaches the
built site, so none can go undocumented. Every Python block of the docs and the README says whether it runs
(tests/test_docs_examples.py) or why not."""

from __future__ import annotations

import inspect
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


def _config_models() -> dict:
    """The models a user writes or passes, by their anchor on the Python API page (loaded when a test asks)."""

    def load(module: str, name: str):
        return lambda: getattr(__import__(module, fromlist=[name]), name)

    return {
        "art_sky.TrainConfig": load("art_sky.wire", "TrainConfig"),
        "art_sky.ModelConfig": load("art_sky.wire", "ModelConfig"),
        "art_sky.TrainSFTConfig": load("art_sky.wire", "TrainSFTConfig"),
        "art_sky.TrainableModel": load("art_sky.client", "TrainableModel"),
        "art_sky.Model": load("art_sky.client", "Model"),
        "art_sky.Trajectory": load("art_sky.client", "Trajectory"),
        "art_sky.TrajectoryGroup": load("art_sky.client", "TrajectoryGroup"),
        "art_sky.BootstrapOptions": load("art_sky.remote.install", "BootstrapOptions"),
        "art_sky.settings.Settings": load("art_sky.settings", "Settings"),
    }


CONFIG_MODELS = _config_models()


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


def api_ids(name: str) -> set[str]:
    """The anchors mkdocstrings may give public name `name`: art_sky.NAME, or the path of what it is at run time (a
    name whose module shares it, as `pipeline`, is documented where it is defined)."""
    import art_sky

    obj = getattr(art_sky, name)
    real = obj.__name__ if inspect.ismodule(obj) else f"{obj.__module__}.{obj.__qualname__}"
    return {f"art_sky.{name}", real}


@pytest.mark.slow
def test_every_public_name_is_on_the_python_api_page(site):
    page = (site / "reference" / "python-api.html").read_text()
    for name in reference_pages.public_names():
        assert any(f'id="{i}"' in page for i in api_ids(name)), f"art_sky.{name} is not on the Python API page"


def model_rows(html: str, anchor: str) -> dict[str, list[str]]:
    """A pydantic model's field table on the Python API page (docs/templates/python/material): field -> its cells
    (name, type, default, description) as text."""
    rows = re.findall(rf'<tr id="{re.escape(anchor)}\.(\w+)">(.*?)</tr>', html, re.S)
    return {
        field: [
            " ".join(unescape(re.sub(r"<[^>]+>", "", cell)).split())
            for cell in re.findall(r"<td>(.*?)</td>", row, re.S)
        ]
        for field, row in rows
    }


@pytest.mark.slow
@pytest.mark.parametrize("anchor", sorted(CONFIG_MODELS))
def test_every_field_of_a_config_model_is_on_the_python_api_page(site, anchor):
    """Each field's row has its name, type, default and description, as pydantic has them."""
    rows = model_rows((site / "reference" / "python-api.html").read_text(), anchor)
    model = CONFIG_MODELS[anchor]()
    assert set(rows) == set(model.model_fields), f"{anchor}: fields {set(model.model_fields)} vs rows {set(rows)}"
    for field, info in model.model_fields.items():
        name, kind, default, description = rows[field]
        assert name == field and kind, rows[field]
        assert " ".join(info.description.replace("`", "").split()) == description, (field, description)
        if info.is_required():
            assert default == "required", (field, default)
        elif info.default_factory is not None:
            assert default.endswith("()"), (field, default)
        elif isinstance(info.default, bool | int | float | str | None):  # as written in the code: 5e-6, 64 * 1024
            assert eval(default) == info.default, (field, default)
    if anchor == "art_sky.TrainConfig":
        assert rows["learning_rate"][:3] == ["learning_rate", "float, > 0, ≤ 1", "5e-06"], rows["learning_rate"]


def test_every_field_of_a_config_model_says_what_it_is():
    """The descriptions the page shows are the code's: a field added without one fails here, not on a reader."""
    missing = [
        f"{anchor}.{field}"
        for anchor, model in CONFIG_MODELS.items()
        for field, info in model().model_fields.items()
        if not (info.description or "").strip()
    ]
    assert not missing, f"fields without a description (Field(description=...)): {missing}"


def test_the_documented_signatures_are_the_real_ones():
    """What IDEs and the reference show: each field a keyword of its own, not `**fields: Any`; initialize_cluster's
    keywords are for_cluster's, which it passes on."""
    import art_sky
    from art_sky.backends.skypilot import SkyPilotBackend

    for name in ("TrainableModel", "Model", "TrainConfig", "ModelConfig", "BootstrapOptions"):
        parameters = inspect.signature(getattr(art_sky, name)).parameters
        assert all(p.kind is not p.VAR_KEYWORD for p in parameters.values()), (
            f"{name}{inspect.signature(getattr(art_sky, name))}"
        )
    assert "base_model" in inspect.signature(art_sky.TrainableModel).parameters
    launched = inspect.signature(SkyPilotBackend.initialize_cluster).parameters
    built = inspect.signature(SkyPilotBackend.for_cluster).parameters
    assert [(p.name, p.default, p.annotation) for p in launched.values()] == [
        (p.name, p.default, p.annotation) for p in built.values()
    ]
    model = art_sky.TrainableModel(name="m", project="p", base_model="art-sky/tiny", _internal_config={"peft_args": {}})
    assert model._internal_config == {"peft_args": {}}, "ART's _internal_config= is still taken"


@pytest.mark.slow
def test_the_python_api_page_shows_the_signatures(site):
    page = text(site, "reference/python-api.html")
    assert "base_model: str" in page and "**fields" not in page and "**arguments" not in page
    assert re.search(r"initialize_cluster\(\s*\*,\s*cluster_name: str,\s*gpu: str \| list\[str\] \| None", page)


@pytest.mark.slow
def test_no_table_shows_an_escaped_pipe(site):
    """Python-Markdown keeps a `|` inside a code span in a table cell; a `\\|` there is printed as it is."""
    shown = [p.relative_to(site) for p in site.rglob("*.html") if "\\|" in text(site, str(p.relative_to(site)))]
    assert not shown, f"pages that show a literal \\|: {shown}"


@pytest.mark.slow
def test_code_wraps_instead_of_being_clipped(site):
    """Every page loads docs/stylesheets/extra.css, whose rules wrap the lines of every code block and scroll
    captured output (```text) with a scrollbar always drawn."""
    css = (site / "stylesheets" / "extra.css").read_text()
    rule = re.search(r"\.md-typeset pre > code \{([^}]*)\}", css)
    assert rule and "white-space: pre-wrap" in rule[1] and "overflow-wrap: anywhere" in rule[1], css
    output = re.search(r"\.md-typeset \.language-text pre > code \{([^}]*)\}", css)  # captured output scrolls
    assert output and "white-space: pre;" in output[1] and "overflow-x: auto" in output[1], css
    for page in site.rglob("*.html"):
        assert re.search(r'<link rel="stylesheet" href="(/|(\.\./)*)stylesheets/extra\.css', page.read_text()), page


@pytest.mark.slow
def test_the_static_site_searches_offline(site):
    """Opened from disk, search runs its worker through iframe-worker's shim: the copy in the site, never a CDN."""
    assert (site / "search" / "search_index.js").is_file(), "the offline plugin's inlined index"
    assert "window.Worker=" in (site / "assets" / "javascripts" / "iframe-worker-shim.js").read_text()
    for page in site.rglob("*.html"):
        html = page.read_text()
        assert "unpkg.com" not in html, f"{page} loads a script from unpkg.com"
        assert re.search(r'<script src="(/|(\.\./)*)assets/javascripts/iframe-worker-shim\.js"', html), page


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
