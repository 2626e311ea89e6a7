"""The run-directory loader: xarray views of metrics.h5 and trees.zarr, and what is derived."""
from __future__ import annotations

import dataclasses

import h5py
import numpy as np
import pytest

from gyre_hpc.rundir.load import open_run, open_runs, open_trees, role_intervals, time_fractions, tree_savings
from gyre_hpc.rundir.metrics import EngineRow, MetricsWriter, StepRow, TimelineRow
from gyre_hpc.sim.cluster import policy_for, simulate
from gyre_hpc.sim.record import write_run
from gyre_hpc.sim.workload import preset

TINY = dataclasses.replace(preset("tiny"), steps=2, engine_sample_s=0.25)


@pytest.fixture(scope="module")
def sim_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    results = {}
    for name in ("elastic", "colocate"):
        results[name] = simulate(TINY, policy_for(TINY, name), name)
        write_run(results[name], TINY, root / name)
    return root, results


def test_open_run_gives_tables_as_xarray(sim_runs):
    root, results = sim_runs
    run = open_run(root / "elastic")
    assert run.simulated and run.name == "elastic"
    assert list(run.steps["step"].values) == [0, 1]
    np.testing.assert_allclose(run.steps["wall_s"].values, results["elastic"].step_s)
    assert run.timeline.sizes["row"] == len(results["elastic"].timeline)
    assert run.runs.sizes["row"] == TINY.steps * TINY.run.runs_per_step
    assert set(run.runs["status"].values) == {"finished"}
    assert run.trees is None and run.sim["summary"]["policy"] == "elastic"
    assert set(open_runs(root)) == {"elastic", "colocate"}


def test_time_fractions_from_the_files_match_the_simulators_own_accounting(sim_runs):
    root, results = sim_runs
    for name, res in results.items():
        got = time_fractions(open_run(root / name))
        assert sum(got.values()) == pytest.approx(1.0)
        assert got["switch"] == pytest.approx(res.busy["switch"], abs=1e-9)  # exact: from the timeline
        for k in ("rollout", "train", "idle"):                            # sampled every 0.25 s
            assert got[k] == pytest.approx(res.busy[k], abs=0.02), (name, k, got, res.busy)


def test_role_intervals_cover_each_cell_from_start_to_end(sim_runs):
    root, results = sim_runs
    run = open_run(root / "colocate")
    iv = role_intervals(run)
    end = results["colocate"].total_s
    for c in range(TINY.fleet.cells):
        sel = iv["cell"].values == c
        start, stop = iv["start"].values[sel], iv["end"].values[sel]
        order = np.argsort(start)
        assert start[order][0] == 0.0 and stop[order][-1] == pytest.approx(end)
        np.testing.assert_allclose(start[order][1:], stop[order][:-1])  # no gaps, no overlaps


def test_hand_written_run_dir_reads_like_a_real_one(tmp_path):
    # What the runtime writes: role rows without idle samples; idle is then unknown (NaN).
    with MetricsWriter(tmp_path / "metrics.h5", attrs={"source": "runtime"}) as mw:
        mw.append([TimelineRow(0, 0, "TRAIN", "start"), TimelineRow(0, 1, "ROLLOUT", "start"),
                   TimelineRow(6, 1, "SWITCH", "switch"), TimelineRow(8, 1, "TRAIN", "role"),
                   TimelineRow(10, 0, "TRAIN", "end"), TimelineRow(10, 1, "TRAIN", "end")])
        mw.add(StepRow(step=0, time=10, wall_s=10, reward_mean=0.5))
    run = open_run(tmp_path)
    assert not run.simulated and run.sim is None
    f = time_fractions(run)
    assert (f["rollout"], f["train"], f["switch"]) == pytest.approx((0.3, 0.6, 0.1))
    assert np.isnan(f["idle"])
    with MetricsWriter(tmp_path / "metrics.h5") as mw:
        mw.append([EngineRow(1, 1, 0.0), EngineRow(3, 1, 50.0), EngineRow(2, 0, 10.0), EngineRow(9, 0, 0.0)])
    f = time_fractions(open_run(tmp_path))
    assert f["rollout"] == pytest.approx(0.15) and f["train"] == pytest.approx(0.3)
    assert f["idle"] == pytest.approx(0.45)


def test_a_role_without_samples_counts_whole(tmp_path):
    # The RL controller samples engines only: training time is not split into busy/idle.
    with MetricsWriter(tmp_path / "metrics.h5") as mw:
        mw.append([TimelineRow(0, 0, "TRAIN", "start"), TimelineRow(0, 1, "ROLLOUT", "start"),
                   TimelineRow(10, 0, "TRAIN", "end"), TimelineRow(10, 1, "ROLLOUT", "end"),
                   EngineRow(1, 1, 30.0), EngineRow(6, 1, 0.0)])
    f = time_fractions(open_run(tmp_path))
    assert (f["rollout"], f["train"], f["idle"]) == pytest.approx((0.25, 0.5, 0.25))


def test_file_from_before_a_table_existed_opens_with_that_table_empty(tmp_path):
    with MetricsWriter(tmp_path / "metrics.h5") as mw:
        mw.add(TimelineRow(0, 0, "TRAIN", "start"))
    with h5py.File(tmp_path / "metrics.h5", "a") as f:
        del f["runs"]
    run = open_run(tmp_path)
    assert run.runs.sizes["row"] == 0 and run.timeline.sizes["row"] == 1


def test_missing_run_dir_or_metrics_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_run(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="metrics.h5 does not exist"):
        open_run(tmp_path)
    with pytest.raises(FileNotFoundError, match="no run directories"):
        open_runs(tmp_path)


def test_tree_savings_counts_each_calls_full_context(tmp_path):
    from gyre_hpc.trees.builder import build_tree
    from gyre_hpc.trees.model import ModelCall
    from gyre_hpc.trees.store import TreeStore
    # Two calls sharing a 4-token prompt: call 2's prompt repeats call 1's prompt and output.
    c1 = ModelCall(prompt=np.array([1, 2, 3, 4]), output=np.array([5, 6]), logprobs=np.zeros(2, np.float32))
    c2 = ModelCall(prompt=np.array([1, 2, 3, 4, 5, 6, 7]), output=np.array([8, 9, 10]), logprobs=np.zeros(3, np.float32))
    with TreeStore.open(tmp_path / "trees.zarr", "a", durable=False) as store:
        store.append([build_tree([c1, c2], run_id="r", task_id="t", reward=1.0)])
    sav = tree_savings(open_trees(tmp_path / "trees.zarr"))
    assert int(sav["tree_tokens"][0]) == 10               # every distinct token once
    assert int(sav["unpacked_tokens"][0]) == 6 + 10        # each call as its own sequence
    assert float(sav["savings"][0]) == pytest.approx(1.6)


def test_controller_style_flip_rows_and_config_give_every_cell_its_whole_history(tmp_path):
    # The fleet controller writes flip_start/flip_end rows naming the target role, and no
    # start rows; initial roles come from config.yaml (core 0 trains, the rest roll out).
    from gyre_hpc.config import build_config
    from gyre_hpc.rundir.metrics import EventRow
    from gyre_hpc.rundir.load import run_span
    (tmp_path / "config.yaml").write_text(build_config({"cells": {"count": 3}}).to_yaml())
    with MetricsWriter(tmp_path / "metrics.h5") as mw:
        mw.append([TimelineRow(1000, 1, "TRAIN", "flip_start"), TimelineRow(1002, 1, "TRAIN", "flip_end", duration_s=2),
                   TimelineRow(1050, 1, "ROLLOUT", "flip_start"), TimelineRow(1051, 1, "ROLLOUT", "flip_end")])
        mw.add(EventRow(990, "launch"))
        mw.add(StepRow(step=0, time=1100, wall_s=110))
    run = open_run(tmp_path)
    assert run_span(run) == (990.0, 1100.0)
    iv = role_intervals(run)
    got = sorted(zip(iv["cell"].values.tolist(), iv["state"].values.tolist(), iv["start"].values.tolist(),
                     iv["end"].values.tolist()))
    assert got == [(0, "TRAIN", 990, 1100),
                   (1, "ROLLOUT", 990, 1000), (1, "ROLLOUT", 1051, 1100), (1, "SWITCH", 1000, 1002),
                   (1, "SWITCH", 1050, 1051), (1, "TRAIN", 1002, 1050),
                   (2, "ROLLOUT", 990, 1100)]
    f = time_fractions(run)
    assert f["switch"] == pytest.approx(3 / 330) and f["train"] == pytest.approx((110 + 48) / 330)
