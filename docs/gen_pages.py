"""Pages made at build time (mkdocs-gen-files runs this): the reference pages' generated parts (docs/
reference_pages.py) appended to their hand-written introductions, the repository files the pages link to, and the
package laid out as it installs for mkdocstrings."""

import json
import sys
from pathlib import Path

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs"))

import reference_pages  # noqa: E402 (docs/ is not a package)

# Raw benchmark results and the templates the guides link to, published under files/ as the repository has them.
PUBLISHED = ["bench/results/*", "templates/*.yaml", "templates/*.yml", "templates/*.txt"]

for pattern in PUBLISHED:
    for path in sorted(ROOT.glob(pattern)):
        with mkdocs_gen_files.open(f"files/{path.relative_to(ROOT).as_posix()}", "wb") as out:
            out.write(path.read_bytes())

# The package as it installs, for mkdocstrings (mkdocs.yml `paths`): client/ and cluster/ are art_sky.client and
# art_sky.cluster (pyproject's package-dir), which griffe cannot read from the source tree's layout.
API_TREE = ROOT / "build" / "docs-api" / "art_sky"
API_TREE.mkdir(parents=True, exist_ok=True)
for source in [*sorted((ROOT / "art_sky").iterdir()), ROOT / "client", ROOT / "cluster"]:
    link = API_TREE / source.name
    if source.name != "__pycache__" and not link.is_symlink():
        link.symlink_to(source)

document = reference_pages.openapi_document()
with mkdocs_gen_files.open("reference/openapi.json", "w") as out:
    json.dump(document, out, indent=2)

for page, text in (("reference/settings.md", reference_pages.settings_markdown()),
                   ("reference/cli.md", reference_pages.cli_markdown()),
                   ("reference/http-api.md", reference_pages.http_markdown(document)),
                   ("reference/python-api.md", reference_pages.python_api_markdown())):
    with mkdocs_gen_files.open(page, "a") as out:
        out.write("\n" + text)
