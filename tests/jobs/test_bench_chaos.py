"""``gyre-hpc bench chaos`` on the local Slurm cluster, small: one fault of each kind (a rank
SIGKILLed, the srun step scancelled, the head SIGKILLed and the job resubmitted) in a 16-step
RL run; every tree, step row and run row must be there exactly once and the final checkpoint
load. 24 steps, not 6: on a quiet machine a step takes ~2 s, and 6 steps ended after the
first fault (a fault waits for its fleet, 1-8 s, then up to 15 s for its moment); 6 passed only
where CI's load made the steps slower. 40, not 24: on an AMD host (2026-12-07) the 24-step run
ended 43.6 s after its submission, before the third fault (7.4 s after the resubmitted head's
fleet came up) could land. The benchmark's default, run by hand, injects more
faults (20) into a shorter run (12 steps). 16, not 40, since issue 53: the runs are the ``long``
suite's (14-24 model calls each, so a kill lands mid-run and the run resumes from its journal)
and a step takes ~12 s (2-core machine at load ~16, 2026-12-07), so 40 steps would take ~8 min
of stepping alone; 16 give the three faults ~3 min. A resumed run must have redone at most
``rollout.snapshot_every`` calls (their tools; no journaled call goes to the engine again) and no
run may have begun again at its first call."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gyre_hpc.bench.chaos import KINDS, MOMENTS, fault_schedule, open_flip, resume_counts, steps_redone
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


def test_resume_counts_take_the_runs_a_relaunch_found_mid_way():
    runs = {"run_id": ["a", "b", "c", "d"], "calls": [20, 14, 24, 18],
            "resumed_calls": [0, 9, 13, 0], "tools_redone": [0, 3, 8, 0], "restarted_from_first": [0, 0, 0, 0]}
    got = resume_counts(runs, 8)
    assert (got["interrupted_runs"], got["calls_redone_per_interrupted_run_max"]) == (2, 8)
    assert got["calls_redone_per_interrupted_run_mean"] == 5.5 and got["resumed_calls_per_interrupted_run_mean"] == 11
    assert got["calls_redone_within_snapshot_interval"] and got["runs_restarted_from_first_call"] == 0
    assert got["calls_per_run_mean"] == 19
    runs["tools_redone"][2], runs["restarted_from_first"][3] = 9, 1      # past the interval; a restart
    got = resume_counts(runs, 8)
    assert not got["calls_redone_within_snapshot_interval"] and got["runs_restarted_from_first_call"] == 1
    assert got["interrupted_runs"] == 3
    with pytest.raises(KeyError, match="tools_redone"):
        resume_counts({k: v for k, v in runs.items() if k != "tools_redone"}, 8)


@pytest.mark.slurm
@pytest.mark.slow
def test_bench_chaos_small_run_keeps_everything_exactly_once(tmp_path):
    out = subprocess.run([sys.executable, "-c", "from gyre_hpc.cli import main; main()", "bench", "chaos",
                          "--faults", "3", "--steps", "16", "--seed", "0", "--json", "--keep", str(tmp_path / "run")],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.stdout.strip(), f"rc {out.returncode}, no JSON on stdout; stderr:\n{out.stderr[-3000:]}"
    rep = json.loads(out.stdout)          # only JSON on stdout, whatever the exit code
    assert out.returncode == 0, json.dumps({k: v for k, v in rep.items() if k != "faults"}, indent=1) + out.stderr[-2000:]
    assert rep["faults_injected"] == 3 and set(rep["by_kind"]) == set(KINDS)
    assert rep["head_submissions"] == 2 and rep["relaunches"] >= 1
    assert rep["trees_lost"] == rep["trees_duplicated"] == 0 and rep["trees"] == rep["xarray_trees"] == 16 * 8
    assert rep["step_rows_once"] and rep["run_rows_once"] and rep["final_checkpoint_step"] == 16
    assert rep["calls_per_run_mean"] >= 10          # runs of tens of calls
    assert rep["runs_restarted_from_first_call"] == 0
    assert rep["calls_redone_per_interrupted_run_max"] <= rep["snapshot_every"]
