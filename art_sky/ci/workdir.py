"""The files of a work dir that a CI job ships, chosen the way SkyPilot's workdir sync chooses them, so a job on
an SSH host sees the same tree as one on a SkyPilot cluster: `.skyignore` when there is one, else `.gitignore`
(`git ls-files`, so `.git` itself stays home), else everything.
"""

from __future__ import annotations

import glob
import os
import subprocess
import tarfile
from pathlib import Path

from art_sky.errors import ConfigError

SKYIGNORE = ".skyignore"


def files_to_sync(workdir: Path) -> list[str]:
    """Paths relative to `workdir`, sorted."""
    if not workdir.is_dir():
        raise ConfigError(f"the work dir {workdir} is not a directory: pass --workdir with your project's root")
    if (workdir / SKYIGNORE).is_file():
        return _minus_skyignore(workdir)
    listed = _git_files(workdir)
    return listed if listed is not None else sorted(_walk(workdir))


def pack(workdir: Path, dest: Path) -> Path:
    """A gzipped tar of `files_to_sync(workdir)` at `dest` (one upload instead of one per file)."""
    with tarfile.open(dest, "w:gz") as tar:
        for name in files_to_sync(workdir):
            tar.add(workdir / name, arcname=name, recursive=False)
    return dest


def _git_files(workdir: Path) -> list[str] | None:
    """Tracked and untracked-but-not-ignored files, or None outside a git work tree (or without git)."""
    try:
        result = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=workdir, capture_output=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    names = {n for n in result.stdout.decode().split("\0") if n}
    return sorted(n for n in names if (workdir / n).is_file())  # a deleted tracked file is still listed


def _walk(workdir: Path) -> set[str]:
    found: set[str] = set()
    for root, _, files in os.walk(workdir):
        found.update(os.path.relpath(os.path.join(root, f), workdir) for f in files)
    return found


def _minus_skyignore(workdir: Path) -> list[str]:
    """SkyPilot's reading of .skyignore: `/x` anchors at the root, any other pattern matches at any depth; a
    matched directory excludes what is under it."""
    excluded: set[str] = set()
    for line in (workdir / SKYIGNORE).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        pattern = "." + line if line.startswith("/") else "**/" + line
        excluded.update(os.path.relpath(m, workdir) for m in glob.glob(str(workdir / pattern), recursive=True))
    return sorted(f for f in _walk(workdir) if not any(f == e or f.startswith(e.rstrip("/") + "/") for e in excluded))
