"""The tail estimator the runtime and the simulator share (``gyre_hpc.sched.tail``)."""
from __future__ import annotations

import math

import pytest

from gyre_hpc.sched.tail import RunProgress, tail_runs


def test_the_longest_open_runs_are_the_tail():
    open_runs = {f"r{i}": RunProgress(started=float(i)) for i in range(1, 8)}
    assert tail_runs(open_runs, 0.25) == {"r1", "r2"}
    assert tail_runs({}, 0.25) == set()
    assert tail_runs({"a": RunProgress(1.0)}, 0.1) == {"a"}     # at least one


def test_equal_starts_rank_the_slower_pace_later():
    open_runs = {"fast": RunProgress(0.0, calls=9), "slow": RunProgress(0.0, calls=2), "mid": RunProgress(0.0, 5)}
    assert tail_runs(open_runs, 0.3) == {"slow"}
    assert tail_runs(open_runs, 0.5) == {"slow", "mid"}


def test_runs_not_started_rank_last():
    open_runs = {"queued": RunProgress(math.inf), "old": RunProgress(3.0, calls=40)}
    assert tail_runs(open_runs, 0.5) == {"old"}


def test_a_fraction_outside_0_1_is_refused():
    with pytest.raises(ValueError, match="tail fraction"):
        tail_runs({"a": RunProgress(0.0)}, 0.0)


def test_the_runtime_and_the_simulator_call_this_estimator():
    """Pins the one estimator: the RL fleet's view and the simulator import this very function."""
    import gyre_hpc.rl.cluster_view as view
    import gyre_hpc.sim.cluster as cluster
    from gyre_hpc.sched import tail

    assert view.tail_runs is tail.tail_runs
    assert cluster.tail_runs is tail.tail_runs
