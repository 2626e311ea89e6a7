"""The sbatch script of the head job, generated from the config.

Why generated: ``#SBATCH`` lines are static, and a het job needs one component per cell, so
the shape lives in the script. ``sbatch/gyre_head.sh`` is this generator's output for the
default shape (examples/smoke.yaml: 3 cells); a test holds the two equal, as submitit checks
its scripts against a recorded file. ``gyre-hpc submit --sbatch`` writes a script for any
other shape into the run directory and submits that.
"""
from __future__ import annotations

import shlex

from gyre_hpc.config import RunConfig
from gyre_hpc.jobs.plan import het_job_shape


def render_head_script(cfg: RunConfig, job_name: str | None = None, output: str = "gyre-head-%j.out") -> str:
    shape = het_job_shape(cfg)
    c = cfg.cells
    lines = [
        "#!/bin/bash",
        "# gyre-hpc head job: a heterogeneous job. Component 0 runs this script, then the",
        "# supervisor (python) and the fleet's controller rank; components 1..N hold one cell each.",
        f"# Shape: cells.count={c.count} ranks_per_cell={c.ranks_per_cell} nodes_per_cell={c.nodes_per_cell} "
        f"cpus_per_rank={c.cpus_per_rank}.",
        "# Another shape: `gyre-hpc submit --sbatch CONFIG` writes and submits a matching script.",
        "# Usage: sbatch sbatch/gyre_head.sh CONFIG.yaml [--set key=value ...]",
        f"#SBATCH --job-name={shlex.quote(job_name or cfg.name)}",
        f"#SBATCH --time={cfg.slurm.time_min}",
        "#SBATCH --requeue",
        # B: the signal goes to the batch shell, which exec's python: the supervisor gets it.
        f"#SBATCH --signal=B:USR2@{cfg.slurm.signal_s}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={output}",
    ]
    if cfg.slurm.partition:
        lines.append(f"#SBATCH --partition={cfg.slurm.partition}")
    if cfg.slurm.account:
        lines.append(f"#SBATCH --account={cfg.slurm.account}")
    lines += [f"#SBATCH {arg}" for arg in cfg.slurm.extra_args]
    for g, (nodes, ntasks, cpus) in enumerate(shape):
        if g:
            lines.append("#SBATCH hetjob")
        lines += [f"#SBATCH --nodes={nodes}", f"#SBATCH --ntasks={ntasks}", f"#SBATCH --cpus-per-task={cpus}"]
        if g and c.mem_per_cell_mb:
            lines.append(f"#SBATCH --mem={c.mem_per_cell_mb}M")
    lines += [
        "set -euo pipefail",
        'if [ $# -lt 1 ]; then',
        '  echo "usage: sbatch $0 CONFIG.yaml [--set key=value ...]" >&2',
        "  exit 2",
        "fi",
        "# The submit directory's virtual environment unless GYRE_PYTHON names another python.",
        'PY="${GYRE_PYTHON:-}"',
        'if [ -z "$PY" ]; then',
        '  if [ -x "${SLURM_SUBMIT_DIR:-.}/.venv/bin/python" ]; then PY="${SLURM_SUBMIT_DIR:-.}/.venv/bin/python"; '
        'else PY=python3; fi',
        "fi",
        '# Say which python, and stop with a way out when it lacks the project (not a bare',
        "# ModuleNotFoundError from deep inside the head).",
        'echo "gyre head: python $PY (GYRE_PYTHON=${GYRE_PYTHON:-unset}, submit dir ${SLURM_SUBMIT_DIR:-.})"',
        'if ! "$PY" -c "import gyre_hpc, h5py" 2>/dev/null; then',
        '  echo "gyre head: $PY cannot import gyre_hpc and its dependencies; submit from the project'
        ' directory (its .venv) or set GYRE_PYTHON=/path/to/venv/bin/python (sbatch --export=ALL,GYRE_PYTHON=...)" >&2',
        "  exit 2",
        "fi",
        "# USR2 is ignored until python installs its handler (which replaces the ignore): Slurm",
        "# has been seen to send a requeued job its time-limit warning the moment it restarts, and",
        "# the default action killed the head before it could resume (job FAILED, JobLaunchFailure).",
        "trap '' USR2",
        "# exec, not a child: USR2 and SIGTERM must reach the supervisor itself.",
        'exec "$PY" -m gyre_hpc.jobs.head "$@"',
    ]
    return "\n".join(lines) + "\n"
