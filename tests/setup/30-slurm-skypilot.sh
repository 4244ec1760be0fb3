#!/usr/bin/env bash
# Static parts of the local Slurm + SkyPilot test bed (see tests/slurm_harness.py, which starts the daemons):
# sshd, munge, Slurm, rsync from Debian, and iproute2 + iptables for the two nodes in network namespaces (their
# bridge and NAT); SkyPilot's Slurm client and a PyPI `uv` for the cluster tasks.
# Idempotent and quiet; root on Debian bookworm.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
need=()
for bin in sshd slurmctld slurmd sinfo munged rsync ip iptables; do
  command -v "$bin" >/dev/null || [ -x "/usr/sbin/$bin" ] || need+=("$bin")
done
if [ ${#need[@]} -gt 0 ]; then
  # Package scripts must not start services here: the harness starts them with its own configuration.
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends openssh-server slurmctld slurmd slurm-client munge rsync \
    iproute2 iptables >/dev/null
fi
# `uv` is copied onto the "nodes". SkyPilot goes into its own environment, as art-sky makes it for a user
# (art_sky/provisioners/sky_env.py: skypilot[slurm]==0.14.1, the release the harness was measured with), not into
# the test environment, whose `pip check` stays clean.
python -m pip install -q uv
python -m art_sky.provisioners.sky_env >/dev/null
