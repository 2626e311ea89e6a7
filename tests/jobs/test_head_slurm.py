"""The head job on the real local Slurm cluster, running the real fleet on examples/smoke.yaml.

sbatch het job -> supervisor -> one het step `srun --het-group` -> `python -m gyre_hpc.substrate`.
Kill a step, kill it too often, USR2 the batch step: each must end in the state the contract
promises, read back from Slurm (scontrol) and from the run's metrics.h5.
"""
from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter

import pytest

from tests.jobs.slurm_jobs import (REPO, checkpoint_step, events, flips, fleet_step, sbatch,
                                   steps, wait_for, wait_job, evidence)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SCRIPT = "sbatch/gyre_head.sh"
SMOKE = "examples/smoke.yaml"


def _submit(tmp_path, *overrides: str) -> tuple[str, object, object]:
    run_dir = tmp_path / "run"
    out = tmp_path / "head.out"
    sets = [a for o in (f"run_dir={run_dir}", *overrides) for a in ("--set", o)]
    job = sbatch("-o", str(out), SCRIPT, SMOKE, *sets)
    return job, run_dir, out


def _names(run_dir) -> list[str]:
    return [e for e, _, _ in events(run_dir)]


def test_sbatch_smoke_finishes_with_cells_flipping_both_ways(tmp_path):
    job, run_dir, out = _submit(tmp_path)
    info = wait_job(job, 240, log=out)
    assert info["JobState"] == "COMPLETED", out.read_text()
    assert info["ExitCode"] == "0:0"
    assert steps(run_dir) == [1, 2, 3, 4, 5, 6]
    by_cell = flips(run_dir)
    for cell in (1, 2):  # the elastic cells; cell 0 is the core and always trains
        roles = by_cell[cell]
        assert roles.count("TRAIN") >= 2 and roles.count("ROLLOUT") >= 2, roles
        assert all(a != b for a, b in zip(roles, roles[1:])), f"cell {cell} did not alternate: {roles}"
    names = _names(run_dir)
    assert names[0] == "launch" and names[-1] == "finish"
    assert "relaunch" not in names
    assert "finished 6 steps in 1 launch" in out.read_text()


# 12 steps, not 30: the kill and the USR2 land once step 2 is checkpointed (a smoke step takes
# ~1 s), so 12 leaves the resume ten steps to prove, and the resumed fleet no longer spends
# ~20 s on steps no assertion reads.
STEPS = 12


def test_killed_step_is_relaunched_from_the_last_checkpoint(tmp_path):
    job, run_dir, out = _submit(tmp_path, f"train.steps={STEPS}")
    step_id = wait_for(lambda: fleet_step(run_dir, 1), 120, "the first fleet step", job, out)
    wait_for(lambda: checkpoint_step(run_dir) >= 2, 120, "a checkpoint of step 2", job, out)
    subprocess.run(["scancel", step_id], check=True)
    info = wait_job(job, 300, log=out)
    assert info["JobState"] == "COMPLETED", out.read_text() + evidence(run_dir)
    names = _names(run_dir)
    assert names.count("relaunch") == 1, evidence(run_dir)
    resumed = [s for e, s, _ in events(run_dir) if e == "fleet_resume"]
    assert len(resumed) == 1 and resumed[0] >= 3  # resumed after a checkpoint, not from scratch
    counts = Counter(steps(run_dir))
    assert sorted(counts) == list(range(1, STEPS + 1))
    assert set(counts.values()) == {1}, {s: n for s, n in counts.items() if n > 1}


def test_too_many_killed_steps_fail_the_job_with_a_clear_message(tmp_path):
    job, run_dir, out = _submit(tmp_path, "train.steps=500", "supervise.max_relaunches=1")
    for launch in (1, 2):
        step_id = wait_for(lambda: fleet_step(run_dir, launch), 120, f"fleet launch {launch}", job, out)
        # Kill a fleet that is training (a new checkpoint), not one still starting its ranks.
        before = checkpoint_step(run_dir)
        wait_for(lambda: checkpoint_step(run_dir) > before, 120, f"a checkpoint from launch {launch}", job, out)
        subprocess.run(["scancel", step_id], check=True)
    info = wait_job(job, 120, log=out)
    assert info["JobState"] == "FAILED", out.read_text()
    assert info["ExitCode"] == "1:0"
    text = out.read_text()
    assert "FAILED: fleet failed 2 times, more than supervise.max_relaunches=1" in text
    fail = [d for e, _, d in events(run_dir) if e == "fail"]
    assert len(fail) == 1 and "supervise.max_relaunches=1" in fail[0]


def test_usr2_checkpoints_requeues_and_resumes_without_repeating_a_step(tmp_path):
    job, run_dir, out = _submit(tmp_path, f"train.steps={STEPS}")
    wait_for(lambda: fleet_step(run_dir, 1), 120, "the first fleet step", job, out)
    wait_for(lambda: checkpoint_step(run_dir) >= 2, 120, "a checkpoint of step 2", job, out)
    subprocess.run(["scancel", "--batch", "--signal=USR2", job], check=True)
    info = wait_job(job, 120, until=lambda i: i["Restarts"] == "1", log=out)
    saved = checkpoint_step(run_dir)
    assert 2 <= saved < STEPS
    info = wait_job(job, 300, log=out)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", out.read_text()
    ev = events(run_dir)
    requeue = [s for e, s, _ in ev if e == "requeue"]
    resume = [s for e, s, _ in ev if e == "resume"]
    assert requeue == [saved] and resume == [saved]
    assert [s for e, s, _ in ev if e == "fleet_resume"] == [saved + 1]
    counts = Counter(steps(run_dir))
    assert sorted(counts) == list(range(1, STEPS + 1)) and set(counts.values()) == {1}
    assert "USR2: checkpointed at step" in out.read_text()


def test_time_limit_warning_reaches_the_head_and_requeues(tmp_path):
    """The real path, not scancel: Slurm itself sends B:USR2 signal_s before the time limit
    (2 min limit, 40 s warning), the exec'd python gets it, drains, requeues, and resumes.
    Slurm may send the signal up to 60 s early (its event handling's resolution): with a
    1 min limit it came 0-20 s after the start, before the first checkpoint, and a requeue
    with nothing to resume from (fresh-clone CI, 2026-12-03: three such, then the wait for a
    resume ran out). 2 min puts it 20-80 s after the start."""
    # The limit lives in #SBATCH lines, so the script is generated from this config.
    run_dir = tmp_path / "run"
    cli = [sys.executable, "-c", "from gyre_hpc.cli import main; main()"]
    sub = subprocess.run(cli + ["submit", SMOKE, "--sbatch", "--set", f"run_dir={run_dir}", "--set", "train.steps=100000",
                                "--set", "slurm.time_min=2", "--set", "slurm.signal_s=40"],
                         capture_output=True, text=True, cwd=REPO)
    assert sub.returncode == 0, sub.stderr
    job = re.search(r"submitted het job (\d+)", sub.stdout).group(1)
    out = run_dir / "logs" / f"head-{job}.out"
    assert "#SBATCH --time=2" in (run_dir / "gyre_head.sh").read_text()
    info = wait_job(job, 240, until=lambda i: i["Restarts"] == "1", log=out)
    assert info["JobState"] != "TIMEOUT"
    # A requeued job waits out the credential expiry (~20 s) and then the backfill pass; on a
    # loaded 2-core box the restart has been seen to take over 120 s.
    wait_for(lambda: "resume" in _names(run_dir), 300, "the resumed head", job, out)
    subprocess.run(["scancel", job], check=True)
    ev = events(run_dir)
    # A resumed head on a loaded box may get its own warning before it trains a step: then it
    # requeues again, from the same checkpoint. Each resume starts where a requeue stopped.
    requeue = [s for e, s, _ in ev if e == "requeue"]
    resume = [s for e, s, _ in ev if e == "resume"]
    assert requeue and requeue[0] >= 1, evidence(run_dir)
    assert resume and resume == requeue[:len(resume)], evidence(run_dir)
    assert "USR2: checkpointed at step" in out.read_text()


def test_a_head_sigkilled_outside_a_batch_step_takes_its_slurm_fleet_along_and_a_rerun_starts(tmp_path):
    """`gyre-hpc run` on a login node (launcher slurm, no batch job): SIGKILL the head, and its
    srun step must end by itself (the fleet's lease on the head runs out: checkpoint and exit),
    so a rerun is not refused by a step nobody owns, and it resumes to the end."""
    import os
    import signal
    import time

    from tests.jobs.slurm_jobs import wait_for as _wait

    run_dir = tmp_path / "run"
    argv = [sys.executable, "-c", "from gyre_hpc.cli import main; main()", "run", SMOKE, "--set", "launcher=slurm", "--set",
            f"run_dir={run_dir}", "--set", "train.steps=40", "--set", "supervise.head_lease_s=4"]
    log = open(tmp_path / "head.log", "w")
    head = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        step_id = _wait(lambda: fleet_step(run_dir, 1), 120, "the fleet's Slurm step", log=tmp_path / "head.log")
        _wait(lambda: checkpoint_step(run_dir) >= 1, 120, "a first checkpoint", log=tmp_path / "head.log")
        os.kill(head.pid, signal.SIGKILL)
        head.wait()
        t0 = time.monotonic()

        def gone():
            out = subprocess.run(["scontrol", "show", "step", step_id], capture_output=True, text=True)
            return out.returncode != 0 or f"StepId={step_id}" not in out.stdout
        _wait(gone, 90, f"Slurm step {step_id} to end after its head died", log=tmp_path / "head.log")
        ended_s = time.monotonic() - t0
        names = [e for e, _, _ in events(run_dir)]
        assert "head_gone" in names, names
        assert ended_s < 90
    finally:
        if head.poll() is None:
            head.kill()
        log.close()
    rerun = subprocess.run(argv[:-2] + ["--set", "supervise.head_lease_s=60"], cwd=REPO, capture_output=True,
                           text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "REFUSED" not in rerun.stdout + rerun.stderr
    assert steps(run_dir)[-1] == 40 and sorted(set(steps(run_dir))) == steps(run_dir)
