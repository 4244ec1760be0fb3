"""Pages made at build time (mkdocs-gen-files runs this): the repository files the pages link to."""

from pathlib import Path

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parent.parent
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


def python_api() -> str:
    """The public names (`art_sky.__all__`), each rendered by mkdocstrings from its docstrings."""
    import art_sky

    names = sorted((n for n in art_sky.__all__ if not n.startswith("_")), key=lambda n: (n[0].islower(), n))
    return "".join(f"\n::: art_sky.{name}\n" for name in names)


with mkdocs_gen_files.open("reference/python-api.md", "a") as page:
    page.write(python_api())
