"""The wheel shipped to clusters: built from a checkout, or re-packed from a regular install."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from art_sky.wheel import build_wheel


def test_checkout_build_and_repack_of_an_install_hold_the_same_files(tmp_path):
    built = build_wheel(tmp_path / "built")
    names = set(zipfile.ZipFile(built).namelist())
    assert {"art_sky/ssh.py", "art_sky/cluster/server.py", "art_sky/client/model.py"} <= names

    # A regular (non-editable) install, as from PyPI: no source tree next to the package.
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(built)],
                   check=True, timeout=300)
    script = ("import sys, art_sky; from pathlib import Path; from art_sky.wheel import build_wheel; "
              f"assert art_sky.__file__.startswith({str(site)!r}), art_sky.__file__; "
              "print(build_wheel(Path(sys.argv[1])))")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "repacked")], check=False,
                            capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            env={"PYTHONPATH": str(site), "PATH": "/usr/bin"})
    assert result.returncode == 0, result.stderr
    repacked = Path(result.stdout.strip())
    assert set(zipfile.ZipFile(repacked).namelist()) == names

    reinstalled = tmp_path / "reinstalled"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(reinstalled),
                    str(repacked)], check=True, timeout=300)
    assert (reinstalled / "art_sky" / "cluster" / "server.py").read_bytes() == \
        (site / "art_sky" / "cluster" / "server.py").read_bytes()
