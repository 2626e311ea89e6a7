"""Trace-driven forecasts (``sim.trace``): a real run's own runs replayed as the simulator's batches."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gyre_hpc.rundir.metrics import MetricsWriter, RunRow
from gyre_hpc.sim.cluster import policy_for, simulate
from gyre_hpc.sim.trace import trace_batches
from gyre_hpc.sim.workload import WorkloadError, preset


def _runs(path, rows):
    with MetricsWriter(path / "metrics.h5") as w:
        w.append([RunRow(time=0.0, step=s, run_id=rid, task_id="same-task", status="finished", reward=0.0, wall_s=wall,
                         calls=calls, model_s=model) for s, rid, calls, wall, model in rows])


def test_a_traced_batch_holds_each_runs_calls_environment_gaps_and_group(tmp_path):
    _runs(tmp_path, [(1, "s00001-t3-g0", 3, 10.0, 4.0), (1, "s00001-t3-g1", 3, 7.0, 3.0),
                     (1, "s00001-t7-g0", 1, 2.0, 2.0), (2, "s00002-t1-g0", 2, 5.0, 1.0)])
    w = preset("paper-local")
    b = trace_batches(w, tmp_path)
    assert sorted(b) == [0, 1]                             # the run's first step is step 0
    assert b[0].calls == [3, 3, 1] and b[0].group == [0, 0, 1]
    # (wall - model) / (calls - 1) after each call; the last call's is never waited for.
    assert b[0].tool_s[0][:2] == pytest.approx([3.0, 3.0]) and b[0].tool_s[1][:2] == pytest.approx([2.0, 2.0])
    assert b[1].calls == [2] and b[1].tool_s[0][0] == pytest.approx(4.0)
    # Simulated, each run lasts at least its replayed environment time plus its decode.
    r = simulate(dataclasses.replace(w, steps=2), policy_for(w, "colocate"), "colocate", b)
    walls = {(row.step, row.run_id): row.wall_s for row in r.runs}
    assert walls[(0, "s0-r0")] >= 6.0 and walls[(0, "s0-r1")] >= 4.0 and walls[(1, "s1-r0")] >= 4.0


def test_every_policy_replays_the_same_trace_and_a_sampled_forecast_differs(tmp_path):
    rng = np.random.default_rng(1)
    rows = [(1, f"s00001-t{k}-g{g}", 3, float(6 + 20 * rng.random()), 3.0) for k in range(12) for g in range(4)]
    _runs(tmp_path, rows)
    w = dataclasses.replace(preset("paper-local"), steps=1)
    b = trace_batches(w, tmp_path)
    ends = {p: max(row.wall_s for row in simulate(w, policy_for(w, p), p, b).runs) for p in ("colocate", "elastic")}
    slowest = max(wall - model for _, _, _, wall, model in rows)
    assert all(e >= slowest for e in ends.values())        # the slowest run's own waits bound every policy
    sampled = max(row.wall_s for row in simulate(w, policy_for(w, "colocate"), "colocate").runs)
    assert sampled != pytest.approx(ends["colocate"])


def test_runs_without_the_runtimes_ids_are_grouped_by_task_and_an_empty_table_is_refused(tmp_path):
    with MetricsWriter(tmp_path / "metrics.h5") as w:
        w.append([RunRow(time=0.0, step=0, run_id=f"s0-r{i}", task_id=f"s0-t{i // 2}", status="finished", reward=0.0,
                         wall_s=4.0, calls=2, model_s=1.0) for i in range(4)])
    assert trace_batches(preset("paper-local"), tmp_path)[0].group == [0, 0, 1, 1]
    (tmp_path / "empty").mkdir()
    with MetricsWriter(tmp_path / "empty" / "metrics.h5") as w:
        w.append([])
    with pytest.raises((WorkloadError, KeyError)):
        trace_batches(preset("paper-local"), tmp_path / "empty")
