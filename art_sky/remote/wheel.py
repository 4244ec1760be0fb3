"""The client's own build as a wheel, shipped to the cluster so client and server run the same code.

From a source checkout (an editable install) the wheel is built with pip; from a regular install it is
re-packed from the installed files, so no source and no network are needed.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

import art_sky
from art_sky.errors import ConfigError

from .reasons import reason

DIST_NAME = "art-sky"
_INSTALL_ONLY = (".dist-info/INSTALLER", ".dist-info/REQUESTED", ".dist-info/direct_url.json")


def build_wheel(dest: Path, source: Path | None = None) -> Path:
    """Write a wheel into `dest` and return its path: of the art-sky checkout at `source`, by default of the
    art-sky this process runs."""
    dest.mkdir(parents=True, exist_ok=True)
    source = source or source_checkout()
    return _build_from_source(source, dest) if source else _repack(metadata.distribution(DIST_NAME), dest)


def source_checkout() -> Path | None:
    """The checkout this art_sky is imported from (editable install or run from the repo), if any."""
    root = Path(art_sky.__file__).resolve().parent.parent
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and f'name = "{DIST_NAME}"' in pyproject.read_text():
        return root
    return None


def _build_from_source(source: Path, dest: Path) -> Path:
    """pip's wheel of the checkout: with this environment's setuptools where it has one (no download), else in an
    isolated build environment pip makes (a Python 3.12+ venv has no setuptools)."""
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    with tempfile.TemporaryDirectory(prefix="art-sky-wheel-") as tmp:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", *isolation, "--wheel-dir", tmp, str(source)],
            check=False,
            capture_output=True,
            text=True,
            timeout=300,
        )
        wheels = list(Path(tmp).glob("art_sky-*.whl"))
        if result.returncode != 0 or len(wheels) != 1:
            raise ConfigError(
                f"building the art-sky wheel from {source} failed: {reason(result.stderr) or 'no error written'} "
                f"(the cluster needs this client's build; `pip install 'setuptools>=69'` if it is missing)\n"
                f"{result.stderr[-2000:]}"
            )
        target = dest / wheels[0].name
        wheels[0].replace(target)
    return target


def _repack(dist: metadata.Distribution, dest: Path) -> Path:
    """Zip the installed files listed in RECORD back into a wheel, with a fresh RECORD."""
    files = [f for f in dist.files or [] if not str(f).startswith("..") and "__pycache__" not in str(f)]
    record_name = next((str(f) for f in files if str(f).endswith(".dist-info/RECORD")), None)
    if record_name is None:
        raise ConfigError(f"the installed {DIST_NAME} has no RECORD to re-pack: reinstall it with pip")
    target = dest / f"art_sky-{dist.version}-py3-none-any.whl"
    records = []
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as wheel:
        for file in files:
            name = str(file)
            if name == record_name or name.endswith(_INSTALL_ONLY):
                continue
            data = Path(file.locate()).read_bytes()
            wheel.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            records.append(f"{name},sha256={digest},{len(data)}")
        wheel.writestr(record_name, "\n".join(records + [f"{record_name},,"]) + "\n")
    return target
