"""MkDocs hooks (mkdocs.yml `hooks`): what the site generates from the code when it is built. The settings, CLI and
HTTP reference pages' generated parts (docs/reference_pages.py) are appended to their hand-written introductions;
the repository files the pages link to are published under files/; the package is laid out as it installs, for
mkdocstrings (which renders the Python API page's `:::` entries itself)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs"))

import reference_pages  # noqa: E402 (docs/ is not a package)

# Raw benchmark results and the templates the guides link to, published under files/ as the repository has them.
PUBLISHED = ["bench/results/*", "templates/*.yaml", "templates/*.yml", "templates/*.txt"]
# The package as it installs, for mkdocstrings (mkdocs.yml `paths`): client/ and cluster/ are art_sky.client and
# art_sky.cluster (pyproject's package-dir), which griffe cannot read from the source tree's layout.
API_TREE = ROOT / "build" / "docs-api" / "art_sky"
GENERATED = {
    "reference/settings.md": reference_pages.settings_markdown,
    "reference/cli.md": reference_pages.cli_markdown,
}
openapi: dict = {}


def on_startup(command: str, dirty: bool) -> None:
    """Before mkdocstrings looks for the package (its `paths` must exist by then)."""
    API_TREE.mkdir(parents=True, exist_ok=True)
    for source in [*sorted((ROOT / "art_sky").iterdir()), ROOT / "client", ROOT / "cluster"]:
        link = API_TREE / source.name
        if source.name != "__pycache__" and not link.is_symlink():
            link.symlink_to(source)


def on_files(files, config):
    openapi.clear()
    openapi.update(reference_pages.openapi_document())
    files.append(File.generated(config, "reference/openapi.json", content=json.dumps(openapi, indent=2)))
    for pattern in PUBLISHED:
        for path in sorted(ROOT.glob(pattern)):
            files.append(
                File.generated(config, f"files/{path.relative_to(ROOT).as_posix()}", content=path.read_bytes())
            )
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == "reference/http-api.md":
        return f"{markdown}\n{reference_pages.http_markdown(openapi)}"
    if page.file.src_uri in GENERATED:
        return f"{markdown}\n{GENERATED[page.file.src_uri]()}"
    return markdown
