"""`gyre-hpc run` (README's first command, local launcher) and `gyre-hpc submit --sbatch` end to end."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.jobs.slurm_jobs import REPO, steps, wait_job

CLI = [sys.executable, "-c", "from gyre_hpc.cli import main; main()"]


@pytest.mark.mpi
@pytest.mark.slow
def test_run_local_finishes_and_prints_where_outputs_are(tmp_path):
    run_dir = tmp_path / "run"
    # The substrate smoke workload on the local launcher: this pins the head's path (CLI,
    # supervisor, mpiexec, outputs), not the RL workload's.
    out = subprocess.run(CLI + ["run", "examples/smoke.yaml", "--set", "launcher=local", "--set", f"run_dir={run_dir}",
                                "--set", "train.steps=2", "--set", "model.substrate_state_mb=1"],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"metrics      {run_dir / 'metrics.h5'}" in out.stdout
    assert f"gyre-hpc inspect {run_dir}" in out.stdout
    assert steps(run_dir) == [1, 2]


def test_run_names_a_bad_override(tmp_path):
    out = subprocess.run(CLI + ["run", "examples/local.yaml", "--set", "cells.count=0"], capture_output=True,
                         text=True, cwd=REPO)
    assert out.returncode != 0
    assert "cells.count" in out.stderr and "greater than or equal to 1" in out.stderr
    missing = subprocess.run(CLI + ["run", str(tmp_path / "nope.yaml")], capture_output=True, text=True, cwd=REPO)
    assert missing.returncode != 0 and "nope.yaml does not exist" in missing.stderr


@pytest.mark.slurm
@pytest.mark.slow
def test_submit_sbatch_generates_a_script_for_the_config_shape(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(CLI + ["submit", "examples/smoke.yaml", "--sbatch", "--set", f"run_dir={run_dir}",
                                "--set", "cells.count=2", "--set", "train.steps=3"],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    job = re.search(r"submitted het job (\d+)", out.stdout).group(1)
    script = (run_dir / "gyre_head.sh").read_text()
    assert script.count("#SBATCH hetjob") == 2  # head + 2 cells
    info = wait_job(job, 240, log=run_dir / "logs" / f"head-{job}.out")
    assert info["JobState"] == "COMPLETED", (run_dir / "logs" / f"head-{job}.out").read_text()
    assert steps(run_dir) == [1, 2, 3]


@pytest.mark.slurm
@pytest.mark.slow
def test_run_with_the_slurm_launcher_outside_a_job_lets_srun_allocate_the_het_step(tmp_path):
    import json

    run_dir = tmp_path / "run"
    out = subprocess.run(CLI + ["run", "examples/smoke.yaml", "--set", f"run_dir={run_dir}", "--set", "train.steps=2",
                                "--set", "model.substrate_state_mb=1"],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    fleet = json.loads((run_dir / "logs" / "fleet.json").read_text())
    assert fleet["command"][0] == "srun" and fleet["command"].count(":") == 3
    assert re.fullmatch(r"\d+\.\d+", fleet["step_id"])
    assert steps(run_dir) == [1, 2]
