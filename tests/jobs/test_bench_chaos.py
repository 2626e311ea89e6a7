"""``gyre-hpc bench chaos`` on the local Slurm cluster, small: one fault of each kind (a rank
SIGKILLed, the srun step scancelled, the head SIGKILLed and the job resubmitted) in a 40-step
RL run; every tree, step row and run row must be there exactly once and the final checkpoint
load. 24 steps, not 6: on a quiet machine a step takes ~2 s, and 6 steps ended after the
first fault (a fault waits for its fleet, 1-8 s, then up to 15 s for its moment); 6 passed only
where CI's load made the steps slower. 40, not 24: on an AMD host (2026-12-07) the 24-step run
ended 43.6 s after its submission, before the third fault (7.4 s after the resubmitted head's
fleet came up) could land. The benchmark's default, run by hand, injects more
faults (20) into a shorter run (12 steps)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gyre_hpc.bench.chaos import KINDS, MOMENTS, fault_schedule, open_flip, steps_redone
from tests.jobs.slurm_jobs import REPO


def test_the_schedule_is_seeded_and_covers_every_kind_and_moment():
    a = fault_schedule(7, 20)
    assert a == fault_schedule(7, 20) and a != fault_schedule(8, 20)
    assert {f.kind for f in a} == set(KINDS) and {f.moment for f in a} == set(MOMENTS)
    assert {f.kind for f in fault_schedule(0, 3)} == set(KINDS)


def test_a_flip_is_open_only_between_its_start_and_end_rows():
    assert open_flip({"event": ["flip_start", "flip_start", "flip_end", "flip_end", "migrate", "flip_start"]})
    assert not open_flip({"event": ["flip_start", "flip_end", "migrate"]})
    assert not open_flip({"event": []})


def test_steps_redone_counts_steps_trained_again_in_a_later_launch():
    events = [("fleet_start", 1), ("train_mb", 1), ("train_mb", 2),            # killed in step 2
              ("fleet_resume", 2), ("train_mb", 2), ("train_mb", 3), ("train_mb", 3),
              ("fleet_resume", 3), ("train_mb", 3)]                            # step 3 ended unsealed
    assert steps_redone(events) == 2
    assert steps_redone([("fleet_start", 1), ("train_mb", 1)]) == 0


@pytest.mark.slurm
@pytest.mark.slow
def test_bench_chaos_small_run_keeps_everything_exactly_once(tmp_path):
    out = subprocess.run([sys.executable, "-c", "from gyre_hpc.cli import main; main()", "bench", "chaos",
                          "--faults", "3", "--steps", "40", "--seed", "0", "--json", "--keep", str(tmp_path / "run")],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.stdout.strip(), f"rc {out.returncode}, no JSON on stdout; stderr:\n{out.stderr[-3000:]}"
    rep = json.loads(out.stdout)          # only JSON on stdout, whatever the exit code
    assert out.returncode == 0, json.dumps({k: v for k, v in rep.items() if k != "faults"}, indent=1) + out.stderr[-2000:]
    assert rep["faults_injected"] == 3 and set(rep["by_kind"]) == set(KINDS)
    assert rep["head_submissions"] == 2 and rep["relaunches"] >= 1
    assert rep["trees_lost"] == rep["trees_duplicated"] == 0 and rep["trees"] == rep["xarray_trees"] == 40 * 8
    assert rep["step_rows_once"] and rep["run_rows_once"] and rep["final_checkpoint_step"] == 40
