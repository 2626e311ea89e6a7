"""Measured workloads: the simulator's own figures come back out of a run directory."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from click.testing import CliRunner

from gyre_hpc.cli import main
from gyre_hpc.sim.cluster import policy_for, simulate
from gyre_hpc.sim.measure import batching_fit, lognormal_fit, measure
from gyre_hpc.sim.record import write_run
from gyre_hpc.sim.compare import scaled
from gyre_hpc.sim.workload import WorkloadError, load_workload, preset

# A join in place (a cell that applied the last update) costs less than one that moves the state.
TINY = scaled(dataclasses.replace(preset("tiny"), steps=3), **{"fleet.in_place_join_s": 0.25})


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("measured") / "elastic"
    write_run(simulate(TINY, policy_for(TINY, "elastic"), "elastic"), TINY, root)
    return root


def test_batching_fit_recovers_the_engine_curve():
    n = np.array([1, 2, 4, 8, 16, 32, 64], dtype=float)
    s1, h = 60.0, 100.0
    tps = s1 * (1 + h) * n / (n + h)
    got_s1, got_h = batching_fit(n, tps)
    assert got_s1 == pytest.approx(s1, rel=0.01) and got_h == pytest.approx(h, rel=0.02)


def test_lognormal_fit_recovers_median_and_sigma():
    x = 40 * np.exp(0.7 * np.random.default_rng(1).standard_normal(50_000))
    fit = lognormal_fit(x)
    assert fit["median"] == pytest.approx(40, rel=0.02) and fit["sigma"] == pytest.approx(0.7, rel=0.02)


def test_a_simulated_run_gives_back_the_figures_it_was_run_with(sim_run):
    m = measure(sim_run)
    o = m.overrides
    f, e = TINY.fleet, TINY.engine
    # Every cell holds the core's state from the launch on and elastic trains every cell at a
    # batch's end, so every join is in place: the cost of one that moves the state is not told.
    assert (o["fleet"]["in_place_join_s"], o["fleet"]["train_to_rollout_s"]) == (f.in_place_join_s, f.train_to_rollout_s)
    assert o["fleet"]["cells"] == f.cells and o["steps"] == TINY.steps
    assert (o["run"]["tasks_per_step"], o["run"]["runs_per_task"], o["run"]["timeout_s"]) == (
        TINY.run.tasks_per_step, TINY.run.runs_per_task, TINY.run.timeout_s)
    assert o["engine"]["single_seq_tokens_per_s"] == pytest.approx(e.single_seq_tokens_per_s, rel=0.02)
    assert o["engine"]["half_saturation_seqs"] == pytest.approx(e.half_saturation_seqs, rel=0.05)
    # per replica, with the all-reduce share in it (and then not taken off again)
    assert o["train"] == {"tokens_per_s": TINY.train.tokens_per_s * (1 - TINY.train.dp_sync_overhead),
                          "dp_sync_overhead": 0.0}
    assert o["run"]["calls"]["median"] == pytest.approx(TINY.run.calls.median, rel=0.35)
    # what the run could not tell is said, per field
    assert set(m.not_measured) == {"run.output_tokens", "run.context_tokens", "run.tool_s", "fleet.rollout_to_train_s"}
    assert m.not_measured["fleet.rollout_to_train_s"] == "no completed join that moved the state in the timeline"
    assert m.real["policy"] == "elastic" and m.real["steps"] == TINY.steps
    # each figure is rounded to the millisecond: the sum of the steps by up to half a ms each
    assert m.real["total_s"] == pytest.approx(sum(m.real["step_s"]), abs=5e-4 * (len(m.real["step_s"]) + 1))


def test_tokens_per_call_come_from_trees_zarr(tmp_path):
    from gyre_hpc.sim.sample import write_synthetic_trees
    from gyre_hpc.rundir.metrics import MetricsWriter, TimelineRow
    write_synthetic_trees(tmp_path, steps=1)
    with MetricsWriter(tmp_path / "metrics.h5") as mw:
        mw.add(TimelineRow(0, 0, "TRAIN", "start"))
    m = measure(tmp_path)
    from gyre_hpc.rundir.load import open_trees
    t = open_trees(tmp_path / "trees.zarr")
    trained = np.array([t["trained"].values[a:a + n].sum()
                        for a, n in zip(t["token_offset"].values, t["n_tokens"].values)])
    expect = lognormal_fit(trained / t["n_paths"].values)
    assert m.overrides["run"]["output_tokens"]["median"] == pytest.approx(expect["median"], rel=1e-4)
    assert "no readable config.yaml" in m.not_measured["fleet.cells"]


def test_tokens_trained_per_tree_token_come_from_the_micro_batches(tmp_path):
    from gyre_hpc.rundir.load import open_trees
    from gyre_hpc.rundir.metrics import EventRow, MetricsWriter, TimelineRow
    from gyre_hpc.sim.sample import write_synthetic_trees
    write_synthetic_trees(tmp_path, steps=1)
    total = float(open_trees(tmp_path / "trees.zarr")["n_tokens"].values.sum())
    with MetricsWriter(tmp_path / "metrics.h5") as mw:
        mw.add(TimelineRow(0, 0, "TRAIN", "start"))
        mw.append([EventRow(1.0, "train_mb", 1, f"cell=0 rank=1 mb={k} tokens={int(total * 0.3)} seconds=1.0")
                   for k in range(2)])
    m = measure(tmp_path)
    assert m.overrides["run"]["trained_per_token"] == pytest.approx(2 * int(total * 0.3) / total, rel=1e-4)
    assert "run.trained_per_token" not in m.not_measured


def test_the_simulator_trains_a_runs_tokens_times_its_packing():
    w = scaled(TINY, **{"steps": 1})
    full = simulate(w, policy_for(w, "colocate"), "colocate")
    packed = simulate(scaled(w, **{"run.trained_per_token": 0.5}), policy_for(w, "colocate"), "colocate")
    assert packed.tokens_trained == pytest.approx(0.5 * full.tokens_trained, rel=1e-9)
    with pytest.raises(WorkloadError, match="run.trained_per_token=0"):
        scaled(w, **{"run.trained_per_token": 0.0})


def test_sim_measured_from_compares_with_the_run_and_saves_a_workload(sim_run, tmp_path):
    saved = tmp_path / "measured.yaml"
    r = CliRunner().invoke(main, ["sim", "--preset", "tiny", "--measured-from", str(sim_run), "--no-record",
                                  "--json", "--save-workload", str(saved)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert rep["real"]["policy"] == "elastic"
    assert rep["sim_over_real"] == pytest.approx(rep["policies"]["elastic"]["total_s"] / rep["real"]["total_s"], abs=1e-3)
    w = load_workload(saved)
    assert w.fleet.rollout_to_train_s == TINY.fleet.rollout_to_train_s and w.train.dp_sync_overhead == 0.0
    r = CliRunner().invoke(main, ["sim", "--measured-from", str(tmp_path / "nope")])
    assert r.exit_code != 0 and "does not exist" in r.output
