#!/usr/bin/env bash
# The newest end of the supported ART range: a clean Python 3.12 venv (.venv-art in the repo root) with only
# `pip install -e ".[art]"`, as a user's laptop has it (openpipe-art 0.5.20+ needs Python >= 3.12). tests/
# test_openpipe_art.py runs ART 0.5.23 programs from it against servers on the test venv's Python. Where no Python
# 3.12 is found (pyenv's, or python3.12 on PATH), nothing is made and those tests skip saying why. Idempotent:
# remade when pyproject.toml changed or the checkout moved.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venv-art
STAMP="$VENV/.art-sky-$(sha256sum pyproject.toml | cut -c1-16)"
python312=""
for candidate in "$(pyenv root 2>/dev/null)"/versions/3.12.*/bin/python3.12 "$(command -v python3.12 || true)"; do
  if [ -x "$candidate" ]; then python312="$candidate"; break; fi
done
if [ -z "$python312" ]; then
  echo "no Python 3.12 here: the ART 0.5.20+ tests will skip"
  exit 0
fi
installed=$("$VENV/bin/python" -c "import art_sky, pathlib; print(pathlib.Path(art_sky.__file__).parent.parent)" \
            2>/dev/null || true)
if [ ! -f "$STAMP" ] || [ "$installed" != "$PWD" ]; then
  rm -rf "$VENV"
  "$python312" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e ".[art]"
  touch "$STAMP"
fi
"$VENV/bin/python" -c "import importlib.metadata as m; print('openpipe-art', m.version('openpipe-art'), 'ready in $VENV')"
