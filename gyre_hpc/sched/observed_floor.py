"""Elastic's train floor found from what the controller observes, with no search handed to it.

Off-policy (staleness >= 1) the next batch rolls out while this one trains, so a step lasts
about as long as the slower of the two sides. After each step the controller knows, for
that step: the engine-seconds its engines held requests and the replica-seconds its
trainers trained (and the longest run that finished, kept for reports). Spread over ``E``
engines and ``T`` trainers those predict the two sides as ``engine_s / E`` and
``train_s / T``; the floor is the ``T`` that balances them (the smaller of the two
maxima), and elastic releases and reclaims around it as it does around a searched split
(``ElasticParams.train_floor_cells``).

Why not also bound the step below by the longest run: with it, every split whose rollout
fits under the longest run ties, and either tie rule drifts. Ties to fewer trainers held
the paper preset's floor 1-2 cells under the best split (elastic at staleness 1, 0.963x of
hindsight on ``calls-grow-2x``); ties to more trainers ran away (each step's engines fewer,
its busy seconds more, 28 of 32 cells training, 0.726x). The balance alone tracked the best
split per window (docs/sim.md, "Elastic that finds its floor").

The figures are smoothed over steps (an exponential average) so that one step's long run
does not swing the split, and recent steps weigh most, so the floor follows a workload that
drifts. Nothing here reads the workload's sampled future: the simulator and a runtime
controller feed it the same measured quantities.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepObservation:
    """What one finished step measured: the engine-seconds with requests resident (every
    engine, released ones included while they served), the replica-seconds spent training,
    and the longest run that finished during it (seconds from its first call to its end)."""
    engine_busy_s: float
    train_busy_s: float
    longest_run_s: float

    def __post_init__(self) -> None:
        for name in ("engine_busy_s", "train_busy_s", "longest_run_s"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"StepObservation.{name}={v}: must be finite and >= 0")


@dataclass(frozen=True)
class FloorRange:
    """The splits the floor may take: ``cells`` in all, ``lowest`` the trainers that hold the
    training state (the core), ``highest`` the most that leave an engine serving."""
    cells: int
    lowest: int
    highest: int

    def __post_init__(self) -> None:
        if not 1 <= self.lowest <= self.highest <= self.cells - 1:
            raise ValueError(f"FloorRange lowest={self.lowest}, highest={self.highest}, cells={self.cells}: "
                             f"need 1 <= lowest <= highest <= cells - 1")


def smoothed(history: Sequence[StepObservation], weight: float) -> StepObservation:
    """The exponential average of the steps (``weight`` on the newest), oldest first."""
    if not 0 < weight <= 1:
        raise ValueError(f"observed floor smoothing={weight}: must be in (0, 1]")
    avg = history[0]
    for ob in history[1:]:
        avg = StepObservation(*(weight * new + (1 - weight) * old for new, old in (
            (ob.engine_busy_s, avg.engine_busy_s), (ob.train_busy_s, avg.train_busy_s),
            (ob.longest_run_s, avg.longest_run_s))))
    return avg


def predicted_step_s(ob: StepObservation, trainers: int, cells: int) -> float:
    """A step at ``trainers`` training and the rest serving: the slower side's busy seconds
    spread over its cells."""
    if not 1 <= trainers <= cells - 1:
        raise ValueError(f"trainers={trainers}: must be in 1..{cells - 1} (cells={cells})")
    return max(ob.engine_busy_s / (cells - trainers), ob.train_busy_s / trainers)


# The newest step's share of the average: 0.8 beat 0.5 on all three drift presets of the
# paper preset (docs/sim.md); the floor then follows a drift within two or three steps.
DEFAULT_WEIGHT = 0.8


def observed_floor(history: Sequence[StepObservation], bounds: FloorRange, weight: float = DEFAULT_WEIGHT) -> int:
    """The train floor for the next step from the steps measured so far: the split whose
    predicted step is shortest. Before any step is measured, half the cells (within the
    range): a start in the middle, not a search; with no floor at all the first step ran
    1.3x the next ones on the paper preset (elastic releases engines the batch then lacks),
    and on 8-step runs of small fleets that one step cost 2-4% of the run (docs/sim.md); a tie goes to fewer trainers, since
    elastic can release an engine to train but never turns a trainer into an engine below
    its floor."""
    if not history:
        return min(max(bounds.cells // 2, bounds.lowest), bounds.highest)
    ob = smoothed(history, weight)

    def key(t: int) -> tuple[float, float, int]:
        sides = max(ob.engine_busy_s / (bounds.cells - t), ob.train_busy_s / t)
        return round(predicted_step_s(ob, t, bounds.cells), 9), round(sides, 9), t
    return min(range(bounds.lowest, bounds.highest + 1), key=key)
