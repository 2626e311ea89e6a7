#!/bin/bash
# gyre-hpc head job: a heterogeneous job. Component 0 runs this script, then the
# supervisor (python) and the fleet's controller rank; components 1..N hold one cell each.
# Shape: cells.count=3 ranks_per_cell=1 nodes_per_cell=1 cpus_per_rank=1.
# Another shape: `gyre-hpc submit --sbatch CONFIG` writes and submits a matching script.
# Usage: sbatch sbatch/gyre_head.sh CONFIG.yaml [--set key=value ...]
#SBATCH --job-name=gyre-head
#SBATCH --time=60
#SBATCH --requeue
#SBATCH --signal=B:USR2@120
#SBATCH --open-mode=append
#SBATCH --output=gyre-head-%j.out
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
#SBATCH hetjob
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
#SBATCH hetjob
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
#SBATCH hetjob
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: sbatch $0 CONFIG.yaml [--set key=value ...]" >&2
  exit 2
fi
# The submit directory's virtual environment unless GYRE_PYTHON names another python.
PY="${GYRE_PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x "${SLURM_SUBMIT_DIR:-.}/.venv/bin/python" ]; then PY="${SLURM_SUBMIT_DIR:-.}/.venv/bin/python"; else PY=python3; fi
fi
# Say which python, and stop with a way out when it lacks the project (not a bare
# ModuleNotFoundError from deep inside the head).
echo "gyre head: python $PY (GYRE_PYTHON=${GYRE_PYTHON:-unset}, submit dir ${SLURM_SUBMIT_DIR:-.})"
if ! "$PY" -c "import gyre_hpc, h5py" 2>/dev/null; then
  echo "gyre head: $PY cannot import gyre_hpc and its dependencies; submit from the project directory (its .venv) or set GYRE_PYTHON=/path/to/venv/bin/python (sbatch --export=ALL,GYRE_PYTHON=...)" >&2
  exit 2
fi
# USR2 is ignored until python installs its handler (which replaces the ignore): Slurm
# has been seen to send a requeued job its time-limit warning the moment it restarts, and
# the default action killed the head before it could resume (job FAILED, JobLaunchFailure).
trap '' USR2
# exec, not a child: USR2 and SIGTERM must reach the supervisor itself.
exec "$PY" -m gyre_hpc.jobs.head "$@"
