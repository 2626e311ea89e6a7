"""The fleet end to end over real MPI ranks: flips, weights, mid-step flips, failure, checkpoint/exit/resume."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from cells_mpi import RANKS, make_run_dir, mpiexec, ok
from gyre_hpc.bench.switch import usable_slurm_nodes
from gyre_hpc.cells import checkpoint as ck
from gyre_hpc.config import load_config
from gyre_hpc.jobs.launchers import SlurmLauncher
from gyre_hpc.jobs.plan import plan_for_nodes
from gyre_hpc.rundir.metrics import read_table

pytestmark = pytest.mark.mpi
PROBE = str(RANKS / "fleet_probe.py")


def probe(run_dir, mode, n, chunk_bytes=None, timeout=150):
    out = run_dir / "result.json"
    args = [PROBE, str(run_dir), str(out), mode] + ([str(chunk_bytes)] if chunk_bytes else [])
    proc = mpiexec(n, args, timeout=timeout)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def test_scripted_flips_move_the_core_weights_bit_for_bit_both_ways(tmp_path):
    run = make_run_dir(tmp_path / "run", cells={"count": 3, "ranks_per_cell": 2}, train={"steps": 5},
                       model={"substrate_state_mb": 2})
    proc, res = probe(run, "scripted", 7, chunk_bytes=300_000)
    ok(proc)
    assert res["exit_code"] == 0
    assert [s["step"] for s in res["steps"]] == [1, 2, 3, 4, 5]
    flips = res["flips"]
    to_train = [f for f in flips if f["to"] == "TRAIN"]
    to_rollout = [f for f in flips if f["to"] == "ROLLOUT"]
    assert len(to_train) >= 4 and len(to_rollout) >= 3
    core_after = {s["step"]: s["checksums"]["1"] for s in res["steps"]}
    state_bytes = 2 * (1 << 20)
    for f in to_train:
        assert f["checksum"] == f["source_checksum"] is not None, f
        # both ranks of the cell received the state dict (leader from the core, the other intra-cell)
        assert f["bytes"] >= 2 * state_bytes
    for f in to_rollout:
        assert f["bytes"] == 0
        # it takes the newest weights with it: those after the last optimizer step
        assert f["checksum"] == core_after[f["step"] - 1] == f["source_checksum"], f
    for s in res["steps"]:
        train_ranks = [r for c in s["train_cells"] for r in (1 + 2 * c, 2 + 2 * c)]
        assert {s["checksums"][str(r)] for r in train_ranks} == {core_after[s["step"]]}
        assert len(set(core_after.values())) == 5          # weights really change every step
    # the controller checked every rank's train_comm against the plan after every flip command
    assert res["train_comm_checks"] == len({(f["step"], f["round"]) for f in flips})

    timeline = read_table(run / "metrics.h5", "timeline")
    events = list(timeline["event"])
    # start rows (initial roles) first, end rows (final roles) last, one per cell
    assert events[:3] == ["start"] * 3 and events[-3:] == ["end"] * 3
    assert list(timeline["role"][:3]) == ["TRAIN", "ROLLOUT", "ROLLOUT"]
    final = {c: r for c, r in zip(timeline["cell"][-3:], timeline["role"][-3:])}
    assert sorted(c for c, r in final.items() if r == "TRAIN") == sorted(res["steps"][-1]["train_cells"])
    starts = [i for i, e in enumerate(timeline["event"]) if e == "flip_start"]
    ends = [i for i, e in enumerate(timeline["event"]) if e == "flip_end"]
    assert len(starts) == len(ends) == len(flips)
    assert sorted(timeline["bytes"][ends].tolist()) == sorted(f["bytes"] for f in flips)
    assert all(timeline["duration_s"][ends] > 0)
    assert set(timeline["role"][ends]) == {"TRAIN", "ROLLOUT"}
    steps = read_table(run / "metrics.h5", "steps")
    assert steps["step"].tolist() == [1, 2, 3, 4, 5]
    assert steps["policy_version"].tolist() == [1, 2, 3, 4, 5]


def test_mid_step_flips_hand_back_micro_batches_and_keep_the_step_gradient(tmp_path):
    # interval_s: the controller asks the policy again at every round, not only each 0.5 s
    flipping = make_run_dir(tmp_path / "flip", train={"steps": 4}, scheduler={"interval_s": 0.001})
    steady = make_run_dir(tmp_path / "steady", train={"steps": 4})
    proc, res = probe(flipping, "midstep", 4, chunk_bytes=100_000)
    ok(proc)
    proc, ref = probe(steady, "never", 4)
    ok(proc)
    assert ref["flips"] == []
    assert [(f["step"], f["round"], f["to"]) for f in res["flips"]] == [
        (1, 1, "TRAIN"), (2, 1, "ROLLOUT"), (3, 1, "TRAIN"), (4, 1, "ROLLOUT")]
    for f in res["flips"]:
        assert f["checksum"] == f["source_checksum"]
    # Same data, same micro-batches, whoever computed them: same losses and same weights
    # up to the order of float sums in the allreduce.
    np.testing.assert_allclose([s["loss"] for s in res["steps"]], [s["loss"] for s in ref["steps"]], rtol=1e-6)
    a = ck.load_state(ck.latest_dir(flipping / "checkpoints"))
    b = ck.load_state(ck.latest_dir(steady / "checkpoints"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)
    assert int(a["updates"]) == 4


def test_an_exception_on_one_rank_ends_the_whole_fleet_and_a_relaunch_runs_each_step_once(tmp_path):
    # checkpoint_every=2: step 1 completes but is not sealed when rank 2 fails in step 2.
    run = make_run_dir(tmp_path / "run", train={"steps": 4, "checkpoint_every": 2})
    proc, res = probe(run, "fail", 4, timeout=90)
    assert proc.returncode not in (0, 75)
    assert "injected failure on rank 2" in proc.stderr
    assert res is None
    assert ck.latest_dir(run / "checkpoints") is None
    assert read_table(run / "metrics.h5", "steps")["step"].tolist() == []   # step 1 was never sealed

    # The supervisor's relaunch reruns step 1 (nothing sealed it) and writes each step's row once.
    ok(mpiexec(4, ["-m", "gyre_hpc.substrate", "--run-dir", str(run)], timeout=150))
    assert read_table(run / "metrics.h5", "steps")["step"].tolist() == [1, 2, 3, 4]
    assert [p.name for p in ck.complete_dirs(run / "checkpoints")] == ["step-00000002", "step-00000004"]


def test_a_sealed_steps_row_a_kill_kept_out_of_metrics_is_restored_from_its_checkpoint(tmp_path):
    """Killed right after checkpoint 2 committed and before its step row was appended: the
    checkpoint carries the row (cells.step_rows), and the next start writes it, once."""
    from gyre_hpc.cells.step_rows import STEP_ROWS_FILE
    from gyre_hpc.rundir.metrics import MetricsWriter, StepRow

    run = make_run_dir(tmp_path / "run", train={"steps": 2})
    ok(mpiexec(4, ["-m", "gyre_hpc.substrate", "--run-dir", str(run)], timeout=150))
    latest = ck.latest_dir(run / "checkpoints")
    assert STEP_ROWS_FILE in ck.read_meta(latest).files and (latest / STEP_ROWS_FILE).is_file()
    kept = read_table(run / "metrics.h5", "steps")
    (run / "metrics.h5").unlink()             # as the kill left it: step 1's row only
    with MetricsWriter(run / "metrics.h5") as m:
        m.add(StepRow(step=1, time=float(kept["time"][0]), wall_s=float(kept["wall_s"][0])))
    ok(mpiexec(4, ["-m", "gyre_hpc.substrate", "--run-dir", str(run)], timeout=150))   # nothing left to train
    assert read_table(run / "metrics.h5", "steps")["step"].tolist() == [1, 2]


def test_a_rank_that_stops_answering_fails_the_fleet_instead_of_hanging_it(tmp_path):
    run = make_run_dir(tmp_path / "run", train={"steps": 4})
    proc, _ = probe(run, "stall", 4, timeout=90)     # the stalled rank would sleep 120 s
    assert proc.returncode not in (0, 75)
    assert "cell ranks [2] did not answer Round (step 2) within 8 s" in proc.stderr


@pytest.mark.slow   # three fleet launches
def test_checkpoint_and_exit_gives_75_then_resume_runs_each_step_once(tmp_path):
    run = make_run_dir(tmp_path / "run", train={"steps": 6})
    proc, _ = probe(run, "exit", 4)
    assert proc.returncode == 75, proc.stderr[-3000:]
    latest = ck.latest_dir(run / "checkpoints")
    meta = ck.read_meta(latest)
    # The request appears during step 2's first round; the controller sees it at the next round
    # boundary, abandons step 2 and seals step 1, the last completed one.
    assert meta.step == 1 and latest.name == "step-00000001"
    assert int(ck.load_state(latest)["updates"]) == meta.step
    assert set(meta.roles) == {"0", "1", "2"} and meta.roles["0"] == "TRAIN"
    assert read_table(run / "metrics.h5", "steps")["step"].tolist() == list(range(1, meta.step + 1))

    # The supervisor clears the request and relaunches the plain entry point.
    (run / "control" / "checkpoint-and-exit").unlink()
    ok(mpiexec(4, ["-m", "gyre_hpc.substrate", "--run-dir", str(run)], timeout=150))
    assert read_table(run / "metrics.h5", "steps")["step"].tolist() == [1, 2, 3, 4, 5, 6]
    events = read_table(run / "metrics.h5", "events")
    resume = [i for i, e in enumerate(events["event"]) if e == "fleet_resume"]
    assert len(resume) == 1 and events["step"][resume[0]] == meta.step + 1
    final = ck.latest_dir(run / "checkpoints")
    assert ck.read_meta(final).step == 6 and int(ck.load_state(final)["updates"]) == 6
    assert len(ck.complete_dirs(run / "checkpoints")) == 2

    # Launching again after the last step has nothing to do and says so with exit 0.
    ok(mpiexec(4, ["-m", "gyre_hpc.substrate", "--run-dir", str(run)], timeout=150))
    assert read_table(run / "metrics.h5", "steps")["step"].tolist() == [1, 2, 3, 4, 5, 6]


def test_a_world_that_does_not_fit_the_plan_is_refused_by_name(tmp_path):
    run = make_run_dir(tmp_path / "run")
    proc = mpiexec(3, ["-m", "gyre_hpc.substrate", "--run-dir", str(run)], timeout=90)
    assert proc.returncode != 0
    assert "cells.count=3 x cells.ranks_per_cell=1 + 1 controller needs 4" in proc.stderr


@pytest.mark.slurm
@pytest.mark.slow   # one srun het step
def test_flips_over_a_slurm_het_step_with_two_ranks_per_cell(tmp_path):
    run = make_run_dir(tmp_path / "run", cells={"count": 3, "ranks_per_cell": 2}, train={"steps": 3})
    plan = plan_for_nodes(load_config(run / "config.yaml"), usable_slurm_nodes())
    out = run / "result.json"
    handle = SlurmLauncher().launch(plan, [sys.executable, PROBE, str(run), str(out), "scripted"],
                                    log_path=run / "fleet.log", cwd=run)
    try:
        rc = handle.wait(240)
    except subprocess.TimeoutExpired:
        handle.kill()
        pytest.fail(f"srun fleet did not finish; log:\n{(run / 'fleet.log').read_text()[-3000:]}")
    assert rc == 0, (run / "fleet.log").read_text()[-3000:]
    res = json.loads(out.read_text())
    assert [s["step"] for s in res["steps"]] == [1, 2, 3]
    assert len({c.nodes for c in plan.components}) >= 3
    for f in res["flips"]:
        assert f["checksum"] == f["source_checksum"]
        if f["to"] == "TRAIN":
            assert f["bytes"] >= 2 * 2 * (1 << 20)     # both ranks of the cell got the 2 MB state
    for s in res["steps"]:
        core = s["checksums"]["1"]
        assert all(s["checksums"][str(r)] == core for c in s["train_cells"] for r in (1 + 2 * c, 2 + 2 * c))
