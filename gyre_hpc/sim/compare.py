"""Run every policy on one workload (the same sampled runs) and compare them.

The baselines (async, colocate) are measured in the same call as elastic, and the
speedups are their ratios, so a figure never compares against a number from elsewhere.
Each policy is also set against the workload's lower bounds (``bounds.py``), and at equal
tokens trained: a run cut by its wall-clock limit trains only what it generated, so
hours are scaled to the most tokens any policy trained before they are compared.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path

from gyre_hpc.sched.staleness import staleness_bound
from gyre_hpc.sim.batch import Batch
from gyre_hpc.sim.bounds import lower_bounds
from gyre_hpc.sim.cluster import FleetSim, policy_for, simulate
from gyre_hpc.sim.result import SimResult
from gyre_hpc.sim.workload import Workload

POLICIES = ("elastic", "async", "colocate")

# What the paper reports for its regime; printed beside the model's figures for the reader.
# The baselines' hours are what the paper preset is fitted to (sim/calibrate.py); elastic's
# is never used by the model.
PAPER_HOURS = {"elastic": 75.4, "async": 134.6, "colocate": 91.5}


def compare(w: Workload, policies: tuple[str, ...] = POLICIES, out: str | Path | None = None,
            tune_async: bool = True) -> dict:
    results: dict[str, SimResult] = {}
    policy_objs = {}
    for name in policies:
        policy_objs[name] = policy_for(w, name)
        results[name] = simulate(w, policy_objs[name], name)
        if out is not None:
            from gyre_hpc.sim.record import write_run
            write_run(results[name], w, Path(out) / name)
    report = {
        "workload": w.name, "cells": w.fleet.cells, "steps": w.steps, "runs_per_step": w.run.runs_per_step,
        "elastic_target_requests_per_engine": policy_for(w, "elastic").params.target_requests_per_engine,
        "engine_kv_capacity_tokens": w.engine.kv_capacity_tokens(),
        "policies": {k: {**r.summary(), "step_s": [round(x, 1) for x in r.step_s]} for k, r in results.items()},
    }
    if "async" in results:
        report["async_train_cells"] = w.async_split()
    report["speedup"] = speedups(results)
    if "colocate" in results:
        from gyre_hpc.sim.shape import regime_shape
        report["shape"] = regime_shape(w, results["colocate"])
    # Equal tokens trained: hours scaled to the most tokens any policy trained.
    most = max(r.tokens_trained for r in results.values())
    at_equal = {k: r.total_s * most / r.tokens_trained if r.tokens_trained else float("inf")
                for k, r in results.items()}
    report["equal_tokens"] = {
        "tokens_trained": {k: int(r.tokens_trained) for k, r in results.items()},
        "max_relative_difference": round(1 - min(r.tokens_trained for r in results.values()) / most, 6) if most else 0.0,
        "hours_at_equal_tokens": {k: round(v / 3600, 3) for k, v in at_equal.items()},
        "speedup": speedups_of({k: v for k, v in at_equal.items()}),
    }
    bounds = lower_bounds(w, {k: staleness_bound(p) for k, p in policy_objs.items()})
    bounds["over_bound"] = {k: round(results[k].total_h / bounds["policy_bound_h"][k], 3) for k in results}
    bounds["over_work_bound"] = {k: round(results[k].total_h / bounds["work_h"], 3) for k in results}
    report["lower_bound"] = bounds
    if tune_async:
        # Never only against a configured split: the best static split found by simulation.
        report["async_tuned"] = tuned = tuned_async(w, results.get("elastic"))
        if "elastic_over_async_tuned" in tuned:
            report["speedup"]["elastic_over_async_tuned"] = tuned["elastic_over_async_tuned"]
        if w.name == "paper":
            report["paper_async_check"] = async_check(w, tuned, results.get("async"))
    report["sim_wall_s"] = round(sum(r.sim_wall_s for r in results.values()), 2)
    if out is not None:
        report["run_dirs"] = {k: str(Path(out) / k) for k in results}
    return report


def speedups_of(total_s: dict[str, float]) -> dict[str, float]:
    out = {}
    if "elastic" in total_s:
        for base in ("async", "colocate"):
            if base in total_s:
                out[f"elastic_over_{base}"] = round(total_s[base] / total_s["elastic"], 3)
    return out


def speedups(results: dict[str, SimResult]) -> dict[str, float]:
    return speedups_of({k: r.total_s for k, r in results.items()})


def split_candidates(w: Workload) -> list[int]:
    """Train-cell counts worth trying: every one on small fleets, about 8 spread ones on
    large, from the fewest that hold the training state."""
    low, top = w.core_cells, w.fleet.cells - 1 - w.fleet.rollout_only
    stride = max(1, round((top - low) / 8))
    return sorted(set(range(low, top + 1, stride)) | {top})


def tuned_async(w: Workload, elastic: SimResult | None = None, search_steps: int = 6, prune: bool = False,
                batches: Mapping[int, Batch] | None = None) -> dict:
    """The async split that is fastest on this workload: searched on the first
    ``search_steps`` steps (a grid, then a climb to a split whose neighbours are no
    faster), then simulated in full. Async at this split is the strongest fixed-split
    baseline the model knows. With ``prune`` (the sensitivity sweep) a trial stops once its
    clock passes the best total so far (it cannot be the best): the split chosen and its
    hours are the same (ties go to the same split), but ``search_h`` holds only the trials
    that finished and ``search_pruned`` the others. ``batches``: the runs to search and
    simulate on (a window of a drifting run, ``sim.drift_report``) instead of sampled ones."""
    short = dataclasses.replace(w, steps=min(w.steps, search_steps))
    grid = split_candidates(w)
    tried: dict[int, float] = {}
    rank = {k: i for i, k in enumerate(grid)}   # the order the unpruned search tries them in: ties go to the first

    def best() -> int:
        return min(tried, key=lambda k: (tried[k], rank[k]))

    def trial(k: int) -> None:
        sw = dataclasses.replace(short, fleet=dataclasses.replace(short.fleet, async_train_cells=k))
        if prune and tried:
            got = FleetSim(sw, policy_for(sw, "async"), "async", batches).finishes_by(tried[best()])
            tried[k] = math.inf if got is None else got
        else:
            tried[k] = simulate(sw, policy_for(sw, "async"), "async", batches).total_s

    # Pruned, the likeliest splits go first so the rest stop early: outward from three quarters
    # of the way up (where the paper preset's best lies; the order changes no result).
    guess = grid[0] + 0.75 * (grid[-1] - grid[0])
    for k in (sorted(grid, key=lambda k: (abs(k - guess), -k)) if prune else grid):
        trial(k)
    top = w.fleet.cells - 1 - w.fleet.rollout_only
    while True:  # climb from the grid's best until both neighbours are no better
        pick = best()
        todo = [k for k in (pick - 1, pick + 1) if w.core_cells <= k <= top and k not in tried]
        if not todo:
            break
        for k in todo:
            rank[k] = len(rank)
            trial(k)
    full = dataclasses.replace(w, fleet=dataclasses.replace(w.fleet, async_train_cells=pick))
    r = simulate(full, policy_for(full, "async"), "async", batches)
    out = {"train_cells": pick, "total_h": round(r.total_h, 3), "search_steps": short.steps,
           "search_h": {str(k): round(v / 3600, 3) for k, v in sorted(tried.items()) if v < math.inf}}
    if prune:
        out["search_pruned"] = sorted(k for k, v in tried.items() if v == math.inf)
    if elastic is not None:
        out["elastic_over_async_tuned"] = round(r.total_s / elastic.total_s, 3)
    return out


def async_check(w: Workload, tuned: dict, configured: SimResult | None = None, within: float = 0.05) -> dict:
    """The paper's async hours as a check, not a target (its split is not published): the
    splits whose searched hours, scaled to the run's steps, come within ``within`` of them,
    and the configured split's own hours in full when it was simulated."""
    scale = w.steps / tuned["search_steps"]
    target = PAPER_HOURS["async"]
    full = {k: round(h * scale, 2) for k, h in tuned["search_h"].items()}
    out = {"paper_async_h": target, "hours_by_split": full, "scaled_from_steps": tuned["search_steps"],
           "splits_reproducing": [k for k, h in full.items() if abs(h / target - 1) <= within],
           "tuned_split": tuned["train_cells"], "tuned_h": tuned["total_h"]}
    if configured is not None:
        out["configured_split"] = w.async_split()
        out["configured_split_h"] = round(configured.total_h, 3)
    return out


def scaled(w: Workload, **changes) -> Workload:
    """Nested ``dataclasses.replace``: ``scaled(w, **{"fleet.cells": 16})``. Fields of one
    section change together, so a pair that is only valid jointly (cells and a split) can."""
    tree: dict = {}
    for path, value in changes.items():
        node = tree
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value

    def apply(obj, tree: dict):
        return dataclasses.replace(obj, **{
            k: apply(getattr(obj, k), v) if isinstance(v, dict) and dataclasses.is_dataclass(getattr(obj, k)) else v
            for k, v in tree.items()})
    return apply(w, tree)
