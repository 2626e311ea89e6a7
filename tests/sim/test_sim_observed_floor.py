"""The simulator feeds elastic's observed floor (policy.floor: observed) what a controller
measures after each step, and elastic holds the floor it gets."""
from __future__ import annotations

import dataclasses

import pytest

from gyre_hpc.sim.cluster import FleetSim, policy_for
from gyre_hpc.sim.compare import scaled
from gyre_hpc.sim.workload import WorkloadError, override, preset

TINY = scaled(preset("tiny"), steps=4)


def test_observed_floor_is_set_after_each_step_from_measured_busy_seconds():
    w = override(TINY, {"policy": {"floor": "observed"}})
    sim = FleetSim(w, policy_for(w, "elastic", max_staleness=1), "elastic")
    sim.run()
    assert len(sim.floors) == w.steps and len(sim.floor_history) == w.steps - 1
    assert sim.floors[0] == w.fleet.cells // 2   # nothing measured yet: the middle
    assert all(w.core_cells <= f <= w.fleet.cells - 1 for f in sim.floors)
    assert all(ob.engine_busy_s > 0 and ob.train_busy_s > 0 for ob in sim.floor_history)
    assert sim.policy.params.train_floor_cells == sim.floors[-1]


def test_a_given_floor_is_left_alone():
    sim = FleetSim(TINY, policy_for(TINY, "elastic", max_staleness=1, train_floor_cells=2), "elastic")
    sim.run()
    assert sim.floors == [] and sim.policy.params.train_floor_cells == 2


def test_an_unknown_floor_source_is_refused_by_field():
    with pytest.raises(WorkloadError, match="policy.floor='searched'"):
        override(TINY, {"policy": {"floor": "searched"}})
    assert dataclasses.replace(TINY.policy, floor="given").floor == "given"
