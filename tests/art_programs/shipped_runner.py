"""Run one of openpipe-art's own shipped tests (a file of its wheel's `art/test/`), unchanged, on art-sky: only the
backend it imports, `art.local.LocalBackend`, is swapped for art-sky's, whose server runs on the Python and with the
environment given. Usage: shipped_runner.py TEST_FILE SERVER_PYTHON SERVER_ENV_JSON
"""

import json
import runpy
import sys
import types

import art

import art_sky

test_file, server_python, server_env = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])


class LocalBackend(art_sky.LocalBackend):
    """ART's `LocalBackend(path=...)`, as ART's tests construct it."""

    def __init__(self, path: str = ".art", **kwargs):
        super().__init__(path=path, python=server_python, env=server_env, **kwargs)


swapped = types.ModuleType("art.local")
swapped.LocalBackend = LocalBackend
sys.modules["art.local"] = swapped
art.local = swapped
runpy.run_path(test_file, run_name="__main__")
