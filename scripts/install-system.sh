#!/usr/bin/env bash
# System packages the tests need: Slurm 22.05 daemons and clients, munge, PMIx and Open MPI
# from Debian, and Debian's Chromium for the report page's browser test. Run explicitly (the
# test command does); `gyre-hpc cluster up` never installs anything itself, it only says what
# is missing.
#   scripts/install-system.sh        everything the test suite needs
#   scripts/install-system.sh mpi    only Open MPI (what `make run`'s local launcher needs)
set -euo pipefail
pkgs=(openmpi-bin libopenmpi-dev)
# chromium: the report page's browser test (gyre-hpc report).
[ "${1:-all}" = mpi ] || pkgs+=(slurmctld slurmd slurm-client munge libpmix2 libpmix-dev chromium)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then echo "system packages: all present"; exit 0; fi
echo "system packages missing: ${missing[*]}"
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
# Debian starts munge/slurm services on install where systemd runs; the cluster command
# manages its own daemons, so stop any the package scripts started.
for svc in slurmctld slurmd munge; do $SUDO pkill -x "$svc" 2>/dev/null || true; done
