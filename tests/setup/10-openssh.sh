#!/usr/bin/env bash
# OpenSSH server for the SSH tests (tests/sshd.py starts its own sshd on 127.0.0.1; nothing is started here).
# A policy-rc.d that exits 101 keeps the package scripts from starting a system sshd.
set -euo pipefail
if [ -x /usr/sbin/sshd ] && [ -x /usr/lib/openssh/sftp-server ] && command -v ssh-keygen >/dev/null; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
  chmod +x /usr/sbin/policy-rc.d
fi
apt-get update -qq
apt-get install -y -qq --no-install-recommends openssh-server openssh-client openssh-sftp-server >/dev/null
