"""What a drifting workload does to the static split, and elastic against the splits a user has.

A user picks a split from a few probe steps and keeps it; the workload then drifts under it
(``Workload.drift``). This report sets, on the same sampled runs: the best static split of
each window of the run (does the drift move it?), the split the simulator's search finds on
the first tenth of the steps and then holds (what a user would run), the best split in
hindsight (the search over the whole drifted run), colocate, and elastic at staleness 0 and
at staleness 1 with no floor handed to it: with none at all (``train_floor_cells`` 0), and
with the floor it finds from what it measures each step (``policy.floor: observed``,
``sched.observed_floor``: nothing searched).
Every split comes from the one search there is, ``compare.tuned_async``.
"""
from __future__ import annotations

import dataclasses
import math
import time

from gyre_hpc.sim.batch import Batch, sample_batch
from gyre_hpc.sim.cluster import FleetSim, policy_for, simulate
from gyre_hpc.sim.compare import tuned_async
from gyre_hpc.sim.result import SimResult
from gyre_hpc.sim.workload import Workload, WorkloadError

EARLY_SHARE = 0.1   # the probe a user tunes the split on: the first tenth of the steps


def windows(steps: int, count: int) -> list[tuple[int, int]]:
    """``count`` consecutive step ranges ``[start, stop)`` covering ``steps`` as evenly as they can."""
    if count < 1 or count > steps:
        raise WorkloadError(f"windows={count}: must be in 1..{steps} (the run's steps)")
    edges = [round(i * steps / count) for i in range(count + 1)]
    return list(zip(edges[:-1], edges[1:]))


def window_batches(w: Workload, start: int, stop: int) -> dict[int, Batch]:
    """Steps ``start..stop-1`` of the drifted run, numbered from 0 as a run of their own: the
    same runs the whole run samples there, not a fresh draw."""
    return {i: dataclasses.replace(sample_batch(w, s), step=i) for i, s in enumerate(range(start, stop))}


def best_split_by_window(w: Workload, count: int) -> list[dict]:
    """The best static split of each window of ``w``'s steps, each searched on that window alone."""
    rows = []
    for start, stop in windows(w.steps, count):
        part = dataclasses.replace(w, steps=stop - start)
        got = tuned_async(part, search_steps=part.steps, prune=True, batches=window_batches(w, start, stop))
        rows.append({"steps": [start, stop - 1], "train_cells": got["train_cells"], "hours": got["total_h"]})
    return rows


def elastic_observed(w: Workload) -> tuple[SimResult, list[int]]:
    """Elastic at staleness 1 whose floor is set after each step from what it measured, and
    the floor it held at each step (the first: half the cells, nothing measured yet)."""
    wo = dataclasses.replace(w, policy=dataclasses.replace(w.policy, floor="observed"))
    sim = FleetSim(wo, policy_for(wo, "elastic", max_staleness=1, train_floor_cells=0), "elastic")
    return sim.run(), sim.floors


def drift_report(w: Workload, window_count: int = 4) -> dict:
    """The report above, with the ratios issue 55 asks for."""
    if not w.drift.points:
        raise WorkloadError("drift: the workload holds still (no drift.shape or drift.knots); "
                            "name a shape, e.g. --drift calls-grow-2x")
    t0 = time.perf_counter()
    by_window = best_split_by_window(w, window_count)
    early_steps = max(1, math.ceil(EARLY_SHARE * w.steps))
    early = tuned_async(w, search_steps=early_steps, prune=True)
    hindsight = tuned_async(w, search_steps=w.steps, prune=True)
    observed, floors = elastic_observed(w)
    hours = {"early_tuned": early["total_h"], "hindsight": hindsight["total_h"],
             "colocate": simulate(w, policy_for(w, "colocate"), "colocate").total_h,
             "elastic_s0": simulate(w, policy_for(w, "elastic"), "elastic").total_h,
             "elastic_s1_no_floor": simulate(w, policy_for(w, "elastic", max_staleness=1, train_floor_cells=0),
                                             "elastic").total_h,
             "elastic_s1_observed": observed.total_h}
    # The splits' hours come rounded from the search: every ratio is of the hours as reported.
    hours = {k: round(v, 3) for k, v in hours.items()}
    splits = [r["train_cells"] for r in by_window]
    return {
        "workload": w.name, "drift": w.drift.shape or "knots", "steps": w.steps, "cells": w.fleet.cells,
        "knots": [dataclasses.asdict(k) for k in w.drift.points],
        "best_split_by_window": by_window,
        "best_split_moves_cells": max(splits) - min(splits),
        "early_tuned": {"train_cells": early["train_cells"], "search_steps": early_steps},
        "hindsight": {"train_cells": hindsight["train_cells"], "search_steps": w.steps},
        "elastic_s1_observed_floors": floors,
        "hours": hours,
        "ratios": {
            "elastic_s1_no_floor_over_early_tuned": round(hours["early_tuned"] / hours["elastic_s1_no_floor"], 3),
            "elastic_s1_no_floor_over_hindsight": round(hours["hindsight"] / hours["elastic_s1_no_floor"], 3),
            "elastic_s1_observed_over_early_tuned": round(hours["early_tuned"] / hours["elastic_s1_observed"], 3),
            "elastic_s1_observed_over_hindsight": round(hours["hindsight"] / hours["elastic_s1_observed"], 3),
            "elastic_s0_over_colocate": round(hours["colocate"] / hours["elastic_s0"], 3),
            "hindsight_over_early_tuned": round(hours["early_tuned"] / hours["hindsight"], 3)},
        "wall_s": round(time.perf_counter() - t0, 1),
    }
