"""The wheel shipped to clusters: built from a checkout, or re-packed from a regular install."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from art_sky.remote.wheel import build_wheel


def test_checkout_build_and_repack_of_an_install_hold_the_same_files(tmp_path):
    built = build_wheel(tmp_path / "built")
    names = set(zipfile.ZipFile(built).namelist())
    assert {"art_sky/remote/ssh.py", "art_sky/cluster/server.py", "art_sky/client/model.py"} <= names

    # A regular (non-editable) install, as from PyPI: no source tree next to the package.
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(built)],
        check=True,
        timeout=300,
    )
    script = (
        "import sys, art_sky; from pathlib import Path; from art_sky.remote.wheel import build_wheel; "
        f"assert art_sky.__file__.startswith({str(site)!r}), art_sky.__file__; "
        "print(build_wheel(Path(sys.argv[1])))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "repacked")],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin"},
    )
    assert result.returncode == 0, result.stderr
    repacked = Path(result.stdout.strip())
    assert set(zipfile.ZipFile(repacked).namelist()) == names

    reinstalled = tmp_path / "reinstalled"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(reinstalled), str(repacked)],
        check=True,
        timeout=300,
    )
    assert (reinstalled / "art_sky" / "cluster" / "server.py").read_bytes() == (
        site / "art_sky" / "cluster" / "server.py"
    ).read_bytes()


def test_a_named_source_checkout_is_built_as_it_is(tmp_path):
    """`initialize_cluster(art_sky_version=<checkout>)` ships a wheel built from that checkout, not this client."""
    from art_sky.backends.skypilot import _version_or_source

    checkout = tmp_path / "checkout"
    repo = Path(__file__).resolve().parent.parent
    subprocess.run(
        ["git", "-C", str(repo), "worktree", "add", "--detach", str(checkout)],
        check=True,
        timeout=60,
        capture_output=True,
    )
    try:
        marker = "# built from the named checkout\n"
        (checkout / "art_sky" / "errors.py").write_text((checkout / "art_sky" / "errors.py").read_text() + marker)
        assert _version_or_source(str(checkout)) == (None, checkout)
        wheel = build_wheel(tmp_path / "dist", source=checkout)
        assert marker in zipfile.ZipFile(wheel).read("art_sky/errors.py").decode()
    finally:
        subprocess.run(
            ["git", "-C", str(repo), "worktree", "remove", "--force", str(checkout)], timeout=60, capture_output=True
        )
