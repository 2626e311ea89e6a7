"""A head started by a process that imported mpi4py must still launch its fleet."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from gyre_hpc.jobs.launchers import fleet_env
from tests.jobs.slurm_jobs import REPO, steps


def test_fleet_env_drops_a_singletons_variables_and_keeps_the_users(monkeypatch):
    monkeypatch.setenv("PMIX_NAMESPACE", "43057153")
    monkeypatch.setenv("OMPI_MCA_ess", "singleton")
    monkeypatch.setenv("OMPI_MCA_orte_launch", "1")
    monkeypatch.setenv("OMPI_MCA_btl", "self,vader,tcp")
    env = fleet_env({"EXTRA": "1"})
    assert "PMIX_NAMESPACE" not in env and "OMPI_MCA_ess" not in env and "OMPI_MCA_orte_launch" not in env
    assert env["OMPI_MCA_btl"] == "self,vader,tcp" and env["EXTRA"] == "1" and env["OMP_NUM_THREADS"]


@pytest.mark.mpi
def test_run_from_a_process_that_initialised_mpi_launches_the_fleet(tmp_path):
    """Seen in the full suite: mpiexec exited 1 silently when the head inherited a singleton's env."""
    run_dir = tmp_path / "run"
    code = textwrap.dedent(f"""
        import subprocess, sys
        from mpi4py import MPI  # noqa: F401  (MPI_Init: the singleton's variables land in environ)
        out = subprocess.run([sys.executable, "-c", "from gyre_hpc.cli import main; main()", "run",
                              "examples/smoke.yaml", "--set", "launcher=local", "--set", "run_dir={run_dir}",
                              "--set", "train.steps=2", "--set", "model.substrate_state_mb=1"],
                             capture_output=True, text=True, timeout=240)
        sys.stdout.write(out.stdout + out.stderr)
        sys.exit(out.returncode)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert steps(run_dir) == [1, 2]
