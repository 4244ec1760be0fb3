#!/usr/bin/env bash
# Debian's chromium for the dashboard's browser test (tests/test_dashboard.py drives it with Playwright, from the
# [dev] extra): `playwright install` downloads its own browsers, which these machines cannot.
set -euo pipefail
if command -v chromium >/dev/null; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium >/dev/null
