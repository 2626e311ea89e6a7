"""The RL main job on the real local Slurm cluster: sbatch het job -> supervisor -> one het
step ``srun --het-group`` -> the rl fleet (engines and replicas on virtual nodes)."""
from __future__ import annotations

import subprocess

import pytest

from gyre_hpc.rundir.layout import RunDir
from gyre_hpc.rundir.metrics import read_table
from tests.jobs.slurm_jobs import checkpoint_step, events, fleet_step, sbatch, steps, wait_for, wait_job
from tests.rl.rl_helpers import latest_meta, store_run_ids

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SCRIPT = "sbatch/gyre_head.sh"
CONFIG = "examples/local-slurm.yaml"
SMALL = ("rollout.tasks=easy", "rollout.runs_per_task=4", "rollout.max_new_tokens=24")


def _submit(tmp_path, *overrides: str):
    run_dir = tmp_path / "run"
    out = tmp_path / "head.out"
    sets = [a for o in (f"run_dir={run_dir}", *SMALL, *overrides) for a in ("--set", o)]
    return sbatch("-o", str(out), SCRIPT, CONFIG, *sets), RunDir.at(run_dir), out


def test_sbatch_rl_job_trains_and_writes_trees_metrics_checkpoint(tmp_path):
    job, run, out = _submit(tmp_path, "train.steps=3")
    info = wait_job(job, 600, log=out)
    assert info["JobState"] == "COMPLETED", out.read_text()[-3000:]
    assert steps(run.root) == [1, 2, 3]
    ids = store_run_ids(run)
    assert len(ids) == 3 * 8 and len(set(ids)) == len(ids)
    assert latest_meta(run).extra["trained_upto"] == len(ids)
    assert int(read_table(run.metrics, "runs")["restarts"].sum()) == 0


def test_scancelled_rl_step_resumes_with_every_committed_tree_once(tmp_path):
    job, run, out = _submit(tmp_path, "train.steps=5")
    step_id = wait_for(lambda: fleet_step(run.root, 1), 180, "the first fleet step", job, out)
    wait_for(lambda: checkpoint_step(run.root) >= 1 and run.trees.exists()
             and len(store_run_ids(run)) > latest_meta(run).extra["trained_upto"], 300,
             "trees committed past the first checkpoint", job, out)
    before = store_run_ids(run)
    subprocess.run(["scancel", step_id], check=True)
    info = wait_job(job, 600, log=out)
    assert info["JobState"] == "COMPLETED", out.read_text()[-3000:]
    assert [e for e, _, _ in events(run.root)].count("relaunch") == 1
    ids = store_run_ids(run)
    assert len(ids) == 5 * 8 and len(set(ids)) == len(ids)
    assert ids[:len(before)] == before
    assert sorted(steps(run.root)) == [1, 2, 3, 4, 5]


def test_scancelled_between_checkpoints_writes_each_step_and_run_row_once(tmp_path):
    """train.checkpoint_every=2 under sbatch: scancel the fleet step once step 3 has ended (its
    trees committed, its rows not sealed) and step 4's first trees are in, the latest
    checkpoint still step 2. The relaunch redoes steps 3 and 4; each step's row, each run's row
    and each tree is there exactly once."""
    from collections import Counter

    # Paced training (50 tokens/s: ~3.5 s a step) holds the window open: unpaced, a step of this
    # small run took under a second, and CI's poll once missed step 4 between its first trees
    # and its checkpoint (the run finished first).
    job, run, out = _submit(tmp_path, "train.steps=4", "train.checkpoint_every=2", "cells.device=paced",
                            "cells.pace.engine.single_seq_tokens_per_s=400", "cells.pace.train.tokens_per_s=50")
    per_step = 2 * 4      # examples/local-slurm.yaml's tasks_per_step x SMALL's runs_per_task
    step_id = wait_for(lambda: fleet_step(run.root, 1), 180, "the first fleet step", job, out)
    wait_for(lambda: checkpoint_step(run.root) == 2 and run.trees.exists()
             and len(store_run_ids(run)) > 3 * per_step, 400, "step 4's trees, checkpoint 2 the latest", job, out)
    rows_then = steps(run.root)
    subprocess.run(["scancel", step_id], check=True)
    info = wait_job(job, 600, log=out)
    assert info["JobState"] == "COMPLETED", out.read_text()[-3000:]
    assert [e for e, _, _ in events(run.root)].count("relaunch") == 1
    assert rows_then == [1, 2]                      # step 3 had ended, unsealed: no row yet
    assert steps(run.root) == [1, 2, 3, 4]
    runs = read_table(run.metrics, "runs")
    assert sorted(Counter(runs["step"].tolist()).items()) == [(s, per_step) for s in range(1, 5)]
    assert len(set(runs["run_id"].tolist())) == len(runs["run_id"]) == 4 * per_step
    ids = store_run_ids(run)
    assert len(ids) == 4 * per_step and len(set(ids)) == len(ids)
