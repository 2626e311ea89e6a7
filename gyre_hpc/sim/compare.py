"""Run every policy on one workload (the same sampled runs) and compare them.

The baselines (async, colocate) are measured in the same call as elastic, and the
speedups are their ratios, so a figure never compares against a number from elsewhere.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from gyre_hpc.sim.cluster import policy_for, simulate
from gyre_hpc.sim.result import SimResult
from gyre_hpc.sim.workload import Workload

POLICIES = ("elastic", "async", "colocate")

# What the paper reports for its regime; printed beside the model's figures for the reader,
# never used by the model.
PAPER_HOURS = {"elastic": 75.4, "async": 134.6, "colocate": 91.5}


def compare(w: Workload, policies: tuple[str, ...] = POLICIES, out: str | Path | None = None) -> dict:
    results: dict[str, SimResult] = {}
    for name in policies:
        results[name] = simulate(w, policy_for(w, name), name)
        if out is not None:
            from gyre_hpc.sim.record import write_run
            write_run(results[name], w, Path(out) / name)
    report = {
        "workload": w.name, "cells": w.fleet.cells, "steps": w.steps, "runs_per_step": w.run.runs_per_step,
        "async_train_cells": w.async_split(), "elastic_target_requests_per_engine": w.engine.target_seqs(),
        "policies": {k: {**r.summary(), "step_s": [round(x, 1) for x in r.step_s]} for k, r in results.items()},
    }
    speedups = {}
    if "elastic" in results:
        for base in ("async", "colocate"):
            if base in results:
                speedups[f"elastic_over_{base}"] = round(results[base].total_s / results["elastic"].total_s, 3)
    report["speedup"] = speedups
    report["sim_wall_s"] = round(sum(r.sim_wall_s for r in results.values()), 2)
    if out is not None:
        report["run_dirs"] = {k: str(Path(out) / k) for k in results}
    return report


def scaled(w: Workload, **changes) -> Workload:
    """Nested ``dataclasses.replace``: ``scaled(w, **{"fleet.cells": 16})``."""
    for path, value in changes.items():
        parts = path.split(".")
        def rebuild(obj, parts):
            if len(parts) == 1:
                return dataclasses.replace(obj, **{parts[0]: value})
            return dataclasses.replace(obj, **{parts[0]: rebuild(getattr(obj, parts[0]), parts[1:])})
        w = rebuild(w, parts)
    return w
