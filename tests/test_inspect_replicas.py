"""``inspect``'s readings of streaming training and paced cells, from events alone."""
from __future__ import annotations

import pytest

import numpy as np

from gyre_hpc.rundir.inspect import pace_summary, replica_finish, step_start_times


def mb(t, step, cell, seconds):
    return (t, "train_mb", step, f"cell={cell} rank={cell + 1} mb=0 tokens=100 seconds={seconds}")


def test_replica_finish_is_the_spread_of_each_cells_last_micro_batch():
    events = [mb(10.0, 1, 0, 2.0), mb(14.0, 1, 0, 4.0), mb(13.0, 1, 2, 5.0),   # step 1: ends 14 and 13
              mb(20.0, 2, 0, 1.0),                                            # step 2: one replica only
              (15.0, "pace", 1, "EMULATED cell=0 replica intervals=1 paced_s=1 real_s=1 overruns=0 overrun_s=0 share=0")]
    r = replica_finish(events)
    # span: first start 8.0 (13 - 5) to the last end 14.0; spread 1.0. Cell 2 ran out at 13, while
    # cell 0's [10, 14] trained; nothing started after 13.
    assert r["steps"] == {1: {"last_end_s": {0: 6.0, 2: 5.0}, "spread_s": 1.0, "share": pytest.approx(1 / 6, abs=1e-4),
                              "started_after_first_end": 0, "longest_in_flight_s": 4.0}}
    assert r["max_share"] == pytest.approx(1 / 6, abs=1e-4)
    assert r["max_share_of_step"] is None                                  # no step starts given
    assert replica_finish([(1.0, "launch", 0, "")]) is None


def test_the_spread_as_a_share_of_the_step_counts_from_the_steps_start():
    """Step 1 started at 4.0 (its rollouts), training from 8.0: the 1.0 s spread is 1/6 of the
    training span and 1/10 of the step up to its last end (14.0)."""
    events = [mb(10.0, 1, 0, 2.0), mb(14.0, 1, 0, 4.0), mb(13.0, 1, 2, 5.0)]
    r = replica_finish(events, {1: 4.0})
    assert r["steps"][1]["share"] == pytest.approx(1 / 6, abs=1e-4)
    assert r["steps"][1]["share_of_step"] == pytest.approx(0.1) and r["max_share_of_step"] == pytest.approx(0.1)
    assert "share_of_step" not in replica_finish(events, {2: 0.0})["steps"][1]   # another step's start only


def test_step_start_times_are_row_time_less_wall_time_and_the_last_row_wins():
    steps = {"step": np.array([1, 2, 2]), "time": np.array([40.0, 75.0, 130.0]), "wall_s": np.array([30.0, 35.0, 32.0])}
    assert step_start_times(steps) == {1: 10.0, 2: 98.0}


def test_a_micro_batch_started_after_a_replica_ran_out_is_counted_against_the_dealing():
    """Cell 1 ran out at 4; cell 0 then started a 3 s micro-batch that cell 1 could have taken."""
    events = [mb(4.0, 1, 1, 4.0), mb(3.0, 1, 0, 3.0), mb(8.0, 1, 0, 3.0)]
    f = replica_finish(events)["steps"][1]
    assert f["spread_s"] == 4.0 and f["started_after_first_end"] == 1 and f["longest_in_flight_s"] == 0.0


def test_pace_summary_takes_each_cells_last_record_and_the_overrun_share():
    rec = "EMULATED cell={c} {role} intervals=4 paced_s={p} real_s=1.0 overruns=1 overrun_s={o} share=0"
    events = [(1.0, "pace", 0, rec.format(c=1, role="engine", p=10.0, o=1.0)),
              (2.0, "pace", 1, rec.format(c=1, role="engine", p=20.0, o=1.0)),    # cumulative: the later one counts
              (2.0, "pace", 1, rec.format(c=0, role="replica", p=5.0, o=0.0))]
    s = pace_summary(events)
    assert s["emulated"] is True and s["step"] == 1
    assert s["paced_s"] == 25.0 and s["overrun_s"] == 1.0 and s["overrun_share"] == pytest.approx(0.04)
    assert set(s["cells"]) == {"1:engine", "0:replica"}
    assert pace_summary([]) is None


def test_a_step_trained_again_after_a_relaunch_is_read_from_the_launch_that_trained_it_last():
    """A kill between checkpoints: step 2's first attempt (cells 0 and 1, ending far apart)
    stays in the table; the relaunch trains it again on cells 0 and 2."""
    events = [(0.0, "fleet_start", 1, "rl fresh"),
              mb(10.0, 1, 0, 2.0), mb(10.5, 1, 1, 2.0),
              mb(20.0, 2, 0, 2.0), mb(29.0, 2, 1, 2.0),                           # killed after these
              (40.0, "fleet_resume", 2, "rl resume"),
              mb(50.0, 2, 0, 2.0), mb(50.4, 2, 2, 2.0)]
    r = replica_finish(events)
    assert set(r["steps"]) == {1, 2}
    assert r["steps"][2] == {"last_end_s": {0: 2.0, 2: 2.4}, "spread_s": 0.4, "share": pytest.approx(0.4 / 2.4, abs=1e-4),
                             "started_after_first_end": 0, "longest_in_flight_s": 2.0}
    assert r["steps"][1]["spread_s"] == 0.5


def test_pace_records_count_from_zero_in_each_launch_and_are_summed_over_launches():
    rec = "EMULATED cell={c} engine intervals=4 paced_s={p} real_s=1.0 overruns=1 overrun_s={o} share=0"
    events = [(0.0, "fleet_start", 1, "rl fresh"),
              (1.0, "pace", 1, rec.format(c=1, p=10.0, o=1.0)),
              (2.0, "pace", 2, rec.format(c=1, p=20.0, o=2.0)),     # the first launch's last: 20 s, 2 over
              (3.0, "fleet_resume", 2, "rl resume"),
              (4.0, "pace", 2, rec.format(c=1, p=5.0, o=0.0))]       # the relaunch's own count
    s = pace_summary(events)
    assert s["paced_s"] == 25.0 and s["overrun_s"] == 2.0 and s["overrun_share"] == pytest.approx(0.08)
    assert s["cells"]["1:engine"]["intervals"] == 8 and s["cells"]["1:engine"]["share"] == pytest.approx(0.08)
