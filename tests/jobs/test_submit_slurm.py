"""The head through submitit (``gyre_hpc.submit``): a plain allocation, the fleet as a het step."""
from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

import gyre_hpc
from gyre_hpc.config import load_config
from gyre_hpc.jobs.submit import wait_for_result
from tests.jobs.slurm_jobs import (REPO, checkpoint_step, events, flips, fleet_step, job_info, steps,
                                   wait_for, wait_job)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _cfg(tmp_path, *overrides):
    return load_config(REPO / "examples/smoke.yaml", [f"run_dir={tmp_path / 'run'}", *overrides])


def test_submit_runs_the_smoke_fleet_as_a_het_step(tmp_path):
    cfg = _cfg(tmp_path)
    job = gyre_hpc.submit(cfg)
    result = wait_for_result(job, 300)
    assert result["status"] == "finished" and result["last_step"] == 6, result
    run_dir = tmp_path / "run"
    assert steps(run_dir) == [1, 2, 3, 4, 5, 6]
    for cell in (1, 2):
        assert {"TRAIN", "ROLLOUT"} <= set(flips(run_dir)[cell])
    script = (run_dir / "submitit" / f"{job.job_id}_submission.sh").read_text()
    assert "#SBATCH --signal=B:USR2@120" in script and "#SBATCH --requeue" in script
    assert f"exec {sys.executable} -u -m submitit.core._submit" in script
    assert "srun" not in script  # the head runs once, in the batch step
    # The fleet ran as one het step over the allocation: controller + one component per cell,
    # each pinned to its own node.
    import json
    command = json.loads((run_dir / "logs" / "fleet.json").read_text())["command"]
    assert command.count(":") == 3 and command.count("--nodelist") == 4
    nodelists = [command[i + 1] for i, a in enumerate(command) if a == "--nodelist"]
    assert len(set(nodelists)) == 4
    log = next((run_dir / "logs").glob("fleet-*.log")).read_text()
    assert "step 6/6" in log


def test_submit_usr2_drains_requeues_and_resumes(tmp_path):
    cfg = _cfg(tmp_path, "train.steps=12")    # USR2 lands after step 2's checkpoint; 12 leaves 10 to resume
    run_dir = tmp_path / "run"
    job = gyre_hpc.submit(cfg)
    wait_for(lambda: fleet_step(run_dir, 1), 120, "the first fleet step", job.job_id)
    wait_for(lambda: checkpoint_step(run_dir) >= 2, 120, "a checkpoint of step 2", job.job_id)
    subprocess.run(["scancel", "--batch", "--signal=USR2", job.job_id], check=True)
    wait_job(job.job_id, 120, until=lambda i: i["Restarts"] == "1")
    saved = checkpoint_step(run_dir)
    wait_job(job.job_id, 300, until=lambda i: i["JobState"] != "PENDING")   # nudges the idle backfill
    result = wait_for_result(job, 300)
    assert result["status"] == "finished" and result["last_step"] == 12, result
    ev = events(run_dir)
    assert [s for e, s, _ in ev if e == "requeue"] == [saved]
    assert [s for e, s, _ in ev if e == "resume"] == [saved]
    counts = Counter(steps(run_dir))
    assert sorted(counts) == list(range(1, 13)) and set(counts.values()) == {1}
    assert job_info(job.job_id)["Restarts"] == "1"


def test_wait_for_result_reports_a_job_that_died_without_one(tmp_path):
    cfg = _cfg(tmp_path, "train.steps=100000")
    job = gyre_hpc.submit(cfg)
    wait_for(lambda: fleet_step(tmp_path / "run", 1), 120, "the first fleet step", job.job_id)
    # SIGKILL to the batch step: python cannot leave even an error result behind.
    subprocess.run(["scancel", "--batch", "--signal=KILL", job.job_id], check=True)
    with pytest.raises(RuntimeError, match=rf"submitit job {job.job_id} ended without a result; its log ends"):
        wait_for_result(job, 120, grace_s=3)


def test_submit_cli_waits_and_prints_the_result(tmp_path):
    out = subprocess.run([sys.executable, "-c", "from gyre_hpc.cli import main; main()", "submit", "examples/smoke.yaml",
                          "--wait", "--set", f"run_dir={tmp_path / 'run'}", "--set", "train.steps=2",
                          "--set", "model.substrate_state_mb=1"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "'status': 'finished'" in out.stdout and "'last_step': 2" in out.stdout


def test_scancel_of_a_submitit_head_drains_and_returns_stopped(tmp_path):
    """submitit ignores SIGTERM; the head does not, so scancel is a clean stop, not a relaunch storm."""
    cfg = _cfg(tmp_path, "train.steps=100000")
    job = gyre_hpc.submit(cfg)
    wait_for(lambda: fleet_step(tmp_path / "run", 1), 120, "the first fleet step", job.job_id)
    subprocess.run(["scancel", job.job_id], check=True)
    result = wait_for_result(job, 120)
    assert result["status"] == "stopped" and result["launches"] == 1, result
    assert "relaunch" not in [e for e, _, _ in events(tmp_path / "run")]
