"""sched.observed_floor: the floor balances the measured engine- and replica-seconds, follows
the newest steps, and refuses what no controller could have measured."""
from __future__ import annotations

import math

import pytest

from gyre_hpc.sched.observed_floor import FloorRange, StepObservation, observed_floor, predicted_step_s, smoothed

BOUNDS = FloorRange(cells=10, lowest=1, highest=9)


def ob(engine: float, train: float, longest: float = 0.0) -> StepObservation:
    return StepObservation(engine_busy_s=engine, train_busy_s=train, longest_run_s=longest)


def test_half_the_cells_train_before_anything_is_measured():
    # No floor at all let elastic release engines the first batch then lacked (dd45224).
    assert observed_floor([], BOUNDS) == 5
    assert observed_floor([], FloorRange(cells=3, lowest=2, highest=2)) == 2     # held inside the range
    assert observed_floor([], FloorRange(cells=10, lowest=1, highest=3)) == 3


def test_the_floor_balances_engine_and_training_seconds():
    # 300 engine-s and 700 replica-s over 10 cells: 3 engines and 7 trainers take 100 s each.
    assert observed_floor([ob(300, 700)], BOUNDS) == 7
    assert observed_floor([ob(700, 300)], BOUNDS) == 3
    assert predicted_step_s(ob(300, 700), 7, 10) == pytest.approx(100.0)


def test_a_long_run_does_not_tie_every_split_down_to_the_fewest_trainers():
    # The longest run (500 s) exceeds either side at every split; the balance still decides.
    assert observed_floor([ob(300, 700, longest=500)], BOUNDS) == 7


def test_the_floor_stays_in_its_range():
    assert observed_floor([ob(0, 1000)], FloorRange(cells=10, lowest=2, highest=8)) == 8
    assert observed_floor([ob(1000, 0)], FloorRange(cells=10, lowest=2, highest=8)) == 2


def test_the_newest_steps_weigh_most_so_the_floor_follows_a_drift():
    history = [ob(300, 700)] * 5 + [ob(700, 300)] * 3
    assert observed_floor(history, BOUNDS, weight=0.8) == 3
    assert observed_floor(history, BOUNDS, weight=1.0) == 3
    assert smoothed([ob(0, 0), ob(10, 20, 30)], 0.5) == ob(5, 10, 15)


@pytest.mark.parametrize("field", ["engine_busy_s", "train_busy_s", "longest_run_s"])
def test_unmeasurable_observations_are_refused_by_field(field):
    kw = {"engine_busy_s": 1.0, "train_busy_s": 1.0, "longest_run_s": 1.0, field: math.nan}
    with pytest.raises(ValueError, match=field):
        StepObservation(**kw)


def test_bad_ranges_and_weights_are_refused():
    with pytest.raises(ValueError, match="lowest"):
        FloorRange(cells=4, lowest=3, highest=2)
    with pytest.raises(ValueError, match="smoothing"):
        observed_floor([ob(1, 1)], BOUNDS, weight=0.0)
    with pytest.raises(ValueError, match="trainers"):
        predicted_step_s(ob(1, 1), 10, 10)
